"""Fixtures of the PostgreSQL adapter tests (a real server; see tests/support/postgres.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from contextsvc.config import PostgresSettings, ProfileConfig, Settings
from contextsvc.stores.postgres import PostgresStore, make_postgres_store
from tests.support.postgres import postgres_db, postgres_dsn

__all__ = ["postgres_db", "postgres_dsn"]


def pg_settings(**postgres: object) -> Settings:
    """Settings with quick reconnects and polls, so fault tests finish in seconds."""
    base: dict[str, object] = {
        "connect_timeout_seconds": 2.0,
        "acquire_timeout_seconds": 5.0,
        "event_poll_seconds": 0.3,
        "reconnect_max_seconds": 0.5,
    }
    return Settings(preview_chars=40, postgres=PostgresSettings.model_validate({**base, **postgres}))


def two_profile_settings() -> Settings:
    """``pg_settings`` with two profiles of different models ("small" and "big"): appends priced
    for one profile meet a session re-created with the other."""
    return pg_settings().model_copy(
        update={
            "profiles": {
                "small": ProfileConfig(model="hp", context_window=16_000),
                "big": ProfileConfig(model="other", context_window=400_000),
            }
        }
    )


@pytest.fixture
def settings() -> Settings:
    return pg_settings()


@pytest.fixture
async def store(postgres_db: str, settings: Settings) -> AsyncIterator[PostgresStore]:
    store = await make_postgres_store(postgres_db, settings)
    try:
        yield store
    finally:
        await store.close()
