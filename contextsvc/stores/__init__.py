"""Session stores, chosen by URL in this one registry.

``memory``                              everything in process memory (tests)
``files:PATH`` or ``files://PATH``      the embedded default: JSONL logs under PATH
``postgres://…`` or ``postgresql://…``  PostgreSQL through asyncpg

The store is returned unopened: the caller awaits ``open()`` before use and ``close()`` after.
"""

from __future__ import annotations

import importlib
import os
from typing import cast

from contextsvc.config import Settings, redacted_url
from contextsvc.ports import SessionStore
from contextsvc.stores.files import FilesStore
from contextsvc.stores.memory import MemoryStore

ACCEPTED_FORMS = "'memory', 'files:PATH', 'files://PATH', 'postgres://…' or 'postgresql://…'"

__all__ = ["ACCEPTED_FORMS", "FilesStore", "MemoryStore", "open_store"]


def open_store(url: str, settings: Settings) -> SessionStore:
    """Build the store ``url`` names (see the module docstring); raises ``ValueError`` otherwise."""
    url = url.strip()
    if url == "memory":
        return MemoryStore(settings)
    if url.startswith("files:"):
        path = url.removeprefix("files:")
        path = path.removeprefix("//")  # files:///abs -> /abs; files://rel -> rel
        if not path:
            raise ValueError(f"store URL {redacted_url(url)!r} names no directory; expected 'files:PATH'")
        # "files:~/data" (a config file, an environment variable: no shell expands it there) made
        # a directory named "~" in the working directory.
        return FilesStore(os.path.expanduser(path), settings)
    if url.startswith(("postgres://", "postgresql://")):
        return _postgres(url, settings)
    raise ValueError(f"unknown store URL {redacted_url(url)!r}; accepted: {ACCEPTED_FORMS}")


def _postgres(url: str, settings: Settings) -> SessionStore:
    # Imported lazily: asyncpg and the schema code load only when PostgreSQL is configured.
    try:
        module = importlib.import_module("contextsvc.stores.postgres")
    except ModuleNotFoundError as exc:
        raise ValueError(f"the PostgreSQL store is not available in this build ({exc.name} is missing)") from exc
    return cast(SessionStore, module.PostgresStore(url, settings=settings))
