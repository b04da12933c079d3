"""Starting without the store: serve NOT_SERVING until it answers (issue 13, item 7).

A store that cannot be reached at start (PostgreSQL down, a network not up yet) is a transient
condition for an orchestrator: the process starts, listens, reports NOT_SERVING on health and
refuses ContextService calls with UNAVAILABLE, and retries opening the store with backoff. Once
the store answers, health turns SERVING. Anything else that stops a store from opening (a bad
URL, a directory that cannot be written) is a configuration error: one line, a non-zero exit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from contextsvc.core.session import Principal
from contextsvc.errors import Unavailable
from contextsvc.ports import EventBus, SessionStore, StoredEvent

log = logging.getLogger(__name__)


class StartupError(Exception):
    """The server cannot start; the message is the one line printed before exiting non-zero."""


class DeferredBus:
    """An EventBus that exists before the store is open: it forwards to the real bus once that
    is built (the PostgreSQL bus needs the store's pool). No call reaches it before then: the
    serving gate refuses ContextService calls until the store is ready."""

    def __init__(self) -> None:
        self.target: EventBus | None = None

    def _bus(self) -> EventBus:
        if self.target is None:
            raise Unavailable("the store has not answered yet", reason="STORE_NOT_READY")
        return self.target

    async def publish(self, *, session_id: str, user_id: str, kind: str, payload: Mapping[str, Any]) -> StoredEvent:
        return await self._bus().publish(session_id=session_id, user_id=user_id, kind=kind, payload=payload)

    def subscribe(
        self, *, caller: Principal, session_id: str = "", after_event_id: int = 0
    ) -> AsyncIterator[StoredEvent]:
        return self._bus().subscribe(caller=caller, session_id=session_id, after_event_id=after_event_id)

    async def retained_deletion(self, session_id: str) -> StoredEvent | None:
        return await self._bus().retained_deletion(session_id)

    async def close(self) -> None:
        if self.target is not None:
            await self.target.close()


async def open_store_until_ready(
    store: SessionStore,
    *,
    name: str,
    first_error: Unavailable,
    retry_max_seconds: float,
    give_up_after_seconds: float,
    on_ready: Callable[[], Awaitable[None]],
) -> None:
    """Retry ``store.open()`` with doubling pauses (capped at ``retry_max_seconds``) until it
    works, then await ``on_ready``. With ``give_up_after_seconds`` > 0, raise ``StartupError``
    once that long has passed. Each failed attempt is one warning line without a traceback.
    ``name`` is the store as the lines show it (its URL without the password)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    pause = min(0.25, retry_max_seconds)
    error: Exception = first_error
    attempt = 1
    while True:
        waited = loop.time() - started
        if give_up_after_seconds > 0 and waited >= give_up_after_seconds:
            raise StartupError(
                f"the store {name} did not answer within {give_up_after_seconds:g} s "
                f"(store_start_timeout_seconds): {_one_line(error)}"
            )
        await asyncio.sleep(pause)
        pause = min(pause * 2, retry_max_seconds)
        attempt += 1
        try:
            await store.open()
        except Unavailable as exc:
            error = exc
            log.warning("store not reachable; still NOT_SERVING", extra={"attempt": attempt, "error": _one_line(exc)})
            continue
        except Exception as exc:
            raise StartupError(f"cannot open the store {name}: {_one_line(exc)}") from None
        log.info("store reachable; SERVING", extra={"attempt": attempt})
        await on_ready()
        return


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:500]
