"""Review of wip/turn5 (issue #15): adversarial cases of the turn-loop shortcuts.

* AppendMessages without the session read (``SessionService.append`` with a remembered profile):
  two engines over one store stand for two replicas; what one replica does to the session (delete
  it, create it again under the same id with another profile or owner) must not change what the
  other replica's append answers, compared with an append that reads the session first.
* Concurrent baselines sharing one refit (``TokenAccounting.observe``): the calibration returned
  must hold the baseline's own observation, and the sharing should hold on a store whose reads
  yield (PostgreSQL, files), not only on the memory store.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from contextsvc.config import ProfileConfig, Settings, TokenSettings
from contextsvc.core.calibration import Observation
from contextsvc.core.messages import Flags, Message, Role
from contextsvc.core.priors import N_FEATURES
from contextsvc.core.session import Principal
from contextsvc.engine.accounting import TokenAccounting
from contextsvc.engine.engine import Engine
from contextsvc.engine.validation import IncomingMessage
from contextsvc.errors import ContextError, NotFound
from contextsvc.stores.memory import MemoryStore
from tests.support.engines import make_engine

ALICE = Principal(user_id="alice")
BOB = Principal(user_id="bob")


def _two_profile_settings() -> Settings:
    return Settings(
        profiles={
            "small": ProfileConfig(model="hp", context_window=16_000),
            "big": ProfileConfig(model="other", context_window=400_000),
        },
        store="memory",
    )


def _engine(store: MemoryStore, settings: Settings) -> Engine:
    return make_engine(store, settings)


async def _replicas() -> tuple[Engine, Engine, MemoryStore, Settings]:
    settings = _two_profile_settings()
    store = MemoryStore(settings)
    await store.open()
    return _engine(store, settings), _engine(store, settings), store, settings


def _user(text: str, *, pinned: bool = False) -> list[IncomingMessage]:
    return [IncomingMessage(Message(role=Role.USER, content=text, flags=Flags(is_pinned=pinned)))]


async def test_a_pinned_append_is_capped_by_the_profile_of_the_session_as_it_is_now() -> None:
    """Replica A appended to a session of profile ``small`` (it remembers ``small``); replica B
    deleted it and created it again under the same id with profile ``big``. A pinned message that
    fits ``big``'s pinned cap must be accepted by A, as it is when A reads the session first.
    Found: ``_check_pinned_cap`` runs with the remembered (stale) window before the store can say
    the profile changed, so A refuses with PINNED_CAP_EXCEEDED."""
    a, b, store, settings = await _replicas()
    sid = (await a.sessions.create(ALICE, profile_id="small", name="", metadata={})).id
    await a.append(ALICE, sid, _user("hello"), request_id="", turn_complete=False)
    await b.sessions.delete(ALICE, sid)
    await store.create_session(caller=ALICE, profile_id="big", session_id=sid)
    await a.accounting.ensure_loaded("other")
    await a.accounting.ensure_loaded("hp")
    text = "pinned fact number " * 2000
    probe = Message(role=Role.USER, content=text, flags=Flags(is_pinned=True))
    small_cap = int(16_000 * settings.pinned_max_fraction)
    big_cap = int(400_000 * settings.pinned_max_fraction)
    assert a.accounting.message_tokens("hp", probe) > small_cap  # over the stale profile's cap
    assert a.accounting.message_tokens("other", probe) < big_cap  # well within the session's cap
    # What a replica that never saw the session answers (it reads the session first):
    fresh_replica = _engine(store, settings)
    await fresh_replica.append(ALICE, sid, _user(text, pinned=True), request_id="", turn_complete=False)
    # ... and what replica A answers without the read: the same acceptance.
    out = await a.append(ALICE, sid, _user(text, pinned=True), request_id="", turn_complete=False)
    assert out.sequence_numbers == [2]
    assert out.window_fraction == out.context_tokens / 400_000


async def test_an_append_to_a_session_recreated_by_another_user_is_not_found_for_the_first_owner() -> None:
    a, b, store, _ = await _replicas()
    sid = (await a.sessions.create(ALICE, profile_id="small", name="", metadata={})).id
    await a.append(ALICE, sid, _user("hello"), request_id="", turn_complete=False)
    await b.sessions.delete(ALICE, sid)
    await store.create_session(caller=BOB, profile_id="small", session_id=sid)  # same profile, Bob's
    with pytest.raises(NotFound):
        await a.append(ALICE, sid, _user("mine?"), request_id="", turn_complete=False)
    info = await store.get_session(sid, caller=BOB)
    assert info.last_sequence == 0  # nothing written into Bob's session
    # Bob's own append through replica A (which remembered the id for Alice) works and is priced.
    out = await a.append(BOB, sid, _user("bob here"), request_id="", turn_complete=False)
    assert out.sequence_numbers == [1] and out.window_fraction == out.context_tokens / 16_000


async def test_a_replay_after_the_session_was_recreated_elsewhere_is_priced_for_its_profile() -> None:
    """Replica B recreated the session (profile ``big``) and appended with request id r1; a retry
    of r1 on replica A (which remembers ``small``) is a replay, answered for ``big``."""
    a, b, store, _ = await _replicas()
    sid = (await a.sessions.create(ALICE, profile_id="small", name="", metadata={})).id
    await a.append(ALICE, sid, _user("hello"), request_id="", turn_complete=False)
    await b.sessions.delete(ALICE, sid)
    await store.create_session(caller=ALICE, profile_id="big", session_id=sid)
    first = await b.append(ALICE, sid, _user("retry me"), request_id="r1", turn_complete=False)
    again = await a.append(ALICE, sid, _user("retry me"), request_id="r1", turn_complete=False)
    assert again.replayed and again.sequence_numbers == first.sequence_numbers
    assert again.window_fraction == first.window_fraction == first.context_tokens / 400_000


def _obs(k: int) -> Observation:
    features = tuple(float(100 + k) if j < 3 else 1.0 for j in range(N_FEATURES))
    return Observation(chars=300 + 3 * k, tokens=200 + k, features=features, residual=0.01)


class GatedStore(MemoryStore):
    """Calibration reads take their snapshot when they start, like a database read, and one
    armed read then waits on ``gate``; a write releases ``release`` once it is durable."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.reads = 0
        self.read_delay = 0.0
        self.gate: asyncio.Event | None = None
        self.gate_model = ""
        self.release: asyncio.Event | None = None

    async def list_calibration_observations(self, model: str, *, limit: int) -> Any:
        self.reads += 1
        snapshot = await super().list_calibration_observations(model, limit=limit)
        if self.read_delay:
            await asyncio.sleep(self.read_delay)
        if self.gate is not None and model == self.gate_model:
            gate, self.gate = self.gate, None
            await gate.wait()
        return snapshot

    async def add_calibration_observation(self, model: str, observation: Observation) -> None:
        await super().add_calibration_observation(model, observation)
        if self.release is not None:
            self.release.set()


