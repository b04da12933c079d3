"""``StatementLanes``: appends on a few kept connections, each statement's outcome to its caller."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from contextsvc.stores.postgres.lanes import Group, StatementLanes


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


class _Many:
    """A ``Group``'s ``run_many``: records its batches; fails a batch holding a "bad" item."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    async def __call__(self, conn: int, items: list[str]) -> list[str]:
        self.batches.append(list(items))
        await asyncio.sleep(0)
        if "bad" in items:
            raise asyncpg.CheckViolationError("one statement of the batch failed")
        return [f"{item}@{conn}" for item in items]


def _alone(item: str) -> Any:
    async def run(conn: int) -> str:
        if item == "bad":
            raise asyncpg.CheckViolationError("bad alone")
        return f"{item} alone"

    return run


def test_statements_waiting_together_run_as_one_batch_in_order_at_most_max_size() -> None:
    async def scenario() -> None:
        pool, many = _Pool(), _Many()
        lanes = _lanes(pool, 1)
        group = Group(many, max_size=4)
        items = [f"a{i}" for i in range(10)]
        results = await asyncio.gather(*(lanes.run(_alone(i), group, i) for i in items))
        assert results == [f"{i}@1" for i in items]  # each caller its own statement's result
        assert many.batches == [items[0:4], items[4:8], items[8:10]]
        assert (group.batches, group.grouped, group.failed) == (3, 10, 0)
        assert await lanes.run(_alone("lone"), group, "lone") == "lone alone"  # nobody waits behind it

    asyncio.run(scenario())


def test_a_batch_takes_its_group_from_anywhere_in_the_queue_and_the_rest_keep_their_order() -> None:
    async def scenario() -> None:
        pool, many, other = _Pool(), _Many(), _Many()
        lanes = _lanes(pool, 1)
        group, second = Group(many, max_size=3), Group(other, max_size=32)
        order: list[str] = []

        def plain(name: str) -> Any:
            async def run(conn: int) -> str:
                order.append(name)
                return name

            return run

        calls = [lanes.run(_alone("a"), group, "a"), lanes.run(plain("p1")), lanes.run(_alone("x"), second, "x")]
        calls += [lanes.run(_alone("b"), group, "b"), lanes.run(plain("p2")), lanes.run(_alone("c"), group, "c")]
        calls += [lanes.run(_alone("y"), second, "y"), lanes.run(_alone("d"), group, "d")]
        results = await asyncio.gather(*calls)
        assert results == ["a@1", "p1", "x@1", "b@1", "p2", "c@1", "y@1", "d alone"]
        # "a" took "b" and "c" (max 3); "x" took "y"; "d", last of its group, ran alone.
        assert many.batches == [["a", "b", "c"]] and other.batches == [["x", "y"]]
        assert order == ["p1", "p2"]  # the plain statements in their order

    asyncio.run(scenario())


def test_a_failed_batch_runs_each_statement_alone_each_caller_its_own_outcome() -> None:
    async def scenario() -> None:
        pool, many = _Pool(), _Many()
        lanes = _lanes(pool, 1)
        group = Group(many, max_size=32)
        outcomes = await asyncio.gather(
            *(lanes.run(_alone(i), group, i) for i in ("a", "bad", "c")), return_exceptions=True
        )
        assert outcomes[0] == "a alone" and outcomes[2] == "c alone"
        assert isinstance(outcomes[1], asyncpg.CheckViolationError) and str(outcomes[1]) == "bad alone"
        assert (group.batches, group.failed) == (0, 1)

    asyncio.run(scenario())


def test_a_connection_dying_under_a_batch_fails_the_batch_and_the_rest_get_another() -> None:
    async def scenario() -> None:
        pool = _Pool()
        lanes = _lanes(pool, 1)

        async def dies(conn: int, items: list[str]) -> list[str]:
            if conn == 1:
                raise asyncpg.ConnectionDoesNotExistError("gone")
            return [f"{item}@{conn}" for item in items]

        group = Group(dies, max_size=2)
        outcomes = await asyncio.gather(
            *(lanes.run(_alone(i), group, i) for i in ("a", "b", "c", "d")), return_exceptions=True
        )
        assert all(isinstance(o, asyncpg.ConnectionDoesNotExistError) for o in outcomes[:2])
        assert outcomes[2:] == ["c@2", "d@2"]

    asyncio.run(scenario())


def test_a_connection_dying_while_a_failed_batch_reruns_fails_the_rest_of_it() -> None:
    async def scenario() -> None:
        pool, many = _Pool(), _Many()
        lanes = _lanes(pool, 1)
        group = Group(many, max_size=8)

        def alone(item: str) -> Any:
            async def run(conn: int) -> str:
                if item == "bad":
                    raise asyncpg.ConnectionDoesNotExistError("gone")
                return f"{item} alone@{conn}"

            return run

        outcomes = await asyncio.wait_for(
            asyncio.gather(*(lanes.run(alone(i), group, i) for i in ("a", "bad", "c")), return_exceptions=True), 5
        )
        assert outcomes[0] == "a alone@1"
        assert all(isinstance(o, asyncpg.ConnectionDoesNotExistError) for o in outcomes[1:])  # none left waiting

    asyncio.run(scenario())
