"""A baseline's anchor is a measurement the engine can lose in a crash, so the files store in
fsync durability writes it without an fsync of its own (issue #15: it was the second fsync of
every agent turn). It reaches the disk with the session's next synced line, in log order."""

from __future__ import annotations

import asyncio
from pathlib import Path

from contextsvc.config import Durability, ProfileConfig, Settings
from contextsvc.core.messages import Message, Role
from contextsvc.core.profile import NO_OVERRIDES
from contextsvc.core.session import ANONYMOUS, Principal
from contextsvc.engine.state import EngineState
from contextsvc.engine.validation import IncomingMessage
from contextsvc.stores.files import FilesStore
from contextsvc.stores.memory import MemoryStore
from tests.support.engines import make_engine

ALICE = Principal(user_id="alice")


async def _files(root: Path, **settings: object) -> FilesStore:
    store = FilesStore(root, Settings(durability=Durability.FSYNC, **settings))  # type: ignore[arg-type]
    await store.open()
    return store


async def test_a_state_written_not_durable_costs_no_fsync_and_is_kept_in_log_order(tmp_path: Path) -> None:
    root = tmp_path / "data"
    store = await _files(root)
    sid = (await store.create_session(caller=ALICE, profile_id="default")).id
    before = store.stats.log_fsyncs
    await store.append_messages(sid, [Message(Role.USER, "m1")], caller=ALICE)
    assert store.stats.log_fsyncs == before + 1
    info = await store.update_state(sid, caller=ALICE, context_tokens=42, state={"epoch": 0, "k": 1}, durable=False)
    assert store.stats.log_fsyncs == before + 1  # written, not synced on its own
    assert info.context_tokens == 42 and info.state == {"epoch": 0, "k": 1}
    log = root / "sessions" / f"{sid}.jsonl"
    assert b'"context_tokens":42' not in log.read_bytes()  # deferred: written with the next line
    await store.update_state(sid, caller=ALICE, context_tokens=43)  # durable by default
    assert store.stats.log_fsyncs == before + 2
    data = log.read_bytes()
    assert data.index(b'"context_tokens":42') < data.index(b'"context_tokens":43')  # in log order
    await store.append_messages(sid, [Message(Role.ASSISTANT, "a1")], caller=ALICE)
    await store.update_state(sid, caller=ALICE, state={"epoch": 0, "k": 2}, durable=False)
    await store.close()

    reopened = await _files(root)
    again = await reopened.get_session(sid, caller=ALICE)
    assert again.state == {"epoch": 0, "k": 2} and again.context_tokens == 43 and again.last_sequence == 2
    await reopened.close()


async def test_the_memory_store_takes_a_state_that_is_not_durable() -> None:
    store = MemoryStore(Settings())
    sid = (await store.create_session(caller=ALICE, profile_id="default")).id
    info = await store.update_state(sid, caller=ALICE, context_tokens=5, durable=False)
    assert info.context_tokens == 5


async def _never(seconds: float) -> None:
    await asyncio.Event().wait()


async def test_a_recorded_baseline_waits_for_no_fsync_and_its_observation_reaches_the_disk(tmp_path: Path) -> None:
    """Per RecordBaseline in fsync durability: neither the anchor nor the calibration observation
    waits for an fsync (an observation is one sample of the fit's hundreds); the flusher's next
    pass writes and syncs the observation, and a restart reads it."""
    root = tmp_path / "data"
    settings = Settings(
        profiles={"default": ProfileConfig(model="m")}, store=f"files:{root}", durability=Durability.FSYNC
    )
    store = FilesStore(root, settings=settings, sleep=_never)  # the flusher's pass runs when the test says
    await store.open()
    engine = make_engine(store, settings)
    sid = (await engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})).id
    await engine.append(
        ANONYMOUS, sid, [IncomingMessage(Message(Role.USER, "hello " * 200))], request_id="", turn_complete=False
    )
    built = await engine.build_context(
        ANONYMOUS, sid, profile=NO_OVERRIDES, incoming=None, mid_turn=False, auto_compress=True
    )
    before = store.stats.log_fsyncs
    result = await engine.record_baseline(
        ANONYMOUS, sid, view_id=built.view_id, prompt_tokens=int(built.estimate.total * 1.02)
    )
    assert result.recorded
    assert store.stats.log_fsyncs - before == 0
    anchored = EngineState.of(await store.get_session(sid, caller=ANONYMOUS)).baseline
    assert anchored is not None and anchored.view_id == built.view_id
    observed = await store.list_calibration_observations("m", limit=10)
    assert len(observed) == 1
    await store.flush()
    assert store.stats.log_fsyncs - before == 1  # the calibration log, at the flusher's pass
    await engine.close()
    await store.close()
    store = FilesStore(root, settings=settings)
    await store.open()
    assert await store.list_calibration_observations("m", limit=10) == observed
    await store.close()
