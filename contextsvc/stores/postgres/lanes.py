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

Grouped commits: statements run with the same ``Group`` that wait together (anywhere in the
queue: the first waiting takes the others of its group with it) are handed to the group's
``run_many`` at once (at most ``Group.max_size``), which runs them in one transaction
and one round trip (``store.AppendGroup``: one commit, so one WAL flush, for all of them). If
that transaction fails, nothing of it was committed, and each statement then runs alone, as it
would have without the group, so each caller gets its own statement's outcome.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from contextsvc.stores.postgres.errors import STALE_CONNECTION_ERRORS

T = TypeVar("T")

Work = Callable[[Any], Awaitable[Any]]


class Group:
    """Statements that may share one transaction: ``run_many(conn, items)`` runs them all at once
    and returns one result per item, in order (or raises: then nothing of them was committed)."""

    def __init__(self, run_many: Callable[[Any, list[Any]], Awaitable[list[Any]]], max_size: int) -> None:
        self.run_many = run_many
        self.max_size = max_size
        #: transactions run_many ran, statements in them, and how many failed (then ran alone).
        self.batches = 0
        self.grouped = 0
        self.failed = 0


_Waiting = tuple[Work, "asyncio.Future[Any]", Group | None, Any]


class StatementLanes:
    """Runs ``work(conn)`` callables on at most ``lanes`` pooled connections, first come first served."""

    def __init__(self, connection: Callable[[], Any], lanes: int, track: Callable[[asyncio.Task[None]], None]):
        #: ``connection()`` is an async context manager giving a pooled connection (``pooled``).
        self._connection = connection
        self._max = lanes
        self._track = track
        self._waiting: deque[_Waiting] = deque()
        self._running = 0

    async def run(self, work: Callable[[Any], Awaitable[T]], group: Group | None = None, item: Any = None) -> T:
        """``work(conn)``'s result; with ``group``, ``item`` may instead run in one of the group's
        transactions together with the other statements of that group waiting right behind it."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiting.append((work, future, group, item))
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
                            work, future, group, item = self._waiting.popleft()
                            batch = self._batch(group, (work, future, item))
                            if group is not None and len(batch) > 1:
                                await self._run_group(conn, group, batch)
                            else:
                                await _run_one(conn, work, future)
                except Exception as exc:
                    if acquired:  # a dead connection, or giving it back failed: the statements run
                        continue  # so far have their outcome; the rest get another connection
                    while self._waiting:  # no connection to be had: every waiting statement fails alike
                        _fail(self._waiting.popleft()[1], exc)
        finally:
            self._running -= 1
            while self._waiting and not self._running:  # cancelled (the loop ends) with statements left
                self._waiting.popleft()[1].cancel()

    def _batch(self, group: Group | None, first: tuple[Work, asyncio.Future[Any], Any]) -> list[Any]:
        """``first`` and the statements of its group waiting anywhere behind it, at most
        ``group.max_size``, in their order; the others keep theirs. Statements of several kinds
        share the statement lanes (a build's view save, a baseline's anchor): a batch takes every
        one of its kind that waits, not only those right behind the first."""
        batch = [first]
        if group is None or not self._waiting:
            return batch
        others: deque[_Waiting] = deque()
        while self._waiting and len(batch) < group.max_size:
            waiting = self._waiting.popleft()
            if waiting[2] is group:
                batch.append((waiting[0], waiting[1], waiting[3]))
            else:
                others.append(waiting)
        others.extend(self._waiting)
        self._waiting = others
        return batch

    @staticmethod
    async def _run_group(conn: Any, group: Group, batch: list[tuple[Work, asyncio.Future[Any], Any]]) -> None:
        try:
            results = await group.run_many(conn, [item for _, _, item in batch])
        except STALE_CONNECTION_ERRORS as exc:
            for _, future, _ in batch:
                _fail(future, exc)
            raise
        except asyncio.CancelledError:
            for _, future, _ in batch:
                future.cancel()
            raise
        except Exception:
            # One statement failed, so the transaction rolled back: nothing of the batch was
            # committed. Each runs alone now and its caller gets its own outcome.
            group.failed += 1
            for i, (work, future, _) in enumerate(batch):
                try:
                    await _run_one(conn, work, future)
                except BaseException as exc:  # the connection died or the lane was cancelled
                    for _, rest, _ in batch[i + 1 :]:
                        if isinstance(exc, asyncio.CancelledError):
                            rest.cancel()
                        else:
                            _fail(rest, exc)
                    raise
            return
        group.batches += 1
        group.grouped += len(batch)
        for (_, future, _), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


async def _run_one(conn: Any, work: Work, future: asyncio.Future[Any]) -> None:
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


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
