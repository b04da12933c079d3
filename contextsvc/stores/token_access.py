"""Finding the API token store: the session store's own, or the one ``auth.token_store`` names.

The server uses the store it already opened; ``contextsvc tokens …`` opens only what it needs (the
files store's tokens file, or a PostgreSQL pool), never a whole session store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from contextsvc.config import Settings
from contextsvc.ports import ApiTokenStore
from contextsvc.stores import open_store

MEMORY_ONLY = (
    "the memory store keeps API tokens inside the server process, where `contextsvc tokens` cannot reach them; "
    "keep tokens in a file or a database with auth.token_store (CONTEXTSVC_AUTH__TOKEN_STORE=files:PATH)"
)


def tokens_of(store: Any) -> ApiTokenStore:
    """The token store a session store keeps (``api_tokens()``)."""
    getter: Callable[[], ApiTokenStore] | None = getattr(store, "api_tokens", None)
    if getter is None:
        raise ValueError(f"the {type(store).__name__} keeps no API tokens")
    return getter()


@asynccontextmanager
async def token_store_at(url: str, settings: Settings) -> AsyncIterator[ApiTokenStore]:
    """An opened token store for ``url`` (a store URL), closed on exit. ``memory`` is refused:
    a token store in this process's memory would be empty and die with it."""
    if url.strip() == "memory":
        raise ValueError(MEMORY_ONLY)
    store = open_store(url, settings)
    # The files store's tokens file needs nothing opened; PostgreSQL needs its pool (and schema).
    needs_open = not url.strip().startswith("files:")
    if needs_open:
        await store.open()
    try:
        yield tokens_of(store)
    finally:
        if needs_open:
            await store.close()


@asynccontextmanager
async def server_token_store(store: Any, settings: Settings) -> AsyncIterator[ApiTokenStore]:
    """The server's token store: ``auth.token_store`` when set, else the session store's."""
    if settings.auth.token_store:
        async with token_store_at(settings.auth.token_store, settings) as tokens:
            yield tokens
    else:
        yield tokens_of(store)
