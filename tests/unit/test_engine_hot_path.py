"""Per-call work of the hot path (issue #15): a reused view reuses its view record, and
RecordBaseline never waits behind a compaction (its anchor applies after it, or is dropped)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import time
from typing import Any

import pytest
from PIL import Image

from contextsvc.config import HotPathSettings, ProfileConfig, Settings
from contextsvc.core.messages import Message, Role
from contextsvc.core.profile import ProfileOverrides
from contextsvc.core.session import ANONYMOUS, Principal
from contextsvc.core.tokens import EstimateMethod
from contextsvc.engine.engine import Engine
from contextsvc.engine.state import EngineState
from contextsvc.engine.validation import IncomingImage, IncomingMessage
from contextsvc.engine.views import PendingAnchor
from contextsvc.errors import NotFound
from contextsvc.stores.memory import MemoryStore
from tests.support.engines import make_engine


class CountingStore(MemoryStore):
    """A memory store that counts the view records written and read, and the state writes."""

    saved = 0
    views_read = 0
    sessions_read = 0
    state_writes = 0
    unlocked_state_writes = 0
    #: run once before the next ``update_state_if_unchanged`` (another writer coming first)
    before_unlocked_write: Any = None
    #: answer every ``update_state_if_unchanged`` with None (a compaction elsewhere, say)
    refuse_unlocked = False

    async def save_view(self, session_id: str, view: Any, *, keep: int) -> None:
        self.saved += 1
        await super().save_view(session_id, view, keep=keep)

    async def get_session(self, session_id: str, *, caller: Any) -> Any:
        self.sessions_read += 1
        return await super().get_session(session_id, caller=caller)

    async def get_view(self, session_id: str, view_id: str) -> Any:
        self.views_read += 1
        return await super().get_view(session_id, view_id)

    async def update_state(self, session_id: str, **kwargs: Any) -> Any:
        self.state_writes += 1
        return await super().update_state(session_id, **kwargs)

    async def update_state_if_unchanged(self, session_id: str, **kwargs: Any) -> Any:
        self.unlocked_state_writes += 1
        first, self.before_unlocked_write = self.before_unlocked_write, None
        if first is not None:
            await first()
        if self.refuse_unlocked:
            return None
        return await super().update_state_if_unchanged(session_id, **kwargs)


def _settings(**hot: Any) -> Settings:
    return Settings(
        profiles={"default": ProfileConfig(model="hp", context_window=200_000)},
        store="memory",
        hot_path=HotPathSettings(**hot),
    )


async def _engine(settings: Settings) -> tuple[Engine, CountingStore]:
    store = CountingStore(settings)
    await store.open()
    engine = make_engine(store, settings)
    return engine, store


async def _session(engine: Engine, n: int = 6) -> str:
    s = await engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})
    rows = [IncomingMessage(Message(role=Role.USER, content=f"message {i} " * 20)) for i in range(n)]
    await engine.append(ANONYMOUS, s.id, rows, request_id="", turn_complete=False)
    return s.id


async def _build(engine: Engine, sid: str, incoming: IncomingMessage | None = None) -> Any:
    return await engine.build_context(
        ANONYMOUS, sid, profile=ProfileOverrides(), incoming=incoming, mid_turn=False, auto_compress=True
    )


async def test_a_reused_view_keeps_its_view_id_and_writes_no_new_record() -> None:
    engine, store = await _engine(_settings())
    sid = await _session(engine)
    first = await _build(engine, sid)
    assert store.saved == 1
    for _ in range(5):
        again = await _build(engine, sid)
        assert again.view_id == first.view_id and again.messages is first.messages
    assert store.saved == 1
    # What changes the view gives a new id and a new record.
    await engine.append(ANONYMOUS, sid, [IncomingMessage(Message(role=Role.USER, content="more"))], request_id="",
                        turn_complete=False)  # fmt: skip
    changed = await _build(engine, sid)
    assert changed.view_id != first.view_id and store.saved == 2
    # A build with an incoming message is another view every time.
    incoming = IncomingMessage(Message(role=Role.USER, content="next"))
    a, b = await _build(engine, sid, incoming), await _build(engine, sid, incoming)
    assert len({a.view_id, b.view_id, changed.view_id}) == 3 and store.saved == 4
    # The reused id stays valid for RecordBaseline.
    recorded = await engine.record_baseline(ANONYMOUS, sid, view_id=changed.view_id, prompt_tokens=500)
    assert recorded.recorded


async def test_a_reused_view_id_is_saved_again_before_the_store_could_let_it_go() -> None:
    settings = _settings()
    keep = settings.tokens.views_kept_per_session
    engine, store = await _engine(settings)
    sid = await _session(engine)
    reused = await _build(engine, sid)
    incoming = IncomingMessage(Message(role=Role.USER, content="next"))
    for _ in range(3 * keep):  # other views of the session push the reused one out of the store's window
        await _build(engine, sid, incoming)
        again = await _build(engine, sid)
        assert again.view_id == reused.view_id
        assert await store.get_view(sid, reused.view_id) is not None
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=reused.view_id, prompt_tokens=400)
    assert result.recorded


async def test_a_baseline_of_the_view_just_built_reads_no_view_and_anchors_in_one_store_call() -> None:
    engine, store = await _engine(_settings())
    sid = await _session(engine)
    view = await _build(engine, sid)
    read = store.sessions_read
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total + 9)
    assert result.recorded
    # The anchor, written on the session as the build read it, is the baseline's one store call
    # besides its observation: no session read, no view read, no locked write.
    assert (store.sessions_read - read, store.views_read) == (0, 0)
    assert (store.unlocked_state_writes, store.state_writes) == (1, 0)
    info = await store.get_session(sid, caller=ANONYMOUS)
    baseline = EngineState.of(info).baseline
    assert baseline is not None and baseline.view_id == view.view_id
    assert baseline.tokens == info.context_tokens == view.estimate.total + 9
    await engine.close()


async def test_a_baseline_of_a_view_built_with_the_incoming_message_takes_the_same_one_store_call() -> None:
    """An agent that sends its user's message with BuildContext: the baseline of that view reads
    no session and no view either (the reusable view keeping its id: the test above)."""
    engine, store = await _engine(_settings())
    sid = await _session(engine)
    plain = await _build(engine, sid)
    incoming = IncomingMessage(Message(role=Role.USER, content="and what about the retry budget?"))
    view = await _build(engine, sid, incoming)
    assert view.view_id != plain.view_id and view.messages[-1].message.content == incoming.message.content
    read = store.sessions_read
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total + 9)
    assert result.recorded
    assert (store.sessions_read - read, store.views_read) == (0, 0)
    assert (store.unlocked_state_writes, store.state_writes) == (1, 0)
    baseline = EngineState.of(await store.get_session(sid, caller=ANONYMOUS)).baseline
    # Anchored on the stored rows: the incoming message is not stored yet.
    assert baseline is not None and baseline.view_id == view.view_id
    assert baseline.tokens == view.estimate.total + 9 - view.estimate.segments.incoming
    await engine.close()


async def test_a_baseline_of_a_view_the_store_let_go_is_not_found_though_this_process_saved_it() -> None:
    settings = _settings()
    engine, store = await _engine(settings)
    sid = await _session(engine)
    old = await _build(engine, sid)
    incoming = IncomingMessage(Message(role=Role.USER, content="next"))
    for _ in range(settings.tokens.views_kept_per_session):  # newer records push it out of the store
        await _build(engine, sid, incoming)
    assert await store.get_view(sid, old.view_id) is None
    with pytest.raises(NotFound) as err:
        await engine.record_baseline(ANONYMOUS, sid, view_id=old.view_id, prompt_tokens=400)
    assert err.value.reason == "VIEW_NOT_FOUND"
    await engine.close()


async def test_an_anchor_whose_session_changed_after_the_build_read_it_is_written_on_a_fresh_read() -> None:
    """Another writer's state lands between the build's read and the baseline's anchor: the write
    on the build's read is refused, and the baseline reads the session and anchors on that,
    keeping what the other writer wrote."""
    engine, store = await _engine(_settings())
    sid = await _session(engine)
    view = await _build(engine, sid)

    async def other_writer() -> None:
        fresh = EngineState.of(await store.get_session(sid, caller=ANONYMOUS))
        marked = dataclasses.replace(fresh, extra={**fresh.extra, "other": 1})
        await store.update_state(sid, caller=ANONYMOUS, state=marked.to_dict())

    store.before_unlocked_write = other_writer
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total)
    assert result.recorded and result.calibration.observations == 1  # observed once, not per attempt
    assert (store.unlocked_state_writes, store.state_writes) == (2, 1)  # refused, then written
    state = EngineState.of(await store.get_session(sid, caller=ANONYMOUS))
    assert state.extra.get("other") == 1
    assert state.baseline is not None and state.baseline.view_id == view.view_id
    await engine.close()


async def test_an_anchor_the_store_will_not_write_unlocked_is_written_under_the_lock() -> None:
    engine, store = await _engine(_settings())
    sid = await _session(engine)
    view = await _build(engine, sid)
    store.refuse_unlocked = True
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total + 3)
    assert result.recorded and result.calibration.observations == 1
    assert store.state_writes == 1  # apply_anchor's, under the compaction lock
    info = await store.get_session(sid, caller=ANONYMOUS)
    baseline = EngineState.of(info).baseline
    assert baseline is not None and baseline.view_id == view.view_id
    assert info.context_tokens == view.estimate.total + 3
    await engine.close()


async def test_a_strangers_baseline_of_a_view_this_process_saved_changes_nothing() -> None:
    engine, store = await _engine(_settings())
    sid = await _session(engine)
    view = await _build(engine, sid)
    before = await store.get_session(sid, caller=ANONYMOUS)
    with pytest.raises(NotFound):
        await engine.record_baseline(Principal("mallory"), sid, view_id=view.view_id, prompt_tokens=view.estimate.total)
    assert await store.get_session(sid, caller=ANONYMOUS) == before
    assert (await engine.accounting.ensure_loaded("hp")).observations == 0
    await engine.close()


async def test_a_baseline_of_a_view_with_images_anchors_nothing_on_either_way() -> None:
    """The provider's count of a view that carried images holds them, and a later view may leave
    some out: no anchor, neither written unlocked on the build's read nor under the lock."""
    settings = Settings(
        profiles={"default": ProfileConfig(model="hp", context_window=200_000, vision=True)}, store="memory"
    )
    engine, store = await _engine(settings)
    s = await engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})
    png = io.BytesIO()
    Image.new("RGB", (64, 64), (0, 90, 200)).save(png, format="PNG")
    shot = IncomingMessage(
        Message(role=Role.USER, content="a screenshot"), images=(IncomingImage(data=png.getvalue()),)
    )
    await engine.append(ANONYMOUS, s.id, [shot], request_id="", turn_complete=False)
    view = await _build(engine, s.id)
    assert view.estimate.images > 0
    result = await engine.record_baseline(ANONYMOUS, s.id, view_id=view.view_id, prompt_tokens=view.estimate.total)
    assert result.recorded  # recorded (an event), but the text calibration learns nothing from it
    assert (store.unlocked_state_writes, store.state_writes) == (0, 0)
    assert EngineState.of(await store.get_session(s.id, caller=ANONYMOUS)).baseline is None
    # The unlocked write itself refuses such a view, whoever hands it one.
    saved = engine.views._saved[s.id]
    pending = PendingAnchor(saved.view_id, saved.record, view.estimate.total, saved.session)
    assert await engine.views.try_anchor(ANONYMOUS, s.id, pending) is None
    assert store.unlocked_state_writes == 0
    await engine.close()


