"""The compaction lock's wait bound (``Compactor.lock(wait=...)``): a free lock is taken at once
(without arming a timer: the anchor of every baseline takes it), a held one is refused with
``CompactionBusy`` once the bound passed, and a waiter ahead in the queue is never overtaken."""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from contextsvc.engine.compaction import CompactionBusy, Compactor
from tests.support.compaction_harness import Rig


async def _hold(compactor: Compactor, held: asyncio.Event, release: asyncio.Event, order: list[str], name: str) -> None:
    """Take the session's whole lock, say so, and keep it until ``release``; then log ``name``."""
    async with compactor.lock("s"):
        held.set()
        await release.wait()
        order.append(name)


async def _take(lock: AbstractAsyncContextManager[Any], order: list[str], name: str) -> None:
    """Log ``name`` once ``lock`` is taken."""
    async with lock:
        order.append(name)


async def test_a_free_lock_is_taken_at_once_and_its_entry_goes_when_released() -> None:
    rig = await Rig.start()
    try:
        compactor = rig.engine.compactor
        loop = asyncio.get_running_loop()
        timers = len(getattr(loop, "_scheduled", ()))
        async with compactor.lock("s", wait=5.0):
            assert compactor.busy("s")
            assert len(getattr(loop, "_scheduled", ())) == timers  # no timeout armed
        assert not compactor.busy("s")
        assert compactor._locks == {}
        # Taken at once, it is still released when the holder fails, and taken again after.
        with pytest.raises(RuntimeError, match="holder failed"):
            async with compactor.lock("s", wait=5.0):
                raise RuntimeError("holder failed")
        assert not compactor.busy("s") and compactor._locks == {}
        async with compactor.lock("s", wait=0.0):
            assert compactor.busy("s")
        assert compactor._locks == {}
    finally:
        await rig.close()


async def test_a_held_lock_refuses_after_the_bound_and_a_waiter_is_served_in_turn() -> None:
    rig = await Rig.start()
    try:
        compactor = rig.engine.compactor
        release, held = asyncio.Event(), asyncio.Event()
        order: list[str] = []
        first = asyncio.create_task(_hold(compactor, held, release, order, "holder"))
        await held.wait()
        started = time.monotonic()
        with pytest.raises(CompactionBusy):
            async with compactor.lock("s", wait=0.05):
                order.append("bounded")  # never: the lock is held past the bound
        assert 0.04 <= time.monotonic() - started < 2.0
        second = asyncio.create_task(_take(compactor.lock("s"), order, "waiter"))
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert order == ["holder", "waiter"]
        assert compactor._locks == {}
    finally:
        await rig.close()


async def test_the_local_half_excludes_a_compaction_and_leaves_nothing_behind() -> None:
    """``local_lock`` (a baseline's anchor, every turn) is the same in-process lock as ``lock``:
    it waits for a holder, is released when its body fails, and a waiter cancelled meanwhile is
    no longer counted, so the session's entry goes with the last holder."""
    rig = await Rig.start()
    try:
        compactor = rig.engine.compactor
        async with compactor.local_lock("s"):
            assert compactor.busy("s")
        assert not compactor.busy("s") and compactor._locks == {}
        with pytest.raises(RuntimeError, match="anchor failed"):
            async with compactor.local_lock("s"):
                raise RuntimeError("anchor failed")
        assert compactor._locks == {}

        release, held = asyncio.Event(), asyncio.Event()
        order: list[str] = []
        first = asyncio.create_task(_hold(compactor, held, release, order, "compaction"))
        await held.wait()
        cancelled = asyncio.create_task(_take(compactor.local_lock("s"), order, "anchor"))
        waiting = asyncio.create_task(_take(compactor.local_lock("s"), order, "anchor"))
        await asyncio.sleep(0.01)
        assert order == []  # both anchors wait for the compaction
        cancelled.cancel()
        await asyncio.sleep(0)
        release.set()
        await asyncio.wait_for(asyncio.gather(first, waiting), 5)
        assert cancelled.cancelled()
        assert order == ["compaction", "anchor"]
        assert compactor._locks == {}
    finally:
        await rig.close()
