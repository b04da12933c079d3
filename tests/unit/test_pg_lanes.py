"""``StatementLanes``: appends on a few kept connections, each statement's outcome to its caller."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from contextsvc.stores.postgres.lanes import StatementLanes


class _Pool:
    """Connections as ``pooled`` hands them out: counts acquires, can fail them."""

    def __init__(self) -> None:
        self.acquired = 0
        self.released = 0
        self.in_use = 0
        self.most_in_use = 0
        self.fail_acquire: BaseException | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def connection(self) -> Any:
        pool = self

        class _Ctx:
            async def __aenter__(self) -> int:
                await asyncio.sleep(0)
                if pool.fail_acquire is not None:
                    raise pool.fail_acquire
                pool.acquired += 1
                pool.in_use += 1
                pool.most_in_use = max(pool.most_in_use, pool.in_use)
                return pool.acquired

            async def __aexit__(self, *exc: Any) -> None:
                pool.in_use -= 1
                pool.released += 1

        return _Ctx()

    def track(self, task: asyncio.Task[None]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def _lanes(pool: _Pool, n: int) -> StatementLanes:
    return StatementLanes(pool.connection, n, pool.track)


def test_waiting_statements_share_a_few_connections_in_order() -> None:
    async def scenario() -> None:
        pool = _Pool()
        lanes = _lanes(pool, 3)
        order: list[int] = []

        def work(i: int) -> Any:
            async def run(conn: int) -> tuple[int, int]:
                order.append(i)
                await asyncio.sleep(0)
                return i, conn

            return run

        results = await asyncio.gather(*(lanes.run(work(i)) for i in range(50)))
        assert [r[0] for r in results] == list(range(50))
        assert order == list(range(50))  # first come, first served
        assert pool.most_in_use == 3 and pool.acquired == 3  # one acquire per lane, not per statement
        assert pool.released == 3 and not pool.tasks  # given back once nothing waits
        await lanes.run(work(50))
        assert pool.acquired == 4  # a new statement later takes a connection again

    asyncio.run(scenario())


def test_an_error_goes_to_its_statement_only() -> None:
    async def scenario() -> None:
        pool = _Pool()
        lanes = _lanes(pool, 1)

        async def ok(conn: int) -> str:
            return "ok"

        async def bad(conn: int) -> str:
            raise asyncpg.UniqueViolationError("twin")

        outcomes = await asyncio.gather(lanes.run(ok), lanes.run(bad), lanes.run(ok), return_exceptions=True)
        assert outcomes[0] == outcomes[2] == "ok"
        assert isinstance(outcomes[1], asyncpg.UniqueViolationError)
        assert pool.acquired == 1  # the lane went on with its connection

    asyncio.run(scenario())


def test_a_dead_connection_fails_its_statement_and_the_rest_get_another() -> None:
    async def scenario() -> None:
        pool = _Pool()
        lanes = _lanes(pool, 1)
        seen: list[int] = []

        async def dies(conn: int) -> int:
            seen.append(conn)
            raise asyncpg.ConnectionDoesNotExistError("gone")

        async def ok(conn: int) -> int:
            seen.append(conn)
            return conn

        outcomes = await asyncio.gather(lanes.run(dies), lanes.run(ok), lanes.run(ok), return_exceptions=True)
        assert isinstance(outcomes[0], asyncpg.ConnectionDoesNotExistError)
        assert outcomes[1:] == [2, 2] and seen == [1, 2, 2]

    asyncio.run(scenario())


def test_no_connection_fails_every_waiting_statement_alike() -> None:
    async def scenario() -> None:
        pool = _Pool()
        pool.fail_acquire = TimeoutError()
        lanes = _lanes(pool, 2)

        async def ok(conn: int) -> int:
            return conn

        outcomes = await asyncio.gather(*(lanes.run(ok) for _ in range(5)), return_exceptions=True)
        assert all(isinstance(o, TimeoutError) for o in outcomes)
        pool.fail_acquire = None
        assert await lanes.run(ok) == 1  # and the lanes work again once the pool does

    asyncio.run(scenario())


def test_a_cancelled_caller_never_cancels_its_statement() -> None:
    async def scenario() -> None:
        pool = _Pool()
        lanes = _lanes(pool, 1)
        started, release = asyncio.Event(), asyncio.Event()
        done: list[str] = []

        async def slow(conn: int) -> str:
            started.set()
            await release.wait()
            done.append("committed")
            return "committed"

        caller = asyncio.create_task(lanes.run(slow))
        await started.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        release.set()
        while pool.tasks:
            await asyncio.wait(set(pool.tasks))
        assert done == ["committed"]

    asyncio.run(scenario())