async def test_a_baseline_of_a_view_of_a_session_deleted_and_created_again_elsewhere_is_not_found() -> None:
    """Another replica deletes the session and creates it again under its id, with rows that look
    the same: the view this process saved of the old one is no view of the new one."""
    engine, store = await _engine(_settings())
    sid = await _session(engine)
    view = await _build(engine, sid)
    old = await store.get_session(sid, caller=ANONYMOUS)
    await store.delete_session(sid, caller=ANONYMOUS)  # through the store: this engine is not told
    await store.create_session(caller=ANONYMOUS, profile_id="", session_id=sid)
    rows = [IncomingMessage(Message(role=Role.USER, content=f"message {i} " * 20)) for i in range(6)]
    await store.append_messages(sid, [r.message for r in rows], caller=ANONYMOUS)
    assert (await store.get_session(sid, caller=ANONYMOUS)).last_sequence == old.last_sequence
    with pytest.raises(NotFound) as err:
        await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total)
    assert err.value.reason == "VIEW_NOT_FOUND"
    assert EngineState.of(await store.get_session(sid, caller=ANONYMOUS)).baseline is None
    assert (await engine.accounting.ensure_loaded("hp")).observations == 0
    await engine.close()


async def test_record_baseline_does_not_wait_behind_a_running_compaction() -> None:
    engine, store = await _engine(_settings(baseline_wait_seconds=0.05))
    sid = await _session(engine)
    view = await _build(engine, sid)
    release = asyncio.Event()
    held = asyncio.Event()

    async def compaction() -> None:  # holds the session's compaction lock like a summarizer call
        async with engine.compactor.lock(sid):
            held.set()
            await release.wait()

    running = asyncio.create_task(compaction())
    await held.wait()
    started = time.monotonic()
    result = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total + 7)
    assert time.monotonic() - started < 1.0
    assert store.unlocked_state_writes == 0  # a compaction runs here: no unlocked write is tried
    assert result.recorded and result.calibration.observations == 1  # the observation is in at once
    info = await engine.store.get_session(sid, caller=ANONYMOUS)
    assert EngineState.of(info).baseline is None  # the anchor waits for the compaction
    release.set()
    await running
    assert await engine.anchors_applied(5)
    baseline = EngineState.of(await engine.store.get_session(sid, caller=ANONYMOUS)).baseline
    assert baseline is not None and baseline.view_id == view.view_id
    assert (await _build(engine, sid)).estimate.method is EstimateMethod.BASELINE_DELTA
    await engine.close()