async def test_a_baseline_gets_back_a_calibration_holding_its_own_observation_after_an_eviction() -> None:
    """A read of model m started (its snapshot: 3 observations), m was evicted from the cache
    meanwhile (``max_cached_models``), then a baseline of m wrote a 4th observation. The old read
    finishing during the baseline's ``sleep(0)`` sets ``_read_upto[m]`` to 3 (it counted the writes
    before the eviction) while the counter of writes restarted at 1: the baseline skips its read
    and returns the old read's calibration, without its own observation."""
    settings = Settings(
        profiles={"default": ProfileConfig(model="m", context_window=200_000)},
        store="memory",
        tokens=TokenSettings(max_cached_models=1, calibration_refresh_seconds=0.05),
    )
    store = GatedStore(settings)
    await store.open()
    accounting = TokenAccounting(store, settings)
    for k in range(3):
        assert (await accounting.observe("m", _obs(k), source="s")).observations == k + 1
    await asyncio.sleep(0.1)  # m's cached copy is stale: the next use reads it again
    gate = asyncio.Event()
    store.gate, store.gate_model = gate, "m"
    old_read = asyncio.ensure_future(accounting.ensure_loaded("m"))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not old_read.done()  # the read of m is in flight (snapshot: 3 observations)
    await accounting.ensure_loaded("n")  # another model: m is evicted (and its counters with it)
    store.release = gate  # the old read finishes as soon as the next observation is written
    returned = await accounting.observe("m", _obs(3), source="s")
    await old_read
    assert returned.observations == 4  # the baseline's own observation is in what it got back


async def test_concurrent_baselines_share_one_read_on_a_store_whose_reads_yield() -> None:
    """The sharing works on the memory store (its read does not yield). On a store whose read
    takes I/O time, every baseline after the first sees ``_read_upto`` still below its count
    (the first read has not finished) and reads and refits on its own."""
    settings = Settings(profiles={"default": ProfileConfig(model="m", context_window=200_000)}, store="memory")
    store = GatedStore(settings)
    await store.open()
    accounting = TokenAccounting(store, settings)
    await accounting.ensure_loaded("m")
    store.reads, store.read_delay = 0, 0.01
    fits = await asyncio.gather(*(accounting.observe("m", _obs(k), source=f"s{k}") for k in range(5)))
    assert [c.observations for c in fits] == [5] * 5
    assert store.reads == 1  # one read (and one refit) for the five, as the memory store gets


