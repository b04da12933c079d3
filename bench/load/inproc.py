"""What the in-process benches (``turns_inproc.py``, ``append_inproc.py``) share: the servicer's call
context, the load suite's settings, seeded sessions, and the summary of an A/B run.

``contextsvc`` is imported inside the functions: an A/B run puts the checkout under test first on
``sys.path`` before calling them.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


class CallContext:
    """What the servicer reads of a call's context: nothing but errors (no auth: the owner)."""

    async def abort_with_status(self, status: Any) -> None:
        raise RuntimeError(f"call failed: {status}")


def bench_settings() -> Any:
    """The load suite's server settings (run.py ``SERVER_CONFIG``, its ``bench`` profile)."""
    from run import SERVER_CONFIG

    from contextsvc.config import load_settings

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as fh:
        fh.write(SERVER_CONFIG)
    try:
        return load_settings(fh.name)
    finally:
        os.unlink(fh.name)


async def serve_in_process(store: Any, settings: Any) -> tuple[Any, Any]:
    """``(engine, servicer)`` on ``store`` (opened here) as ``serve`` wires them: the store's event
    bus or the memory one, the system clock, the configured summarizers. The caller closes the
    engine (and the store's bus, ``close_in_process``)."""
    from contextsvc.api.servicer import ContextServicer
    from contextsvc.clock import SystemClock
    from contextsvc.engine.engine import Engine
    from contextsvc.events.memory_bus import MemoryEventBus
    from contextsvc.summarizers.registry import build_summarizers

    await store.open()
    # The store's own bus where it has one (PostgreSQL), as ``serve`` wires it: its statements
    # then publish their events themselves.
    make_bus = getattr(store, "make_event_bus", None)
    engine = Engine(
        store=store,
        bus=make_bus() if make_bus is not None else MemoryEventBus(retention=1000),
        settings=settings,
        clock=SystemClock(),
        summarizers=build_summarizers(settings),
    )
    return engine, ContextServicer(engine)


async def seed_sessions(
    servicer: Any, ctx: Any, sessions: int, messages: int, profile: str = "bench", long_every: int = 0
) -> list[str]:
    """``sessions`` sessions of ``profile`` (run.py ``SERVER_CONFIG``), ``messages`` messages each
    (one tool result in every ``long_every`` long: ``workload.messages``); their ids."""
    from workload import messages as seed_messages

    from contextsvc._gen.v1 import context_service_pb2 as pb

    sids = []
    for _ in range(sessions):
        created = await servicer.CreateSession(pb.CreateSessionRequest(profile_id=profile, name="bench"), ctx)
        await servicer.AppendMessages(
            pb.AppendMessagesRequest(
                session_id=created.id, messages=seed_messages(messages, long_every=long_every, salt=created.id)
            ),
            ctx,
        )
        sids.append(created.id)
    return sids


def print_ab(figures: dict[str, list[float]], unit: str) -> None:
    """``figures``: the per-round values of ``this`` and ``other`` checkout, in ``unit``."""
    for name, values in figures.items():
        print(f"{name}: median {statistics.median(values):.3f} {unit}, min {min(values):.3f}")
    print(f"this / other (medians): {statistics.median(figures['this']) / statistics.median(figures['other']):.3f}")
    print(f"load average: {os.getloadavg()[0]:.1f}")


def alternate(script: Path, other: str, rounds: int, args: list[str], unit: str) -> None:
    """An A/B run: ``script --root <checkout> *args`` for this checkout (the one holding
    ``script``) and ``other`` in turn, ``rounds`` times, each in its own process, whose output
    starts with its figure in ``unit``; then ``print_ab``.

    The two take turns going first (this, other; other, this; ...): a run pays for some of the
    one before it (the files store's runs leave their data directory's deletion and writeback to
    the next), which made whichever went first ~10 % slower on the files store (round 16)."""
    checkouts = {"this": script.resolve().parents[2], "other": Path(other).resolve()}
    figures: dict[str, list[float]] = {name: [] for name in checkouts}
    for r in range(rounds):
        order = list(checkouts.items()) if r % 2 == 0 else list(reversed(checkouts.items()))
        for name, root in order:
            cmd = [sys.executable, str(script.resolve()), "--root", str(root), *args]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if done.returncode:  # say why, not only that it failed
                sys.exit(f"{name} ({root}) failed:\n{done.stderr[-3000:]}")
            figures[name].append(float(done.stdout.split()[0]))
        print(f"round {r + 1}: this {figures['this'][-1]:.3f}  other {figures['other'][-1]:.3f} {unit}", flush=True)
    print_ab(figures, unit)
