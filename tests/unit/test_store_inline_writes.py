"""Writes that need not wait for the disk happen in the caller's step (issue #15): the memory
store's calibration observations take no writer task, the files store in ``batch`` durability
writes its log lines without a hop to a worker thread, and its calibration observations wait for
no disk in either durability; ``fsync`` durability's appends still hop, to their sync pass."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import contextsvc.stores.files as files_module
from contextsvc.config import Durability, Settings
from contextsvc.core.calibration import Observation
from contextsvc.core.messages import Message, Role
from contextsvc.core.session import Principal
from contextsvc.stores.files import FilesStore
from contextsvc.stores.memory import MemoryStore
from tests.conformance.helpers import view
from tests.support.stores import TickingClock

ALICE = Principal(user_id="alice")


async def _files(root: Path, durability: Durability) -> FilesStore:
    store = FilesStore(root, Settings(durability=durability), clock=TickingClock())
    await store.open()
    return store


def _no_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    async def refused(*args: Any, **kw: Any) -> Any:
        raise AssertionError("a worker thread was used")

    monkeypatch.setattr(files_module.asyncio, "to_thread", refused)


async def test_the_memory_store_keeps_observations_without_a_writer_task() -> None:
    store = MemoryStore(Settings())
    observations = [Observation(100 + i, 40 + i) for i in range(12)]
    for o in observations:
        await store.add_calibration_observation("m", o)
    await asyncio.gather(*(store.add_calibration_observation("n", o) for o in observations))
    assert store._observations_writer is None  # every write finished in its caller's step
    assert await store.list_calibration_observations("m", limit=100) == observations
    assert await store.list_calibration_observations("n", limit=100) == observations


async def test_batch_durability_writes_log_lines_in_the_callers_step_and_keeps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "data"
    store = await _files(root, Durability.BATCH)
    sid = (await store.create_session(caller=ALICE, profile_id="default")).id
    _no_threads(monkeypatch)
    await store.append_messages(sid, [Message(Role.USER, "m1"), Message(Role.ASSISTANT, "a1")], caller=ALICE)
    await store.update_state(sid, caller=ALICE, context_tokens=7, state={"epoch": 0})
    await store.save_view(sid, view("v1", last_sequence=2), keep=4)
    await store.add_calibration_observation("m", Observation(100, 40))
    assert store._observations_writer is None
    monkeypatch.undo()
    await store.close()
    store = await _files(root, Durability.BATCH)
    assert [m.content for m in await store.load_context(sid, caller=ALICE)] == ["m1", "a1"]
    assert (await store.get_session(sid, caller=ALICE)).context_tokens == 7
    assert await store.list_calibration_observations("m", limit=10) == [Observation(100, 40)]
    await store.close()


async def test_fsync_durability_syncs_appends_from_a_worker_thread_but_not_observations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "data"
    store = await _files(root, Durability.FSYNC)
    sid = (await store.create_session(caller=ALICE, profile_id="default")).id
    _no_threads(monkeypatch)
    with pytest.raises(AssertionError, match="worker thread"):
        await store.append_messages(sid, [Message(Role.USER, "m1")], caller=ALICE)
    await store.add_calibration_observation("m", Observation(100, 40))  # no sync, no writer task
    assert store._observations_writer is None
    monkeypatch.undo()
    await store.close()  # writes and syncs the deferred observation
    store = await _files(root, Durability.FSYNC)
    assert await store.list_calibration_observations("m", limit=10) == [Observation(100, 40)]
    await store.close()
