"""Ending server streams cleanly when the server drains."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol, TypeVar

from contextsvc.api.gate import ServerShuttingDown


class _HasEventId(Protocol):
    @property
    def event_id(self) -> int: ...


E = TypeVar("E", bound=_HasEventId)


async def until_stopped(
    events: AsyncIterator[E], stop: asyncio.Event, *, after_event_id: int
) -> AsyncGenerator[E, None]:
    """Yield ``events`` until ``stop`` is set, then raise ``ServerShuttingDown`` whose metadata
    carries ``after_event_id``: the id of the last event this stream delivered (or the one the
    client resumed from), so the client resumes on another replica without a gap or a duplicate."""
    last = after_event_id
    iterator = aiter(events)
    stopped = asyncio.ensure_future(stop.wait())
    pending: asyncio.Future[E] | None = None
    try:
        while True:
            pending = asyncio.ensure_future(anext(iterator))
            await asyncio.wait((pending, stopped), return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                raise ServerShuttingDown(
                    f"the server is shutting down; reconnect with after_event_id={last} to resume",
                    metadata={"after_event_id": str(last)},
                )
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            last = event.event_id
            yield event
    finally:
        stopped.cancel()
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await pending
        closer = getattr(iterator, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()
