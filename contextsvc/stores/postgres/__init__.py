"""The PostgreSQL adapter: one package for everything that talks to PostgreSQL (DESIGN §3).

``store``   ``PostgresStore`` — sessions, rows, views, tokens, raw history (``SessionStore`` …)
``bus``     ``PostgresEventBus`` — the ``EventBus`` of many replicas (events table + LISTEN/NOTIFY)
``schema``  migrations and advisory-lock keys
``pool``    the migration connection and the pools, shared by store and bus
``errors``  driver errors translated into the domain hierarchy
``rows``    row <-> domain mapping
``tokens``  ``PostgresTokenStore`` — API token hashes (``ApiTokenStore``), through the store's pool

This module is the one public entry: the bootstrap (``contextsvc.server`` through the store
registry) imports these names and nothing below them. A store's ``make_event_bus()`` gives a
bus on the store's own pool; ``make_postgres_event_bus`` one with a pool of its own.
Importing it loads asyncpg, so the registry imports it only when PostgreSQL is configured.
"""

from __future__ import annotations

from contextsvc.stores.postgres.bus import LISTEN_APPLICATION_NAME, PostgresEventBus, make_postgres_event_bus
from contextsvc.stores.postgres.store import PostgresStore, make_postgres_store

__all__ = [
    "LISTEN_APPLICATION_NAME",
    "PostgresEventBus",
    "PostgresStore",
    "make_postgres_event_bus",
    "make_postgres_store",
]