async def test_an_anchor_recorded_during_a_compaction_that_commits_is_dropped() -> None:
    engine, store = await _engine(_settings(baseline_wait_seconds=0.0))
    sid = await _session(engine)
    view = await _build(engine, sid)
    release = asyncio.Event()
    held = asyncio.Event()

    async def compaction() -> None:
        async with engine.compactor.lock(sid):
            held.set()
            await release.wait()
            # The commit: a new compaction cycle (what commit_compaction writes with its rows).
            fresh = await store.get_session(sid, caller=ANONYMOUS)
            await store.update_state(sid, caller=ANONYMOUS, state=EngineState.of(fresh).after_compaction().to_dict())

    running = asyncio.create_task(compaction())
    await held.wait()
    first = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total)
    second = await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total)
    assert first.recorded and second.recorded
    release.set()
    await running
    assert await engine.anchors_applied(5)
    state = EngineState.of(await store.get_session(sid, caller=ANONYMOUS))
    assert state.epoch == 1 and state.baseline is None  # a view of the old cycle anchors nothing
    await engine.close()


async def test_deferred_anchors_apply_in_the_order_they_were_recorded() -> None:
    engine, _ = await _engine(_settings(baseline_wait_seconds=0.0))
    sid = await _session(engine)
    old = await _build(engine, sid)
    await engine.append(ANONYMOUS, sid, [IncomingMessage(Message(role=Role.USER, content="more " * 30))],
                        request_id="", turn_complete=False)  # fmt: skip
    new = await _build(engine, sid)
    release = asyncio.Event()
    held = asyncio.Event()

    async def compaction() -> None:
        async with engine.compactor.lock(sid):
            held.set()
            await release.wait()

    running = asyncio.create_task(compaction())
    await held.wait()
    await engine.record_baseline(ANONYMOUS, sid, view_id=old.view_id, prompt_tokens=old.estimate.total)
    await engine.record_baseline(ANONYMOUS, sid, view_id=new.view_id, prompt_tokens=new.estimate.total)
    release.set()
    await running
    assert await engine.anchors_applied(5)
    baseline = EngineState.of(await engine.store.get_session(sid, caller=ANONYMOUS)).baseline
    assert baseline is not None and baseline.view_id == new.view_id
    await engine.close()


