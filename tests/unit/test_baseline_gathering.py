"""Baselines of one model from many sessions arriving close together share one refit
(``TokenAccounting._gather``, ``tokens.calibration_coalesce_seconds`` and ``_sessions``): every
RecordBaseline still gets back a calibration holding its own observation; a gathering ends once as
many other sessions joined as had recorded within the window before it; a lone agent (however
busy the loop), a few agents, one client going through sessions one call at a time, and
baselines further apart than the window never wait; a gathering whose leader is cancelled leaves
nobody waiting."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from contextsvc.config import ProfileConfig, Settings, TokenSettings
from contextsvc.core.arrivals import Arrivals
from contextsvc.core.calibration import Calibration, Observation
from contextsvc.core.priors import N_FEATURES
from contextsvc.engine.accounting import TokenAccounting
from contextsvc.stores.memory import MemoryStore
from tests.support.compaction_harness import Rig, a, u, words


def _obs(k: int) -> Observation:
    features = tuple(float(100 + k) if j < 3 else 1.0 for j in range(N_FEATURES))
    return Observation(chars=300 + 3 * k, tokens=200 + k, features=features, residual=0.01)


class CountingStore(MemoryStore):
    """Counts calibration reads (one per refit) and the order observations were written in."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.reads = 0
        self.written: list[int] = []

    async def list_calibration_observations(self, model: str, *, limit: int) -> Any:
        self.reads += 1
        return await super().list_calibration_observations(model, limit=limit)

    async def add_calibration_observation(self, model: str, observation: Observation) -> None:
        await super().add_calibration_observation(model, observation)
        self.written.append(observation.tokens - 200)


async def _accounting(window: float, sessions: int = 3) -> tuple[CountingStore, TokenAccounting]:
    settings = Settings(
        profiles={"default": ProfileConfig(model="m", context_window=200_000)},
        store="memory",
        tokens=TokenSettings(calibration_coalesce_seconds=window, calibration_coalesce_sessions=sessions),
    )
    store = CountingStore(settings)
    await store.open()
    accounting = TokenAccounting(store, settings)
    await accounting.ensure_loaded("m")
    store.reads = 0
    return store, accounting


@contextlib.asynccontextmanager
async def busy_loop(ms_per_iteration: float = 2.0) -> AsyncIterator[None]:
    """Other requests' work: every loop iteration runs ~``ms_per_iteration`` of CPU besides ours."""
    running = True

    async def work() -> None:
        while running:
            end = time.perf_counter() + ms_per_iteration / 1000
            while time.perf_counter() < end:
                pass
            await asyncio.sleep(0)

    task = asyncio.ensure_future(work())
    await asyncio.sleep(0)
    try:
        yield
    finally:
        running = False
        await task


async def _staggered(accounting: TokenAccounting, count: int, gap: float) -> list[Calibration]:
    """``count`` baselines of ``count`` sessions, ``gap`` seconds apart."""

    async def one(k: int) -> Calibration:
        await asyncio.sleep(k * gap)
        return await accounting.observe("m", _obs(k), source=f"session-{k}")

    return await asyncio.wait_for(asyncio.gather(*(one(k) for k in range(count))), 10)


async def test_baselines_of_many_sessions_arriving_close_together_share_one_refit() -> None:
    store, accounting = await _accounting(0.25)  # three other sessions within the window gather
    got = await _staggered(accounting, 6, 0.01)  # six sessions within one window
    # The first three found fewer than three other sessions' baselines before them: each refitted
    # at once, alone. The fourth found three and opened a gathering; the last two joined it.
    assert store.reads == 4
    # What each got back holds its own observation.
    assert [c.observations for c in got] == [1, 2, 3, 6, 6, 6]


async def test_without_a_window_every_baseline_refits_alone() -> None:
    store, accounting = await _accounting(0.0)
    # One after another: staggered by 10 ms on a loaded machine, two could still overlap and share
    # the refit already under way (what any two concurrent baselines do, window or not).
    got = [await accounting.observe("m", _obs(k), source=f"session-{k}") for k in range(6)]
    assert store.reads == 6  # as before the window: one read and one fit per baseline
    for position, k in enumerate(store.written):
        assert got[k].observations >= position + 1


async def test_a_lone_agent_never_waits_even_on_a_busy_loop() -> None:
    store, accounting = await _accounting(1.0)  # a window far longer than a refit
    started = time.monotonic()
    async with busy_loop():  # other requests' work around it does not make it wait
        for k in range(5):
            assert (await accounting.observe("m", _obs(k), source="agent")).observations == k + 1
    assert time.monotonic() - started < 1.0
    assert store.reads == 5
    assert accounting._gathering == {}


