"""BuildContext cost against display-history length (DESIGN §7 "Growth").

Sessions whose display histories hold ~100, ~1,000, ~5,000 and ~10,000 messages, each with a
compressed context of the same shape (a summary, the kept turns, then the same 10 fresh turns), plus
a fresh session of that context size that was never compressed. Histories are built the way a long
session builds them: appended in batches, a compaction after every batch. Then BuildContext is timed
round-robin over the sessions (so machine noise hits all of them alike) and the medians compared.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from scenario import code, log_lines, prose

from contextsvc.core.messages import Message, Role, ToolCall
from contextsvc.core.profile import ProfileOverrides
from contextsvc.core.session import ANONYMOUS
from contextsvc.engine.engine import Engine
from contextsvc.engine.validation import IncomingMessage
from contextsvc.engine.views import BuiltView

SIZES = (100, 1000, 5000, 10_000)
TAIL_TURNS = 10  # the same fresh turns appended to every session after its last compaction
BATCH = 400  # messages per append (the limit is 500) and per compaction step
WARMUP_ROUNDS = 5


@dataclass
class GrowthRow:
    label: str
    display: int
    context_rows: int
    context_tokens: int
    median_ms: float
    p90_ms: float
    compactions: int


def _turn(rng: random.Random, n: int) -> list[IncomingMessage]:
    call = ToolCall(id=f"g{n}", name="read_file", arguments_json='{"path": "src/module.py"}')
    body = code(rng, rng.randrange(300, 900)) if n % 2 else log_lines(rng, rng.randrange(300, 900))
    return [
        IncomingMessage(Message(role=Role.USER, content=f"step {n}: " + prose(rng, 20))),
        IncomingMessage(Message(role=Role.ASSISTANT, tool_calls=(call,))),
        IncomingMessage(Message(role=Role.TOOL, content=body, tool_call_id=call.id)),
        IncomingMessage(Message(role=Role.ASSISTANT, content=prose(rng, 25))),
    ]


async def _session(engine: Engine, display: int, seed: int, compress: bool) -> tuple[str, int]:
    """A session of ``display`` messages ending in the shared tail; returns (id, compactions).

    Uncompressed, the history starts with one long user note standing in for the summary, so the
    fresh session's context has the rows and tokens of a compressed one."""
    s = await engine.sessions.create(ANONYMOUS, profile_id="", name=f"growth-{display}", metadata={})
    rng = random.Random(seed + display)
    history = max(0, display - 4 * TAIL_TURNS)
    rows: list[IncomingMessage] = []
    if not compress:
        rows.append(IncomingMessage(Message(role=Role.USER, content="Notes so far: " + prose(rng, 330))))
    n = 0
    while len(rows) < history:
        rows += _turn(rng, n)
        n += 1
    compactions = 0
    for i in range(0, len(rows), BATCH):
        await engine.append(ANONYMOUS, s.id, rows[i : i + BATCH], request_id="", turn_complete=False)
        if compress:
            await engine.compress(ANONYMOUS, s.id, profile=ProfileOverrides(), note="growth setup", dry_run=False)
            compactions += 1
    tail_rng = random.Random(seed)  # the same tail text in every session
    tail = [m for k in range(TAIL_TURNS) for m in _turn(tail_rng, 10**6 + k)]
    await engine.append(ANONYMOUS, s.id, tail, request_id="", turn_complete=False)
    return s.id, compactions


async def _build_ms(engine: Engine, sid: str) -> tuple[float, BuiltView]:
    t0 = time.perf_counter()
    view = await engine.build_context(
        ANONYMOUS, sid, profile=ProfileOverrides(), incoming=None, mid_turn=False, auto_compress=True
    )
    return (time.perf_counter() - t0) * 1000, view


async def measure(engine: Engine, *, rounds: int, seed: int) -> list[GrowthRow]:
    # The fresh session's context is shaped like the compressed ones: a note, 4 kept turns, the tail.
    fresh = 1 + 4 * (TAIL_TURNS + 4)
    specs = [(f"~{d:,} display", d, True) for d in SIZES] + [("fresh, never compressed", fresh, False)]
    sessions = []
    for label, display, compress in specs:
        sid, compactions = await _session(engine, display, seed, compress)
        # One model call so the estimate is anchored on a baseline, as in a running session.
        _, view = await _build_ms(engine, sid)
        await engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=view.estimate.total)
        await engine.post_turn.drain(60)
        sessions.append((label, sid, compactions))
    times: dict[str, list[float]] = {sid: [] for _, sid, _ in sessions}
    compressed_during = 0
    for r in range(WARMUP_ROUNDS + rounds):
        order = sessions[r % len(sessions) :] + sessions[: r % len(sessions)]
        for _, sid, _ in order:
            ms, view = await _build_ms(engine, sid)
            if view.compression is not None:
                compressed_during += 1
            if r >= WARMUP_ROUNDS:
                times[sid].append(ms)
    if compressed_during:
        raise RuntimeError(f"{compressed_during} timed builds compressed: the growth sessions are too large")
    rows = []
    for label, sid, compactions in sessions:
        info = await engine.store.get_session(sid, caller=ANONYMOUS)
        context = await engine.store.load_context(sid, caller=ANONYMOUS)
        _, view = await _build_ms(engine, sid)
        ts = sorted(times[sid])
        rows.append(
            GrowthRow(
                label=label,
                display=info.display_message_count,
                context_rows=len(context),
                context_tokens=view.estimate.total,
                median_ms=statistics.median(ts),
                p90_ms=ts[int(0.9 * (len(ts) - 1))],
                compactions=compactions,
            )
        )
    return rows