async def test_forgetting_a_session_drops_its_saved_view_record_too() -> None:
    # The files store calls ``views.forget`` when it evicts a session's rows: the reused view and
    # the saved view record both hold those rows, so both must go (the next build starts afresh).
    engine, store = await _engine(_settings())
    sid = await _session(engine)
    first = await _build(engine, sid)
    assert (await _build(engine, sid)).view_id == first.view_id and store.saved == 1
    engine.views.forget(sid)
    # Nothing of the engine's per-session view state may keep the evicted rows alive.
    assert sid not in engine.views._saved and sid not in engine.views._memo._entries
    after = await _build(engine, sid)
    assert after.view_id != first.view_id and store.saved == 2
    assert [v.message.content for v in after.messages] == [v.message.content for v in first.messages]


def _counter(engine: Engine, scale: float) -> Any:
    """The model's counter with every weight scaled: a refitted calibration, as far as a view can tell."""
    import dataclasses

    from contextsvc.core.tokens import CalibratedCounter

    cal = engine.accounting._registry.calibration("hp")
    return CalibratedCounter(dataclasses.replace(cal, weights=tuple(w * scale for w in cal.weights)))


def test_a_new_calibration_reprices_the_kept_view_exactly_as_a_fresh_assembly() -> None:
    async def run() -> None:
        engine, store = await _engine(_settings())
        sid = await _session(engine, 12)
        first = await _build(engine, sid)
        session = await store.get_session(sid, caller=ANONYMOUS)
        profile = await engine._profile_for(session, None)
        context = await store.load_context(sid, caller=ANONYMOUS)
        views = engine.views
        kept = views.assemble(profile, context, None, EngineState.of(session), session_id=sid)
        assert kept.parts is not None
        for scale in (0.5, 0.97, 1.03, 2.0):
            counter = _counter(engine, scale)
            again = views._repriced(profile, kept, EngineState.of(session), counter)
            fresh = views._assemble(profile, context, None, EngineState.of(session), counter)
            assert again is not None
            assert again.estimate == fresh.estimate
            assert again.estimate != kept.estimate
            assert (again.rows, again.segments, again.truncated, again.notices) == (
                fresh.rows,
                fresh.segments,
                fresh.truncated,
                fresh.notices,
            )
            assert (again.chars, again.features, again.last_sequence) == (
                fresh.chars,
                fresh.features,
                fresh.last_sequence,
            )
            assert again.plain is kept.plain  # the same messages to send: their encoding is reused
        # A price at which the whole view no longer fits one message's budget may cut messages:
        # the view is assembled again, never re-priced.
        assert views._repriced(profile, kept, EngineState.of(session), _counter(engine, 500.0)) is None
        assert first.messages is kept.plain

    asyncio.run(run())


