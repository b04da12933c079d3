"""The hexagon read from the imports (DESIGN §3): the core imports no adapter or wire library,
the use cases see ports only, and the PostgreSQL adapter is one package reached through its
public entry."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from contextsvc.stores import postgres

ROOT = Path(__file__).resolve().parents[2] / "contextsvc"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, absolute (``from . import x`` resolved against the package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def files_under(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def offending(folder: str, prefixes: tuple[str, ...]) -> dict[str, list[str]]:
    bad: dict[str, list[str]] = {}
    for path in files_under(folder):
        hits = sorted(m for m in imported_modules(path) if m.startswith(prefixes))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    return bad


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        ("core", ("grpc", "google.protobuf", "asyncpg", "httpx", "websockets", "contextsvc.stores", "contextsvc.api")),
        ("core", ("contextsvc.summarizers", "contextsvc.events", "contextsvc.engine", "contextsvc._gen")),
        (
            "engine",
            ("grpc", "google.protobuf", "asyncpg", "httpx", "contextsvc.stores", "contextsvc.events", "contextsvc.api"),
        ),
        ("engine", ("contextsvc.summarizers", "contextsvc._gen")),
    ],
)
def test_inner_layers_import_no_adapter(folder: str, forbidden: tuple[str, ...]) -> None:
    assert offending(folder, forbidden) == {}


def test_the_postgres_adapter_is_one_package() -> None:
    # No PostgreSQL module outside the package, and nothing outside it reaches below its entry.
    assert not list((ROOT / "stores").glob("pg_*.py"))
    assert not (ROOT / "stores" / "postgres.py").exists()
    assert not (ROOT / "events" / "postgres_bus.py").exists()
    package = ROOT / "stores" / "postgres"
    assert {p.name for p in package.glob("*.py")} >= {"__init__.py", "store.py", "bus.py", "schema.py", "pool.py"}
    for path in ROOT.rglob("*.py"):
        if package in path.parents or "_gen" in path.parts:
            continue
        public = {f"contextsvc.stores.postgres.{name}" for name in postgres.__all__}
        deep = sorted(
            m for m in imported_modules(path) if m.startswith("contextsvc.stores.postgres.") and m not in public
        )
        assert deep == [], f"{path.relative_to(ROOT)} reaches into the PostgreSQL adapter: {deep}"


def test_the_postgres_bus_reaches_no_other_folder() -> None:
    bus = ROOT / "stores" / "postgres" / "bus.py"
    others = sorted(
        m
        for m in imported_modules(bus)
        if m.startswith("contextsvc.stores.") and not m.startswith("contextsvc.stores.postgres")
    )
    assert all(m.startswith("contextsvc.stores._session") for m in others), others


def test_the_core_reads_settings_sections_not_the_environment() -> None:
    """docs/design.md, "Settings in the core": the core takes the plain section models of
    ``contextsvc.config`` (no I/O, validated once at the edge); only profile resolution sees the
    root ``Settings``, and nothing in the core reads the environment or pydantic-settings."""
    root_users = []
    for path in files_under("core"):
        imported = imported_modules(path)
        assert not any(m.startswith(("pydantic_settings", "os.environ", "dotenv")) for m in imported), path
        assert "os" not in imported, f"{path.relative_to(ROOT)} imports os"
        if "contextsvc.config.Settings" in imported:
            root_users.append(str(path.relative_to(ROOT)))
    assert root_users == ["core/profile.py"]