def test_builds_through_the_kept_view_equal_builds_of_a_replica_without_it() -> None:
    """Random turns through the real engine: appends (tool runs left open, orphans, records, pinned
    rows), builds with changing inline overrides (system prompt, per-message budget), baselines of
    the last view. Replica A keeps views (re-priced, extended); replica C over the same store keeps
    none (``view_cache_sessions=0``) and reads the calibration at every use, as does A: every build
    of A must send what C's build sends, with the same estimate and notices."""
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hsettings
    from hypothesis import strategies as st

    from contextsvc.config import HotPathSettings
    from contextsvc.core.profile import CompressionOverrides, ProfileOverrides
    from tests.unit.test_engine_hot_path import _ROW_KINDS, _row

    row = st.tuples(st.sampled_from(_ROW_KINDS), st.integers(0, 120))
    append = st.tuples(
        st.just("append"),
        st.one_of(
            st.lists(row, min_size=1, max_size=4),
            st.builds(lambda w, rest: [("user", w), *rest], st.integers(0, 120), st.lists(row, max_size=3)),
            st.builds(
                lambda w, kinds: [(kind, w) for kind in kinds],
                st.integers(0, 120),
                st.sampled_from([["user", "answer"], ["user", "call", "result", "answer"], ["pinned", "call_text"]]),
            ),
            st.builds(lambda w: [("user", w), ("answer", w)], st.integers(0, 120)),
        ),
    )
    build = st.tuples(
        st.just("build"), st.tuples(st.sampled_from([None, "", "Be brief."]), st.sampled_from([None, 60]))
    )
    baseline = st.tuples(st.just("baseline"), st.integers(-3, 40))
    compact = st.tuples(st.just("compact"), st.none())
    ops = st.lists(st.one_of(append, build, baseline, compact), min_size=2, max_size=16)

    @hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ops)
    def check(steps: list[tuple[str, Any]]) -> None:
        async def run() -> None:
            def settings(cache: int) -> Settings:
                return Settings(
                    profiles={"default": ProfileConfig(model="hp", context_window=200_000, system_prompt="You help.")},
                    store="memory",
                    hot_path=HotPathSettings(view_cache_sessions=cache),
                    tokens=TokenSettings(calibration_refresh_seconds=0),
                )

            store = MemoryStore(settings(1024))
            await store.open()
            a, c = _engine(store, settings(1024)), _engine(store, settings(0))
            sid = (await a.sessions.create(ALICE, profile_id="", name="", metadata={})).id
            last_view = ""
            last_total = 0
            k = 0
            overrides = ProfileOverrides()
            for op, arg in steps:
                if op == "append":
                    batch = []
                    for kind, words in arg:
                        k += 1
                        batch.append(IncomingMessage(_row(kind, k, words)))
                    await a.append(ALICE, sid, batch, request_id="", turn_complete=False)
                elif op == "build":
                    prompt, budget = arg
                    overrides = ProfileOverrides(system_prompt=prompt, message_token_budget=budget)
                    got = await a.build_context(
                        ALICE, sid, profile=overrides, incoming=None, mid_turn=False, auto_compress=False
                    )
                    want = await c.build_context(
                        ALICE, sid, profile=overrides, incoming=None, mid_turn=False, auto_compress=False
                    )
                    assert [(v.message, v.truncated) for v in got.messages] == [
                        (v.message, v.truncated) for v in want.messages
                    ]
                    assert got.estimate == want.estimate
                    assert got.notices == want.notices
                    last_view, last_total = got.view_id, got.estimate.total
                elif op == "compact":  # committed by the other replica: A's kept view names old rows
                    with contextlib.suppress(ContextError):
                        await c.compress(
                            ALICE,
                            sid,
                            profile=ProfileOverrides(compression=CompressionOverrides(keep_recent=1, target=0.0001)),
                            note="",
                            dry_run=False,
                        )
                elif last_view:
                    await a.record_baseline(ALICE, sid, view_id=last_view, prompt_tokens=max(1, last_total + arg))
                    assert await a.post_turn.drain(5.0)
            await a.close()
            await c.close()

        asyncio.run(run())

    check()


async def test_a_build_after_another_replica_recreated_an_empty_session_names_a_view_it_can_baseline() -> None:
    """Replica A built session s while it held no message (the view: the system prompt alone) and
    keeps that view and its view record's id. Replica B deleted s and created it again under the
    same id (same profile, same owner). A's next build of the still empty session hits its kept
    view (no rows: the same row identities) and answers the kept view id without saving a record,
    but the record was deleted with the old session: RecordBaseline of that id is VIEW_NOT_FOUND.
    (Pre-existing: ``ViewMemo.get`` + ``ViewService._remember``, not new in wip/turn5.)"""
    from contextsvc.core.profile import ProfileOverrides

    settings = Settings(
        profiles={"default": ProfileConfig(model="hp", context_window=200_000, system_prompt="You help.")},
        store="memory",
    )
    store = MemoryStore(settings)
    await store.open()
    a, b = _engine(store, settings), _engine(store, settings)
    sid = (await a.sessions.create(ALICE, profile_id="", name="", metadata={})).id

    async def build() -> Any:
        return await a.build_context(
            ALICE, sid, profile=ProfileOverrides(), incoming=None, mid_turn=False, auto_compress=False
        )

    await build()
    await b.sessions.delete(ALICE, sid)
    await store.create_session(caller=ALICE, profile_id="", session_id=sid)
    view = await build()
    result = await a.record_baseline(ALICE, sid, view_id=view.view_id, prompt_tokens=view.estimate.total + 3)
    assert result.recorded
    await a.close()
    await b.close()