def test_a_baseline_reprices_the_view_for_the_post_turn_check_and_the_next_build() -> None:
    async def run() -> None:
        engine, store = await _engine(_settings())
        sid = await _session(engine, 12)
        first = await _build(engine, sid)
        await engine.record_baseline(ANONYMOUS, sid, view_id=first.view_id, prompt_tokens=first.estimate.total + 7)
        assert await engine.post_turn.drain(5.0)
        second = await _build(engine, sid)
        assert second.messages is first.messages  # re-priced, not assembled again
        assert second.estimate.method is EstimateMethod.BASELINE_DELTA
        assert second.estimate.total == first.estimate.total + 7
        session = await store.get_session(sid, caller=ANONYMOUS)
        profile = await engine._profile_for(session, None)
        context = await store.load_context(sid, caller=ANONYMOUS)
        counter = engine.accounting.counter(profile.model)
        assert (
            second.estimate == engine.views._assemble(profile, context, None, EngineState.of(session), counter).estimate
        )
        await engine.close()

    asyncio.run(run())


def test_concurrent_baselines_of_a_model_share_one_refit_and_each_sees_its_own() -> None:
    from contextsvc.core.calibration import Observation
    from contextsvc.core.priors import N_FEATURES
    from contextsvc.engine.accounting import TokenAccounting

    class ReadCounting(MemoryStore):
        reads = 0

        async def list_calibration_observations(self, model: str, *, limit: int) -> Any:
            self.reads += 1
            return await super().list_calibration_observations(model, limit=limit)

    def obs(k: int) -> Observation:
        features = tuple(float(100 + k) if j < 3 else 1.0 for j in range(N_FEATURES))
        return Observation(chars=300 + 3 * k, tokens=200 + k, features=features, residual=0.01)

    async def run() -> None:
        settings = _settings()
        store = ReadCounting(settings)
        await store.open()
        accounting = TokenAccounting(store, settings)
        await accounting.ensure_loaded("hp")
        store.reads = 0
        fits = await asyncio.gather(*(accounting.observe("hp", obs(k), source=f"s{k}") for k in range(5)))
        assert store.reads == 1  # one read and one fit for the five
        assert [c.observations for c in fits] == [5] * 5  # each holds its own observation
        one_by_one = [(await accounting.observe("hp", obs(k), source="s")).observations for k in range(5, 8)]
        assert one_by_one == [6, 7, 8]
        assert store.reads == 4

    asyncio.run(run())


