"""One suite for every store: each test runs once per kind listed in tests/support/stores.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from contextsvc.config import Durability, Settings
from contextsvc.ports import SessionStore
from tests.conformance.helpers import Reopen
from tests.support.postgres import postgres_dsn
from tests.support.stores import STORE_KINDS, Backing, TickingClock, fixture_args, store_kind

__all__ = ["postgres_dsn"]  # the fixture the postgres kind requests


@pytest.fixture(params=[kind.name for kind in STORE_KINDS])
async def backing(request: pytest.FixtureRequest) -> AsyncIterator[Backing]:
    kind = store_kind(request.param)
    made = await kind.make(**fixture_args(kind, request.getfixturevalue))
    try:
        yield made
    finally:
        await made.dispose()


@pytest.fixture
def clock() -> TickingClock:
    return TickingClock()


@pytest.fixture
def settings() -> Settings:
    # A short preview so the cut is visible; fsync so "closed" and "crashed" stores agree.
    return Settings(preview_chars=40, durability=Durability.FSYNC)


@pytest.fixture
async def store(backing: Backing, clock: TickingClock, settings: Settings) -> SessionStore:
    return await backing.open(clock=clock, settings=settings)


@pytest.fixture
def reopen(backing: Backing, clock: TickingClock, settings: Settings, store: SessionStore) -> Reopen:
    return Reopen(backing, clock, settings, store)
