"""The post-turn worker: re-checks a session in the background after its turn completed.

A check is keyed by session: scheduling a session that is already waiting does nothing more, so
a burst of turns costs one check. Failures are logged, never raised: the turn already succeeded.
A session deleted before or while its check runs is no failure: the check just stops; a store
that is down makes one line per check, not a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from contextsvc.errors import NotFound, Unavailable

log = logging.getLogger(__name__)


class PostTurnWorker:
    def __init__(self, check: Callable[[str], Awaitable[None]], *, concurrency: int = 2):
        self._check = check
        self._pending: set[str] = set()
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._concurrency = concurrency
        self._idle = asyncio.Event()
        self._idle.set()
        self._running = 0
        self._closed = False

    def schedule(self, session_id: str) -> None:
        if self._closed:  # a drain cancelled the checks: the restarted server checks on the next turn
            return
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._run(), name=f"post-turn-{i}") for i in range(self._concurrency)]
        if session_id in self._pending:
            return
        self._pending.add(session_id)
        self._idle.clear()
        self._queue.put_nowait(session_id)

    async def _run(self) -> None:
        while True:
            session_id = await self._queue.get()
            self._pending.discard(session_id)
            self._running += 1
            try:
                await self._check(session_id)
            except asyncio.CancelledError:
                raise
            except NotFound:  # deleted (on this replica or another) while the check ran
                log.debug("post-turn check: session gone", extra={"session_id": session_id})
            except Unavailable as exc:
                # The store is down (a PostgreSQL restart): the store logs that; one line per check
                # here, not a traceback each. The next turn schedules the check again.
                log.warning("post-turn check skipped: %s", exc, extra={"session_id": session_id})
            except Exception:
                log.warning("post-turn check failed", extra={"session_id": session_id}, exc_info=True)
            finally:
                self._running -= 1
                if not self._pending and self._running == 0:
                    self._idle.set()

    async def drain(self, within: float) -> bool:
        """Wait until every scheduled check ran (tests and graceful shutdown)."""
        if self._idle.is_set():  # asyncio.wait_for with no time left gives up before looking
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), within)
        except TimeoutError:
            return False
        return True

    def cancel(self) -> list[asyncio.Task[None]]:
        """Cancel the running checks and stop taking new ones; the tasks, for the caller to await."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        self._closed = True
        return tasks

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
