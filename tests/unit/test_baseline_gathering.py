"""Baselines of one model arriving close together on a busy server share one refit
(``TokenAccounting._gather``, ``tokens.calibration_coalesce_seconds``): every RecordBaseline
still gets back a calibration holding its own observation, a lone baseline on an idle loop never
waits, and a gathering whose leader is cancelled leaves nobody waiting."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from contextsvc.config import ProfileConfig, Settings, TokenSettings
from contextsvc.core.calibration import Calibration, Observation
from contextsvc.core.priors import N_FEATURES
from contextsvc.engine.accounting import TokenAccounting
from contextsvc.stores.memory import MemoryStore


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


async def _accounting(window: float) -> tuple[CountingStore, TokenAccounting]:
    settings = Settings(
        profiles={"default": ProfileConfig(model="m", context_window=200_000)},
        store="memory",
        tokens=TokenSettings(calibration_coalesce_seconds=window),
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
    async def one(k: int) -> Calibration:
        await asyncio.sleep(k * gap)
        return await accounting.observe("m", _obs(k))

    return await asyncio.wait_for(asyncio.gather(*(one(k) for k in range(count))), 10)


async def test_baselines_arriving_close_together_on_a_busy_loop_share_one_refit() -> None:
    store, accounting = await _accounting(0.25)
    async with busy_loop():
        got = await _staggered(accounting, 6, 0.01)  # all six within the first one's 250 ms
    assert store.reads == 1  # one read, one fit for the six (each refitted alone before)
    # What each got back holds its own observation (here: all six).
    assert [c.observations for c in got] == [6] * 6


async def test_without_a_window_every_baseline_refits_alone() -> None:
    store, accounting = await _accounting(0.0)
    async with busy_loop():
        got = await _staggered(accounting, 6, 0.01)
    assert store.reads == 6  # as before the window: one read and one fit per baseline
    for position, k in enumerate(store.written):
        assert got[k].observations >= position + 1


async def test_a_lone_baseline_on_an_idle_loop_never_waits() -> None:
    store, accounting = await _accounting(1.0)  # a window far longer than a refit
    started = time.monotonic()
    for k in range(5):
        assert (await accounting.observe("m", _obs(k))).observations == k + 1
    assert time.monotonic() - started < 1.0
    assert store.reads == 5


async def test_a_gathering_whose_leader_is_cancelled_leaves_its_followers_a_refit_of_their_own() -> None:
    store, accounting = await _accounting(0.3)
    async with busy_loop():
        leader = asyncio.ensure_future(accounting.observe("m", _obs(0)))
        await asyncio.sleep(0.05)
        assert "m" in accounting._gathering  # the leader waits for others
        followers = [asyncio.ensure_future(accounting.observe("m", _obs(k))) for k in (1, 2)]
        await asyncio.sleep(0.05)
        leader.cancel()
        got = await asyncio.wait_for(asyncio.gather(*followers), 5)
    with pytest.raises(asyncio.CancelledError):
        await leader
    assert [c.observations for c in got] == [3, 3]  # each holds its own (and the leader's write)
    assert store.reads == 1  # the first follower's refit served both
    assert accounting._gathering == {}