async def test_sessions_whose_baselines_are_further_apart_than_the_window_never_wait() -> None:
    store, accounting = await _accounting(0.5)
    for k in range(4):
        await asyncio.sleep(0.6)  # longer than the window since the other session's baseline
        started = time.monotonic()
        got = await accounting.observe("m", _obs(k), source="ab"[k % 2])
        assert time.monotonic() - started < 0.5  # refitted at once, not after the window
        assert got.observations == k + 1
    assert store.reads == 4


async def test_a_baseline_after_enough_other_sessions_waits_for_the_window_and_holds_its_observation() -> None:
    store, accounting = await _accounting(0.2, sessions=1)
    assert (await accounting.observe("m", _obs(0), source="a")).observations == 1
    started = time.monotonic()
    got = await accounting.observe("m", _obs(1), source="b")
    assert time.monotonic() - started >= 0.2  # it opened a gathering (another session was recent)
    assert got.observations == 2
    assert store.reads == 2  # nobody joined: its own refit after the window
    assert accounting._gathering == {}


async def test_two_agents_recording_back_to_back_never_wait() -> None:
    store, accounting = await _accounting(1.0)  # gathering needs three other sessions
    started = time.monotonic()
    for k in range(6):
        got = await accounting.observe("m", _obs(k), source="ab"[k % 2])  # concurrent requests
        assert got.observations == k + 1
    assert time.monotonic() - started < 1.0
    assert store.reads == 6


async def test_a_baseline_recorded_while_no_other_request_ran_never_waits() -> None:
    """One client going through its sessions one call at a time: another session's baseline came
    just before, but no other request ran during this one's turn (``concurrent=False``)."""
    store, accounting = await _accounting(1.0, sessions=1)  # one other session would do
    started = time.monotonic()
    for k in range(6):
        got = await accounting.observe("m", _obs(k), source=f"session-{k % 3}", concurrent=False)
        assert got.observations == k + 1
    assert time.monotonic() - started < 1.0
    assert store.reads == 6


async def test_a_gathering_whose_leader_is_cancelled_leaves_its_followers_a_refit_of_their_own() -> None:
    store, accounting = await _accounting(0.3, sessions=1)
    for k, source in enumerate(("a", "a2", "a3")):  # three other sessions' baselines, just now
        await accounting.observe("m", _obs(k), source=source, concurrent=False)
    store.reads = 0
    leader = asyncio.ensure_future(accounting.observe("m", _obs(3), source="b"))  # expects three
    await asyncio.sleep(0.05)
    assert "m" in accounting._gathering  # the leader waits for others
    followers = [asyncio.ensure_future(accounting.observe("m", _obs(k), source=f"s{k}")) for k in (4, 5)]
    await asyncio.sleep(0.05)
    assert not leader.done()  # two of the three sessions it expects joined
    leader.cancel()
    got = await asyncio.wait_for(asyncio.gather(*followers), 5)
    with pytest.raises(asyncio.CancelledError):
        await leader
    assert [c.observations for c in got] == [6, 6]  # each holds its own (and the leader's write)
    assert store.reads == 1  # the first follower's refit served both
    assert accounting._gathering == {}


async def _leader_after_three(store: CountingStore, accounting: TokenAccounting) -> asyncio.Future[Calibration]:
    """Baselines of sessions a, b and c (each refits alone: fewer than three others before it),
    then d's, which opens a gathering expecting three joiners; d's pending call."""
    for k, source in enumerate(("a", "b", "c")):
        await accounting.observe("m", _obs(k), source=source)
    store.reads = 0
    leader = asyncio.ensure_future(accounting.observe("m", _obs(3), source="d"))
    await asyncio.sleep(0.05)
    assert not leader.done() and "m" in accounting._gathering
    return leader


async def test_a_gathering_ends_once_as_many_sessions_joined_as_had_recorded_before_it() -> None:
    """Agents recording at a steady pace: the leader found three other sessions' baselines within
    the window before it, so it waits for three joiners, not for the whole window."""
    store, accounting = await _accounting(1.0, sessions=3)
    started = time.monotonic()
    leader = await _leader_after_three(store, accounting)
    joined = [
        asyncio.ensure_future(accounting.observe("m", _obs(k), source=source)) for k, source in ((4, "a"), (5, "b"))
    ]
    await asyncio.sleep(0.05)
    assert not leader.done()  # two of three
    joined.append(asyncio.ensure_future(accounting.observe("m", _obs(6), source="c")))
    got = await asyncio.wait_for(asyncio.gather(leader, *joined), 2)
    assert time.monotonic() - started < 0.5  # the third joiner closed it, not the 1 s window
    assert [c.observations for c in got] == [7, 7, 7, 7]
    assert store.reads == 1  # one refit for the four
    assert accounting._gathering == {}