_ROW_KINDS = ["user", "answer", "call", "result", "orphan", "record", "note", "pinned", "call_text"]


def _row(kind: str, k: int, words: int) -> Message:
    from contextsvc.core.messages import Flags, ToolCall

    text = " ".join(f"w{(k * 5 + i) % 41}" for i in range(words))
    if kind == "user":
        return Message(role=Role.USER, content=f"ask {k} {text}")
    if kind == "answer":
        return Message(role=Role.ASSISTANT, content=f"answer {k} {text}")
    if kind == "call":
        return Message(
            role=Role.ASSISTANT, content="", tool_calls=(ToolCall(id=f"c{k}", name="read", arguments_json="{}"),)
        )
    if kind == "result":
        return Message(role=Role.TOOL, tool_call_id=f"c{k - 1}", content=f"result {text}")
    if kind == "orphan":
        return Message(role=Role.TOOL, tool_call_id="nobody", content=f"orphan {text}")
    if kind == "record":
        return Message(role=Role.SYSTEM, content=f"note {text}", metadata={"source": "task_note"})
    if kind == "note":
        return Message(role=Role.SYSTEM, content=f"hidden {text}", metadata={"source": "other"})
    if kind == "pinned":
        return Message(role=Role.USER, content=f"pinned {text}", flags=Flags(is_pinned=True))
    return Message(
        role=Role.ASSISTANT,
        content=f"calling {text}",
        tool_calls=(ToolCall(id=f"c{k}", name="x", arguments_json="{}"),),
    )


def _row_batches() -> Any:
    from hypothesis import strategies as st

    row = st.tuples(st.sampled_from(_ROW_KINDS), st.integers(0, 120))
    turn = st.tuples(st.sampled_from(["user", "pinned"]), st.integers(0, 120))
    # Anything, or a turn: a user row first (what can extend the kept view), then anything.
    batch = st.one_of(
        st.lists(row, min_size=1, max_size=5),
        st.builds(lambda first, rest: [first, *rest], turn, st.lists(row, max_size=4)),
        st.builds(
            lambda n, kinds: [(kind, n) for kind in kinds],
            st.integers(0, 120),
            st.sampled_from([["user", "answer"], ["user", "call", "result", "answer"], ["pinned", "call", "result"]]),
        ),
    )
    return st.lists(st.tuples(batch, st.sampled_from([0.0, 1.0, 1.04, 3.0])), min_size=1, max_size=10)


