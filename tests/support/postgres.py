"""PostgreSQL for tests: one server per test session and a fresh database per test.

``postgres_dsn`` (session scope) is ``PGTEST_DSN`` when set (a superuser URL: tests create
databases and roles), else a private throwaway cluster started with ``scripts/pg-test-cluster.sh``
in a temporary directory and stopped at the end. ``postgres_db`` (function scope) is a DSN to a
new, empty database created from template0 and dropped after the test.

``scripts/test.sh`` (and so CI) must pass on a fresh machine, where nothing of PostgreSQL is
installed: the first ``start`` of the cluster script then runs, as root, ``apt-get update`` and
``DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql postgresql-contrib`` (waiting for a
dpkg lock another install holds), creates the ``postgres`` system user if the server programs are
there without it, and picks the newest server-program folder dpkg lists for ``initdb``. As
another user it stops with that install command instead. The first start on such a machine takes
a minute or two (the install), bounded by ``PgCluster``'s 600 s; later starts take seconds.

Register the fixtures in a conftest with ``from tests.support.postgres import postgres_db,
postgres_dsn``. ``make_postgres`` is the conformance suite's ``StoreKind`` factory::

    StoreKind("postgres", ("postgres_dsn",), make_postgres)
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from contextsvc.config import Settings
from contextsvc.ports import Clock, SessionStore
from contextsvc.stores.postgres import PostgresStore, make_postgres_store

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pg-test-cluster.sh"


class PgCluster:
    """A throwaway cluster in its own directory, driven by scripts/pg-test-cluster.sh."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.url = ""

    @classmethod
    def create(cls) -> PgCluster:
        # Directly under /tmp: short enough for the Unix socket path, and reachable by the
        # postgres user (pytest's own temp dirs are private to root).
        return cls(Path(tempfile.mkdtemp(prefix="ctxpg-", dir="/tmp")))

    def _run(self, command: str) -> str:
        done = subprocess.run(
            [str(SCRIPT), command, str(self.directory)], capture_output=True, text=True, timeout=600, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"pg-test-cluster.sh {command} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout.strip()

    def start(self) -> str:
        self.url = self._run("start")
        return self.url

    def stop(self) -> None:
        self._run("stop")

    def postmaster_pid(self) -> int:
        """The running cluster's postmaster (the first line of its ``postmaster.pid``)."""
        return int((self.directory / "data" / "postmaster.pid").read_text().split("\n", 1)[0])

    def remove(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


class _SharedCluster:
    """One cluster per test process, however many conftests import ``postgres_dsn`` (each import
    is its own fixture definition, and would otherwise start its own server)."""

    cluster: PgCluster | None = None
    users = 0

    @classmethod
    def acquire(cls) -> str:
        if cls.cluster is None:
            cluster = PgCluster.create()
            try:
                cluster.start()
            except BaseException:
                cluster.remove()
                raise
            cls.cluster = cluster
        cls.users += 1
        return cls.cluster.url

    @classmethod
    def release(cls) -> None:
        cls.users -= 1
        if cls.users == 0 and cls.cluster is not None:
            cluster, cls.cluster = cls.cluster, None
            cluster.remove()


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A superuser DSN of a running PostgreSQL for the whole test session."""
    external = os.environ.get("PGTEST_DSN")
    if external:
        yield external
        return
    url = _SharedCluster.acquire()
    try:
        yield url
    finally:
        _SharedCluster.release()


def with_database(dsn: str, database: str, *, user: str | None = None) -> str:
    """``dsn`` pointing at another database (and optionally another role)."""
    parts = urlsplit(dsn)
    netloc = parts.netloc
    if user is not None:
        netloc = f"{user}@{netloc.rpartition('@')[2]}"
    return urlunsplit((parts.scheme, netloc, f"/{database}", parts.query, parts.fragment))


async def fetch_rows(dsn: str, sql: str, *args: Any) -> list[Any]:
    """The rows of one statement on a connection of its own (opened and closed here)."""
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


def query(dsn: str, sql: str, *args: Any) -> list[Any]:
    """``fetch_rows`` from synchronous code (a test's ground truth, a benchmark's setup)."""
    return asyncio.run(fetch_rows(dsn, sql, *args))


async def create_database(admin_dsn: str) -> str:
    """A new empty database (from template0: nothing a previous test left in template1)."""
    name = f"ctxtest_{uuid.uuid4().hex[:16]}"
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f"CREATE DATABASE \"{name}\" TEMPLATE template0 ENCODING 'UTF8'")
    finally:
        await conn.close()
    return with_database(admin_dsn, name)


async def drop_database(admin_dsn: str, dsn: str) -> None:
    name = urlsplit(dsn).path.lstrip("/")
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@asynccontextmanager
async def fresh_database(admin_dsn: str) -> AsyncIterator[str]:
    dsn = await create_database(admin_dsn)
    try:
        yield dsn
    finally:
        await drop_database(admin_dsn, dsn)


@pytest.fixture
async def postgres_db(postgres_dsn: str) -> AsyncIterator[str]:
    """A DSN of a new, empty database, dropped after the test."""
    async with fresh_database(postgres_dsn) as dsn:
        yield dsn


class PostgresBacking:
    """The conformance suite's ``Backing``: one fresh database, opened as often as a test likes."""

    def __init__(self, admin_dsn: str, dsn: str) -> None:
        self.admin_dsn = admin_dsn
        self.dsn = dsn
        self.opened: list[PostgresStore] = []

    async def open(self, *, clock: Clock | None = None, settings: Settings | None = None) -> SessionStore:
        store = await make_postgres_store(self.dsn, settings, clock=clock)
        self.opened.append(store)
        return store

    async def count_blobs(self) -> int:
        conn = await asyncpg.connect(self.dsn)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM blobs"))
        finally:
            await conn.close()

    async def dispose(self) -> None:
        try:
            for store in self.opened:
                await store.close()
        finally:
            await drop_database(self.admin_dsn, self.dsn)


async def make_postgres(postgres_dsn: str) -> PostgresBacking:
    return PostgresBacking(postgres_dsn, await create_database(postgres_dsn))
