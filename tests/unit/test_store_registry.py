"""``open_store``: the one place a store URL becomes a store."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from contextsvc.config import Settings
from contextsvc.stores import FilesStore, MemoryStore, open_store


def test_memory() -> None:
    assert isinstance(open_store("memory", Settings()), MemoryStore)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("files:./.contextsvc", Path(".contextsvc")),
        ("files:/var/lib/ctx", Path("/var/lib/ctx")),
        ("files://relative/dir", Path("relative/dir")),
        ("files:///var/lib/ctx", Path("/var/lib/ctx")),
    ],
)
def test_files(url: str, expected: Path) -> None:
    store = open_store(url, Settings())
    assert isinstance(store, FilesStore)
    assert store.root == expected


@pytest.mark.parametrize("url", ["files:~/ctx-data", "files://~/ctx-data"])
def test_a_files_path_from_the_home_folder_is_expanded(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No shell expands "~" in "files:~/…" (a config file, an environment variable, even a flag):
    the store made a directory named "~" in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    store = open_store(url, Settings())
    assert isinstance(store, FilesStore)
    assert store.root == tmp_path / "ctx-data"


@pytest.mark.parametrize("url", ["", "sqlite:///x", "file:/tmp/x", "mem", "files:", "files://", "redis://h"])
def test_anything_else_is_a_value_error_naming_the_accepted_forms(url: str) -> None:
    with pytest.raises(ValueError, match="files:PATH") as raised:
        open_store(url, Settings())
    assert not isinstance(raised.value, LookupError)


@pytest.mark.parametrize("url", ["postgres://u@127.0.0.1:5433/db", "postgresql://u@127.0.0.1/db"])
def test_postgres_is_imported_lazily(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = importlib.import_module

    def no_postgres(name: str, package: str | None = None) -> object:
        if name == "contextsvc.stores.postgres":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", no_postgres)
    with pytest.raises(ValueError, match="PostgreSQL store is not available"):
        open_store(url, Settings())