def test_appended_rows_extend_the_kept_view_exactly_as_a_fresh_assembly() -> None:
    """Random appends (tool calls left pending, orphans, records, pinned rows, calls with text) and
    refits: the view built through the kept one (extended, re-priced or
    assembled again) equals the view assembled from scratch, field by field."""
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hsettings
    from hypothesis import strategies as st

    from contextsvc.core.tokens import CalibratedCounter, estimate_segments, messages_chars, messages_features
    from contextsvc.core.view import Segment
    from contextsvc.engine.views import _parts_of

    @hsettings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_row_batches(), st.sampled_from([0, 900]))
    def check(batches: list[tuple[list[tuple[str, int]], float]], budget: int) -> None:
        async def run() -> None:
            # A small per-message budget, so that some views are cut (and never extended).
            settings = Settings(
                profiles={"default": ProfileConfig(model="hp", context_window=200_000, message_token_budget=budget)},
                store="memory",
            )
            engine, store = await _engine(settings)
            sid = (await engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})).id
            views = engine.views
            k = 0
            for rows, scale in batches:
                batch = []
                for kind, words in rows:
                    k += 1
                    batch.append(IncomingMessage(_row(kind, k, words)))
                await engine.append(ANONYMOUS, sid, batch, request_id="", turn_complete=False)
                session = await store.get_session(sid, caller=ANONYMOUS)
                profile = await engine._profile_for(session, None)
                context = await store.load_context(sid, caller=ANONYMOUS)
                counter = engine.accounting.counter("hp")
                if scale:
                    assert isinstance(counter, CalibratedCounter)
                    counter = _counter(engine, scale)
                    engine.accounting.counter = lambda model, c=counter: c  # type: ignore[method-assign]
                state = EngineState.of(session)
                got = views.assemble(profile, context, None, state, session_id=sid)
                fresh = views._assemble(profile, context, None, state, counter)
                for field in ("rows", "segments", "truncated", "estimate", "notices", "chars", "features", "sums"):
                    assert getattr(got, field) == getattr(fresh, field), field
                assert [(v.message, v.truncated, v.stored) for v in got.plain or []] == [
                    (v.message, v.truncated, v.stored) for v in fresh.plain or []
                ]
                assert (got.last_sequence, got.had_images, got.parts) == (
                    fresh.last_sequence,
                    fresh.had_images,
                    fresh.parts,
                )
                # The fresh assembly reads each row's features once and sums them: the same
                # figures as a pass over the rows for each sum.
                assert fresh.chars == messages_chars(fresh.rows)
                by = {s: [m for m, seg in zip(fresh.rows, fresh.segments, strict=True) if seg is s] for s in Segment}
                conversation = [
                    m
                    for m, seg in zip(fresh.rows, fresh.segments, strict=True)
                    if seg not in (Segment.SYSTEM, Segment.RECORDS, Segment.INCOMING)
                ]
                system = by[Segment.SYSTEM][0].content if by[Segment.SYSTEM] else ""
                parts = (system, by[Segment.RECORDS], conversation, by[Segment.INCOMING])
                assert _parts_of(fresh.rows, fresh.segments) == parts
                # "stored" means the very object the store gave.
                stored_ids = {id(m) for m in context}
                assert [v.stored for v in fresh.plain or []] == [id(v.message) in stored_ids for v in fresh.plain or []]
                if fresh.sums is not None:
                    assert fresh.parts is not None
                    assert fresh.sums.rows == messages_features(fresh.rows)
                    assert fresh.sums.segments == tuple(
                        messages_features(part) if part else None for part in estimate_segments(*fresh.parts)
                    )
            await engine.close()

        asyncio.run(run())

    check()


def test_an_append_follows_a_profile_another_replica_remembered_without_a_session_read() -> None:
    """Two engines over one store, as two replicas: when B's build remembers other overrides, A's
    cached profile of the session is stale. The append's returned session shows it: A's next
    appends price with the new model and report their share of the new window."""

    async def run() -> None:
        settings = Settings(profiles={"default": ProfileConfig(model="hp", context_window=200_000)}, store="memory")
        store = MemoryStore(settings)
        await store.open()
        a, b = make_engine(store, settings), make_engine(store, settings)
        sid = (await a.sessions.create(ANONYMOUS, profile_id="default", name="", metadata={})).id
        row = [IncomingMessage(Message(role=Role.USER, content="hello there, replica"))]
        await a.append(ANONYMOUS, sid, row, request_id="", turn_complete=False)  # A caches the profile
        inline = ProfileOverrides(model="other", context_window=50_000)
        await b.build_context(ANONYMOUS, sid, profile=inline, incoming=None, mid_turn=False, auto_compress=False)
        seen = await a.append(ANONYMOUS, sid, row, request_id="", turn_complete=False)
        assert seen.window_fraction == seen.context_tokens / 50_000
        priced = await a.append(ANONYMOUS, sid, row, request_id="", turn_complete=False)
        (stored,) = await store.get_messages(sid, caller=ANONYMOUS, first=3, last=3)
        assert stored.token_count == a.accounting.message_tokens("other", stored)
        assert priced.window_fraction == priced.context_tokens / 50_000
        await a.close()
        await b.close()

    asyncio.run(run())


