"""The ``serve`` process hands its C heap's free memory back to the system (``heap_trim``, round 19)."""

from __future__ import annotations

import asyncio
import logging
import platform
import threading

import pytest

from contextsvc.heap_trim import load_malloc_trim, trim_loop


def test_glibc_malloc_trim_is_found_and_answers() -> None:
    trim = load_malloc_trim()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert trim is not None
        assert trim(0) in (0, 1)  # 1: memory was given back
    else:
        assert trim is None


async def test_the_loop_trims_at_its_interval_off_the_event_loop_and_stops_when_cancelled() -> None:
    calls: list[tuple[int, bool]] = []

    def trim(pad: int) -> int:
        calls.append((pad, threading.current_thread() is threading.main_thread()))
        return 1

    task = asyncio.create_task(trim_loop(0.02, trim))
    await asyncio.sleep(0.15)
    assert 3 <= len(calls) <= 8
    assert all(pad == 0 and not on_loop for pad, on_loop in calls)  # a worker thread, never the loop's
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    seen = len(calls)
    await asyncio.sleep(0.06)
    assert len(calls) == seen


async def test_a_failing_trim_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    outcomes = iter([OSError("no"), 1, 0, 1, 1, 1, 1, 1, 1, 1])

    def trim(pad: int) -> int:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    caplog.set_level(logging.DEBUG, logger="contextsvc.heap_trim")
    task = asyncio.create_task(trim_loop(0.01, trim))
    await asyncio.sleep(0.08)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "giving free heap memory back to the system failed"
    assert messages.count("free heap memory given back to the system") >= 2
