"""The store kinds the conformance suite runs against, in one registry.

A kind's ``make`` builds a ``Backing``: one empty backing store (a directory, a database, a shared
memory area) that can be opened as many times as a test likes, so a test can write through one
store object, close it (or abandon it, like a crashed process) and read through a fresh one.

Adding a store is one entry in ``STORE_KINDS``. ``fixtures`` names the pytest fixtures ``make``
needs; the conformance fixture requests them by name and passes them as keyword arguments. The
PostgreSQL kind takes ``postgres_dsn`` (a session-scoped fixture that starts a private cluster,
tests/support/postgres.py); its ``make`` returns a Backing over a fresh, empty database (every
``make`` call must give an empty store: the suite counts sessions and blobs).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from contextsvc.config import Settings
from contextsvc.ports import Clock, SessionStore
from contextsvc.stores.files import FilesStore
from contextsvc.stores.memory import MemoryData, MemoryStore
from tests.support.postgres import make_postgres


class TickingClock:
    """A deterministic clock: every ``now()`` is one millisecond after the previous one."""

    def __init__(self, start: datetime = datetime(2026, 1, 1, tzinfo=UTC), step: timedelta = timedelta(milliseconds=1)):
        self.current = start
        self.step = step

    def now(self) -> datetime:
        self.current += self.step
        return self.current


class Backing(Protocol):
    """One backing store that can be opened again and again."""

    async def open(self, *, clock: Clock | None = None, settings: Settings | None = None) -> SessionStore:
        """A new store object over the same data, already opened."""
        ...

    async def count_blobs(self) -> int:
        """How many blobs are physically stored (to check content addressing stores once)."""
        ...

    async def dispose(self) -> None:
        """Close every store this backing opened and release the data."""
        ...


class _BackingBase:
    def __init__(self) -> None:
        self.opened: list[SessionStore] = []

    async def dispose(self) -> None:
        for store in self.opened:
            await store.close()  # closing twice is allowed; a test may have closed it already


class MemoryBacking(_BackingBase):
    """Memory stores sharing one ``MemoryData``: a reopened store sees what the first one wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.data = MemoryData()

    async def open(self, *, clock: Clock | None = None, settings: Settings | None = None) -> SessionStore:
        store = MemoryStore(settings, clock=clock, data=self.data)
        await store.open()
        self.opened.append(store)
        return store

    async def count_blobs(self) -> int:
        return len(self.data.blobs)


class FilesBacking(_BackingBase):
    """Files stores over one data directory: a reopened store reloads every log from disk."""

    def __init__(self, root: Path, *, cache_mb: float | None = None) -> None:
        super().__init__()
        self.root = root
        #: ``files.cache_mb`` for every store opened (None: the given settings' value).
        self.cache_mb = cache_mb

    async def open(self, *, clock: Clock | None = None, settings: Settings | None = None) -> SessionStore:
        # One process owns a data directory (an flock): a store opened again stands for the next
        # process, so the older objects let go as a dead process would.
        for old in self.opened:
            if isinstance(old, FilesStore):
                old._dir_lock.release()
        if self.cache_mb is not None:
            base = settings if settings is not None else Settings()
            files = base.files.model_copy(update={"cache_mb": self.cache_mb})
            settings = base.model_copy(update={"files": files})
        store = FilesStore(self.root, settings, clock=clock)
        await store.open()
        self.opened.append(store)
        return store

    async def count_blobs(self) -> int:
        return sum(1 for p in (self.root / "blobs").glob("*/*") if not p.name.startswith("."))


async def make_memory() -> Backing:
    return MemoryBacking()


async def make_files(tmp_path: Path) -> Backing:
    return FilesBacking(tmp_path / "data")


async def make_files_evicting(tmp_path: Path) -> Backing:
    """The files store holding no session it is not using: every call after another session's
    loads its rows from the log again (lazy loading and eviction under the whole suite)."""
    return FilesBacking(tmp_path / "data", cache_mb=0)


@dataclass(frozen=True)
class StoreKind:
    name: str
    #: pytest fixtures ``make`` needs, passed to it as keyword arguments of the same names.
    fixtures: tuple[str, ...]
    make: Callable[..., Awaitable[Backing]]


STORE_KINDS: tuple[StoreKind, ...] = (
    StoreKind("memory", (), make_memory),
    StoreKind("files", ("tmp_path",), make_files),
    StoreKind("files-evicting", ("tmp_path",), make_files_evicting),
    StoreKind("postgres", ("postgres_dsn",), make_postgres),
)


def store_kind(name: str) -> StoreKind:
    for kind in STORE_KINDS:
        if kind.name == name:
            return kind
    raise KeyError(name)


def fixture_args(kind: StoreKind, getfixturevalue: Callable[[str], Any]) -> dict[str, Any]:
    return {name: getfixturevalue(name) for name in kind.fixtures}