async def test_a_gathering_that_fewer_join_than_expected_lasts_its_window() -> None:
    store, accounting = await _accounting(0.3, sessions=3)
    started = time.monotonic()
    leader = await _leader_after_three(store, accounting)
    follower = asyncio.ensure_future(accounting.observe("m", _obs(4), source="a"))
    got = await asyncio.wait_for(asyncio.gather(leader, follower), 5)
    assert time.monotonic() - started >= 0.3  # one of three came: the window ran out
    assert [c.observations for c in got] == [5, 5]
    assert store.reads == 1


def test_arrivals_count_the_other_sessions_within_the_window() -> None:
    arrivals = Arrivals()
    assert arrivals.note("m", "a", 1.0, 0.5) == 0
    assert arrivals.note("m", "a", 1.1, 0.5) == 0  # the same session is never "another"
    assert arrivals.note("m", "b", 1.2, 0.5) == 1
    assert arrivals.note("m", "c", 1.3, 0.5) == 2
    assert arrivals.note("m", "a", 1.4, 0.5) == 2  # b and c (a's own is not counted)
    assert arrivals.note("m", "d", 1.75, 0.5) == 2  # b (1.2) fell out of the window: c and a
    assert arrivals.note("n", "c", 1.8, 0.5) == 0  # per model
    assert arrivals.note("m", "e", 9.0, 0.5) == 0  # all old: dropped
    assert len(arrivals._recent["m"]) == 1
    arrivals.forget("m")
    assert arrivals.note("m", "d", 9.1, 0.5) == 0


async def test_through_the_engine_a_client_going_through_sessions_one_call_at_a_time_never_waits() -> None:
    """Builds and baselines of three sessions in turn, each baseline straight after its own build:
    no other request ran during any turn, so no baseline waits, though another session's baseline
    always came just before (the window here is 1 s)."""
    rig = await Rig.start(tokens=TokenSettings(calibration_coalesce_seconds=1.0, calibration_coalesce_sessions=1))
    try:
        sids = [await rig.session() for _ in range(3)]
        started = time.monotonic()
        for turn in range(3):
            for sid in sids:
                await rig.append(sid, u(f"question {turn}"), a(f"answer {turn} " + words(20)))
                assert (await rig.baseline(sid, await rig.build(sid))).recorded
        assert time.monotonic() - started < 1.0  # nine baselines, none waited for the window
        assert rig.engine.accounting._gathering == {}
    finally:
        await rig.close()


async def test_through_the_engine_interleaved_turns_of_several_sessions_share_a_refit() -> None:
    """Agents whose turns overlap (each session's view built, then the baselines): the second
    baseline finds the first session's just before it and requests served during its turn, so it
    gathers, and the third joins it, which ends the gathering: as many sessions came as had
    recorded before it (one), so neither waits for the window."""
    rig = await Rig.start(tokens=TokenSettings(calibration_coalesce_seconds=1.0, calibration_coalesce_sessions=1))
    try:
        sids = [await rig.session() for _ in range(3)]
        for sid in sids:
            await rig.append(sid, u("question"), a("answer " + words(20)))
        views = [await rig.build(sid) for sid in sids]
        reads = 0
        read = rig.store.list_calibration_observations

        async def counted(model: str, *, limit: int) -> Any:
            nonlocal reads
            reads += 1
            return await read(model, limit=limit)

        rig.store.list_calibration_observations = counted
        first = await rig.baseline(sids[0], views[0])  # refits at once: no other session's baseline yet
        assert reads == 1
        started = time.monotonic()
        rest = await asyncio.gather(*(rig.baseline(sid, view) for sid, view in zip(sids[1:], views[1:], strict=True)))
        # The second opened a gathering expecting one other session (the first had recorded just
        # before); the third joined it, which closed it long before its window.
        assert time.monotonic() - started < 0.5
        assert reads == 2  # one refit for the second and third
        observed = [r.calibration.observations for r in (first, *rest)]
        assert observed == [observed[0], observed[0] + 2, observed[0] + 2]
    finally:
        await rig.close()
