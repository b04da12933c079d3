"""Single-statement writes that keep a pooled connection while more of them wait.

An append is one statement (``store._APPEND_PUBLISH_SQL``), and taking a pooled connection for it
and giving it back cost the server about as much Python as the rest of the store's work: the
acquire, then asyncpg's release (a shielded task of its own, its reset hook, the inactivity
timer), plus the task that shields the write from its caller's cancellation. Under load the
appends of many calls wait for a connection anyway, so a few *lanes* run them instead: a lane
takes a connection once, runs the waiting statements one after the other, each in its own
transaction as before, and gives the connection back when none waits. At most ``lanes`` run at
a time, so the rest of the pool stays free for reads.

A caller awaits its statement's future, shielded: cancelling the caller never cancels a write
in flight (its outcome would be unknown), as with ``PostgresStore._write``. A statement's error
goes to its caller only and the lane goes on, unless the connection died (a server restart):
then the pool replaces its connections (``pooled``) and the next statements get a new one. When
no connection can be had (the pool's acquire timeout, a closed pool) every waiting statement
gets that error, as each would have had on its own.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from contextsvc.stores.postgres.errors import STALE_CONNECTION_ERRORS

T = TypeVar("T")

Work = Callable[[Any], Awaitable[Any]]


class StatementLanes:
    """Runs ``work(conn)`` callables on at most ``lanes`` pooled connections, first come first served."""

    def __init__(self, connection: Callable[[], Any], lanes: int, track: Callable[[asyncio.Task[None]], None]):
        #: ``connection()`` is an async context manager giving a pooled connection (``pooled``).
        self._connection = connection
        self._max = lanes
        self._track = track
        self._waiting: deque[tuple[Work, asyncio.Future[Any]]] = deque()
        self._running = 0

    async def run(self, work: Callable[[Any], Awaitable[T]]) -> T:
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiting.append((work, future))
        if self._running < self._max:
            self._running += 1
            self._track(asyncio.get_running_loop().create_task(self._lane()))
        return await asyncio.shield(future)

    async def _lane(self) -> None:
        try:
            while self._waiting:
                acquired = False
                try:
                    async with self._connection() as conn:
                        acquired = True
                        while self._waiting:
                            work, future = self._waiting.popleft()
                            try:
                                result = await work(conn)
                            except STALE_CONNECTION_ERRORS as exc:
                                _fail(future, exc)
                                raise  # ``pooled`` expires the pool's connections
                            except asyncio.CancelledError:
                                future.cancel()
                                raise
                            except Exception as exc:  # this statement's error, for its caller only
                                _fail(future, exc)
                            else:
                                if not future.done():
                                    future.set_result(result)
                except Exception as exc:
                    if acquired:  # a dead connection, or giving it back failed: the statements run
                        continue  # so far have their outcome; the rest get another connection
                    while self._waiting:  # no connection to be had: every waiting statement fails alike
                        _fail(self._waiting.popleft()[1], exc)
        finally:
            self._running -= 1
            while self._waiting and not self._running:  # cancelled (the loop ends) with statements left
                self._waiting.popleft()[1].cancel()


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
