"""A store mutation starts in its caller's step: no task when it completes without suspending, and
still one no caller can interrupt when it does suspend (``RowStore._shielded``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from contextsvc.config import Settings
from contextsvc.core.messages import Message, Role
from contextsvc.core.session import Principal
from contextsvc.errors import NotFound
from contextsvc.stores.memory import MemoryStore

ALICE = Principal(user_id="alice")


def user(content: str) -> Message:
    return Message(role=Role.USER, content=content)


async def test_a_mutation_that_never_suspends_runs_without_a_task(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore(Settings())
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id

    def no_task(coro: Any) -> Any:
        coro.close()
        raise AssertionError("a task was made for a mutation that never suspended")

    monkeypatch.setattr(store, "_in_task", no_task)
    assert (await store.append_messages(sid, [user("m1"), user("m2")], caller=ALICE)).sequence_numbers == [1, 2]
    assert (await store.append_messages(sid, [user("m3")], caller=ALICE)).sequence_numbers == [3]
    # An error raised before any suspension reaches the caller as before.
    with pytest.raises(NotFound):
        await store.append_messages("00000000-0000-4000-8000-000000000000", [user("x")], caller=ALICE)
    assert [m.content for m in await store.load_context(sid, caller=ALICE)] == ["m1", "m2", "m3"]
    assert not store._inflight


async def test_a_suspended_mutation_goes_on_when_its_caller_is_cancelled() -> None:
    store = MemoryStore(Settings())
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    await store.append_messages(sid, [user("m1")], caller=ALICE)
    lock = store._sessions[sid].lock
    await lock.acquire()  # the append waits for the session's lock: it suspends
    caller = asyncio.ensure_future(store.append_messages(sid, [user("m2")], caller=ALICE))
    await asyncio.sleep(0)
    assert len(store._inflight) == 1  # what is left of it runs in its own task
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    lock.release()
    await store._drain()
    # The mutation completed after its caller went away, in order, before the next one.
    assert (await store.append_messages(sid, [user("m3")], caller=ALICE)).sequence_numbers == [3]
    assert [m.content for m in await store.load_context(sid, caller=ALICE)] == ["m1", "m2", "m3"]
    assert not store._inflight


async def test_a_suspended_mutation_answers_its_caller() -> None:
    store = MemoryStore(Settings())
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    lock = store._sessions[sid].lock
    await lock.acquire()
    waiting = [asyncio.ensure_future(store.append_messages(sid, [user(f"m{i}")], caller=ALICE)) for i in range(3)]
    await asyncio.sleep(0)
    lock.release()
    assert [(await w).sequence_numbers for w in waiting] == [[1], [2], [3]]
    # A suspended mutation's error reaches its caller too.
    await lock.acquire()
    deleting = asyncio.ensure_future(store.delete_session(sid, caller=ALICE))
    late = asyncio.ensure_future(store.append_messages(sid, [user("late")], caller=ALICE))
    await asyncio.sleep(0)
    lock.release()
    await deleting
    with pytest.raises(NotFound):
        await late