def test_an_append_to_a_known_session_reads_no_session_and_a_recreated_one_is_priced_again() -> None:
    class ReadCounting(MemoryStore):
        reads = 0

        async def get_session(self, session_id: str, *, caller: Any) -> Any:
            self.reads += 1
            return await super().get_session(session_id, caller=caller)

    async def run() -> None:
        settings = Settings(
            profiles={
                "default": ProfileConfig(model="hp", context_window=200_000),
                "big": ProfileConfig(model="other", context_window=400_000),
            },
            store="memory",
        )
        store = ReadCounting(settings)
        await store.open()
        engine = make_engine(store, settings)
        sid = (await engine.sessions.create(ANONYMOUS, profile_id="default", name="", metadata={})).id
        row = [IncomingMessage(Message(role=Role.USER, content="hello there"))]
        first = await engine.append(ANONYMOUS, sid, row, request_id="", turn_complete=False)
        reads = store.reads
        second = await engine.append(ANONYMOUS, sid, row, request_id="", turn_complete=False)
        assert store.reads == reads  # no session read
        assert second.window_fraction == first.window_fraction * 2
        # Deleted and created again under the same id with another profile (as another replica would).
        await store.delete_session(sid, caller=ANONYMOUS)
        await store.create_session(caller=ANONYMOUS, profile_id="big", session_id=sid)
        third = await engine.append(ANONYMOUS, sid, row, request_id="", turn_complete=False)
        assert third.sequence_numbers == [1]
        assert third.window_fraction == third.context_tokens / 400_000  # priced for the new profile
        (stored,) = await store.get_messages(sid, caller=ANONYMOUS, first=1, last=1)
        assert stored.token_count == engine.accounting.message_tokens("other", stored)
        await store.delete_session(sid, caller=ANONYMOUS)
        with pytest.raises(NotFound):
            await engine.append(ANONYMOUS, sid, row, request_id="", turn_complete=False)
        await engine.close()

    asyncio.run(run())


async def test_a_compaction_cuts_each_row_for_the_view_once_however_often_it_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compaction plans more than once over the same rows (its plan, a wider one, the clearing,
    the checks of progress); each row over one message's budget is cut to it once per calibration,
    and the rows under it are told apart from their features, never cut one by one."""
    from contextsvc.engine import compaction

    settings = Settings(profiles={"default": ProfileConfig(model="hp", context_window=16_000)}, store="memory")
    engine, _ = await _engine(settings)
    sid = (await engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})).id
    long = {i + 1 for i in range(60) if i % 10 == 3}  # their sequence numbers: ~5,000 tokens each
    rows = [
        IncomingMessage(
            Message(role=Role.USER, content=(f"long {i} " * 2500 if i + 1 in long else f"message {i} " * 20))
        )
        for i in range(60)
    ]
    await engine.append(ANONYMOUS, sid, rows, request_id="", turn_complete=False)
    cut: list[int] = []
    real = compaction.truncate_for_view

    def counting(m: Message, budget: int, counter: Any) -> Message:
        cut.append(m.sequence_number)
        return real(m, budget, counter)

    monkeypatch.setattr(compaction, "truncate_for_view", counting)
    for dry_run in (True, False):  # the second compaction cuts again: nothing is kept past the first
        report = await engine.compress(ANONYMOUS, sid, profile=ProfileOverrides(), note="", dry_run=dry_run)
        assert report.compressed or dry_run
        assert len(cut) == len(set(cut)) and set(cut) & set(range(1, 61)) == long  # each long row once, no other
        cut.clear()
    await engine.close()
