"""Compression-behaviour benchmark: the real engine through a simulated 1,000-turn agent session.

    python bench/compression/run.py                 # print the tables (~1.5-2 min on 2 cores)
    python bench/compression/run.py --record        # and write them into bench/RESULTS.md (## Compression)
    python bench/compression/run.py --turns 200     # a shorter session (same seed: the same first 200 turns)

In process, no network: ``contextsvc.engine.engine.Engine`` over the files store in a temporary
directory, the in-memory event bus and the default (extractive) summarizer, with an 8,192-token
window profile (every other number at its default). A scripted runtime plays the agent loop
(DESIGN §1): append the user's ask (or pass it as ``incoming``), BuildContext (PRE_TURN, then
MID_TURN inside tool loops), a fake model call whose prompt count goes to RecordBaseline, append
the tool calls and results, and finally the answer with ``turn_complete``; the post-turn worker is
drained after every baseline and every turn, so a seed replays exactly. On CONTEXT_TOO_LARGE the
runtime does what it can: Compress (forced) and one retry.

The same session is played once per fake model (one process each): ``estimate`` reports the view's
estimate +-5% (2% of calls a silently truncated 40-65%), ``tokenizer`` a deterministic hidden
tokenizer (each message's size units x 0.5, off by its own fixed +-5%, plus images and framing;
the same 2% truncated). Every view and the event stream are checked against DESIGN §5.2/§5.4/§7
with checks written apart from the engine's (checks.py). Then, alone, BuildContext is timed
against display-history length (growth.py).

Findings are reported, never worked around: a rule the engine breaks shows as FAIL with the first
examples (turn numbers replay with the same seed), and the numbers are recorded as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import hashlib
import logging
import multiprocessing
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import growth  # noqa: E402
from checks import (  # noqa: E402
    ABOVE_AIM,
    Compaction,
    context_split_groups,
    dropped_rows,
    hysteresis,
    split_groups,
    view_problems,
)
from scenario import FACTS, SYSTEM_PROMPT, Fact, Turn, generate  # noqa: E402

from contextsvc.clock import SystemClock  # noqa: E402
from contextsvc.config import CompressionDefaults, FilesSettings, HotPathSettings, ProfileConfig, Settings  # noqa: E402
from contextsvc.core.compression.records import BREADCRUMBS_KEY  # noqa: E402
from contextsvc.core.messages import Flags, Message, Role, ToolCall  # noqa: E402
from contextsvc.core.profile import ProfileOverrides, resolve_profile  # noqa: E402
from contextsvc.core.session import ANONYMOUS  # noqa: E402
from contextsvc.core.tokens import message_size  # noqa: E402
from contextsvc.engine.engine import Engine  # noqa: E402
from contextsvc.engine.validation import IncomingImage, IncomingMessage  # noqa: E402
from contextsvc.engine.views import BuiltView  # noqa: E402
from contextsvc.errors import ContextTooLarge, NothingToCompact  # noqa: E402
from contextsvc.events.memory_bus import MemoryEventBus  # noqa: E402
from contextsvc.ports import StoredEvent  # noqa: E402
from contextsvc.stores.files import FilesStore  # noqa: E402
from contextsvc.summarizers.registry import build_summarizers  # noqa: E402

WINDOW = 8192
PROFILE_ID = "agent-8k"
NOISE = 0.05  # the fake model's prompt count: the view's estimate +- 5%
#: how the fake model counts a prompt: ``estimate`` = the view's estimate +- 5% drawn per call (the
#: brief's model); ``tokenizer`` = a deterministic hidden tokenizer (``hidden_tokenizer``).
MODELS = ("estimate", "tokenizer")
MODEL_LABELS = {"estimate": "model: estimate +-5%", "tokenizer": "model: hidden tokenizer"}
TRUNCATED_SHARE = 0.02  # calls whose count is a silently truncated prompt (40-65% of the estimate)
EXAMPLES = 3  # examples kept per broken rule
GROWTH_FLAT = 0.20  # DESIGN §7: within 20%


DEFAULT_RESERVE = ProfileConfig.model_fields["output_reserve_tokens"].default
#: the files store's memory budget (``files.cache_mb``): above the one session's size. Past ~300
#: turns this session (20-200 KB tool outputs, screenshots) held more than the old default of
#: 40 MB, and the store then let it go after every call (it is the least recently used one once
#: unlocked) and read its rows and re-indexed its whole history on the next: O(history) per call,
#: so the 1,000-turn run took hours. That is the store's memory bound at work, not compression.
CACHE_MB = 1024.0

#: How long a build waits for its own compaction before serving the hard-truncated fallback
#: (``hot_path.build_wait_seconds``, 2 s by default). This bench measures what compaction does, not
#: how long a build may wait: on a loaded machine (a run 4x slower than usual) a few compactions
#: outlasted the default and their builds' fallback views counted as "context rows left out by
#: the repair", so the same code gave other tables. Long enough that a build always waits.
BUILD_WAIT_SECONDS = 600.0


def settings_for(root: Path, reserve: int = DEFAULT_RESERVE, strategies: list[str] | None = None) -> Settings:
    """The 8,192-token profile, every other number at its default except (optionally) the reserve
    and the compaction strategies, the files store's cache (``CACHE_MB``) and the build's wait for
    its compaction (``BUILD_WAIT_SECONDS``)."""
    compression = CompressionDefaults(strategies=strategies) if strategies else CompressionDefaults()
    profile = ProfileConfig(
        model="bench-8k",
        context_window=WINDOW,
        system_prompt=SYSTEM_PROMPT,
        vision=True,
        output_reserve_tokens=reserve,
        compression=compression,
    )
    return Settings(
        store=f"files:{root}",
        profiles={PROFILE_ID: profile},
        default_profile=PROFILE_ID,
        files=FilesSettings(cache_mb=CACHE_MB),
        hot_path=HotPathSettings(build_wait_seconds=BUILD_WAIT_SECONDS),
    )


class WarningCounter(logging.Handler):
    """Counts the engine's warnings by message instead of printing them between progress lines."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[record.getMessage()] += 1


@contextlib.contextmanager
def counting_warnings() -> Iterator[WarningCounter]:
    logger = logging.getLogger("contextsvc")
    handler = WarningCounter()
    old = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.propagate = old


@dataclass
class Stats:
    views: int = 0
    max_fill: float = 0.0
    max_fill_at: str = ""
    max_reported_fill: float = 0.0
    over_threshold: int = 0
    over_budget: int = 0
    too_large: int = 0
    too_large_examples: list[str] = field(default_factory=list)
    recovered_by_forced: int = 0
    failed_calls: int = 0
    failed_examples: list[str] = field(default_factory=list)
    nothing_to_compact: int = 0
    illegal: int = 0
    illegal_examples: list[str] = field(default_factory=list)
    split_in_view: int = 0
    split_examples: list[str] = field(default_factory=list)
    split_in_context: int = 0
    context_split_examples: list[str] = field(default_factory=list)
    repaired_views: int = 0
    repaired_examples: list[str] = field(default_factory=list)
    pinned_views: int = 0
    pinned_missing: int = 0
    pinned_examples: list[str] = field(default_factory=list)
    images_in_views: int = 0
    image_notices: int = 0
    truncated_reports: int = 0
    #: fitted calibration lines seen after each baseline: (overhead, tokens per unit).
    lines: list[tuple[float, float]] = field(default_factory=list)
    unfitted: int = 0
    false_truncations: int = 0
    false_truncation_examples: list[str] = field(default_factory=list)
    missed_truncations: int = 0
    missed_truncation_examples: list[str] = field(default_factory=list)
    build_ms: list[float] = field(default_factory=list)
    build_ms_compressing: list[float] = field(default_factory=list)
    appended: int = 0
    phases: Counter[str] = field(default_factory=Counter)


def _note(examples: list[str], text: str) -> None:
    if len(examples) < EXAMPLES:
        examples.append(text)


def hidden_tokenizer(view: list[Message]) -> int:
    """A deterministic stand-in for a provider's tokenizer: each message's size units at 0.5 tokens
    per unit, off by its own fixed -5..+5% (from a hash of its text), plus its images and framing."""
    total = 3
    for m in view:
        wobble = (zlib.crc32(m.content.encode()) % 1001) / 1000 * 2 * NOISE - NOISE
        total += round(message_size(m) * 0.5 * (1 + wobble)) + sum(i.token_count for i in m.images) + 3
    return total


class Runtime:
    """The scripted agent runtime: the loop of DESIGN §1 against the engine, with every view checked."""

    def __init__(self, engine: Engine, sid: str, seed: int, events: list[StoredEvent], fake: str = "estimate"):
        self.engine = engine
        self.fake = fake
        self.events = events
        self.sid = sid
        self.rng = random.Random(seed ^ 0x5EED)
        self.stats = Stats()
        self.profile = resolve_profile(engine.settings, PROFILE_ID, None)
        self.calls: dict[int, Message] = {}  # seq -> stored assistant message with tool calls
        self.pinned: dict[int, str] = {}  # seq -> content
        self.turn = 0

    async def append(self, rows: list[IncomingMessage], *, turn_complete: bool) -> None:
        out = await self.engine.append(ANONYMOUS, self.sid, rows, request_id="", turn_complete=turn_complete)
        for seq, row in zip(out.sequence_numbers, rows, strict=True):
            if row.message.tool_calls:
                self.calls[seq] = row.message
            if row.message.flags.is_pinned:
                self.pinned[seq] = row.message.content
        self.stats.appended += len(rows)
        if turn_complete:
            await self.engine.post_turn.drain(120)

    async def _build(self, *, mid_turn: bool, incoming: IncomingMessage | None) -> BuiltView:
        t0 = time.perf_counter()
        view = await self.engine.build_context(
            ANONYMOUS, self.sid, profile=ProfileOverrides(), incoming=incoming, mid_turn=mid_turn, auto_compress=True
        )
        ms = (time.perf_counter() - t0) * 1000
        compressed = view.compression is not None and view.compression.compressed
        (self.stats.build_ms_compressing if compressed else self.stats.build_ms).append(ms)
        return view

    async def build(self, *, mid_turn: bool, incoming: IncomingMessage | None = None) -> BuiltView | None:
        """BuildContext; on CONTEXT_TOO_LARGE do what a runtime can (a forced Compress, one retry)."""
        phase = "midturn" if mid_turn else "preturn"
        self.stats.phases[phase] += 1
        epoch = await self._epoch()
        refusals = self.refusals()
        try:
            view = await self._build(mid_turn=mid_turn, incoming=incoming)
        except ContextTooLarge as exc:
            self.stats.too_large += 1
            compacted = await self._what_happened(epoch, refusals)
            _note(
                self.stats.too_large_examples,
                f"turn {self.turn} ({phase}{', incoming' if incoming else ''}): estimate "
                f"{exc.metadata.get('estimate')} > budget {exc.metadata.get('budget')}, {compacted}",
            )
            try:
                await self.engine.compress(
                    ANONYMOUS, self.sid, profile=ProfileOverrides(), note="runtime: context too large", dry_run=False
                )
                view = await self._build(mid_turn=mid_turn, incoming=incoming)
                self.stats.recovered_by_forced += 1
            except NothingToCompact as again:
                self.stats.nothing_to_compact += 1
                self.stats.failed_calls += 1
                _note(self.stats.failed_examples, f"turn {self.turn} ({phase}): forced Compress: {again.message}")
                return None
            except ContextTooLarge as again:
                self.stats.failed_calls += 1
                _note(
                    self.stats.failed_examples,
                    f"turn {self.turn} ({phase}): still {again.metadata.get('estimate')} > "
                    f"{again.metadata.get('budget')} after a forced Compress",
                )
                return None
        await self.check(view)
        return view

    def refusals(self) -> int:
        return sum(1 for e in self.events if e.kind == "compression_refused")

    async def _what_happened(self, epoch: int, refusals: int) -> str:
        """How the failed build ended: compacted, refused by the loop guard, or never tried."""
        for _ in range(2):
            await asyncio.sleep(0)  # let the event watcher take what the build published
        if await self._epoch() != epoch:
            return "after a compaction"
        if self.refusals() != refusals:
            return "compaction refused by the loop guard"
        return "no compaction attempted"

    async def _epoch(self) -> int:
        info = await self.engine.store.get_session(self.sid, caller=ANONYMOUS)
        return int(info.state.get("epoch", 0))

    async def check(self, view: BuiltView) -> None:
        s = self.stats
        s.views += 1
        rows = [vm.message for vm in view.messages]
        fill = view.estimate.total / WINDOW
        if fill > s.max_fill:
            s.max_fill, s.max_fill_at = fill, f"turn {self.turn}"
        if view.estimate.total >= self.profile.compression.threshold * WINDOW:
            s.over_threshold += 1
        if view.estimate.total > WINDOW - self.profile.output_reserve:
            s.over_budget += 1
        problems = view_problems(rows)
        if problems:
            s.illegal += 1
            _note(s.illegal_examples, f"turn {self.turn}: {problems[0]}")
        split = split_groups(rows, self.calls)
        if split:
            s.split_in_view += 1
            _note(s.split_examples, f"turn {self.turn}: {split[0]}")
        context = await self.engine.store.load_context(self.sid, caller=ANONYMOUS)
        broken = context_split_groups(context)
        if broken:
            s.split_in_context += 1
            _note(s.context_split_examples, f"turn {self.turn}: {broken[0]}")
        dropped = dropped_rows(rows, context)
        if dropped:
            s.repaired_views += 1
            _note(s.repaired_examples, f"turn {self.turn}: rows {dropped[:5]} left out of the view")
        if self.pinned:
            s.pinned_views += 1
            shown = [(m.sequence_number, m.content) for m in rows if m.sequence_number in self.pinned]
            if shown != sorted(self.pinned.items()):
                s.pinned_missing += 1
                _note(
                    s.pinned_examples,
                    f"turn {self.turn}: pinned {sorted(self.pinned)} shown as {[q for q, _ in shown]}",
                )
        s.images_in_views += sum(len(m.images) for m in rows)
        s.image_notices += sum(1 for n in view.notices if "image" in n)

    async def model(self, view: BuiltView | None) -> None:
        """The fake LLM call: report a prompt count for the view as RecordBaseline."""
        if view is None:
            return
        est = view.estimate.total
        cut = self.rng.random() < TRUNCATED_SHARE
        if cut:
            tokens = int(est * self.rng.uniform(0.40, 0.65))
            self.stats.truncated_reports += 1
        elif self.fake == "tokenizer":
            tokens = hidden_tokenizer([vm.message for vm in view.messages])
        else:
            tokens = max(1, round(est * (1 + self.rng.uniform(-NOISE, NOISE))))
        self.stats.max_reported_fill = max(self.stats.max_reported_fill, tokens / WINDOW)
        result = await self.engine.record_baseline(ANONYMOUS, self.sid, view_id=view.view_id, prompt_tokens=tokens)
        if cut and not result.truncated:
            self.stats.missed_truncations += 1
            _note(
                self.stats.missed_truncation_examples,
                f"turn {self.turn}: truncated count {tokens} recorded as honest against the view's estimate {est} "
                f"({view.estimate.method.value}, images {view.estimate.images}, floor {result.lower_bound})",
            )
        if result.truncated and not cut:
            self.stats.false_truncations += 1
            _note(
                self.stats.false_truncation_examples,
                f"turn {self.turn}: honest count {tokens} refused as truncated against the view's estimate {est} "
                f"({view.estimate.method.value})",
            )
        cal = result.calibration
        if cal.fitted:
            self.stats.lines.append((cal.overhead, cal.tokens_per_char))
        else:
            self.stats.unfitted += 1
        # The runtime now runs the tools (or shows the answer); the post-turn check runs meanwhile.
        await self.engine.post_turn.drain(120)

    async def play(self, turn: Turn) -> None:
        self.turn = turn.index
        user = IncomingMessage(
            Message(role=Role.USER, content=turn.ask, flags=Flags(is_pinned=turn.pinned)),
            images=tuple(IncomingImage(data=b) for b in turn.ask_images),
        )
        pending: list[IncomingMessage] = []
        if turn.incoming:
            await self.model(await self.build(mid_turn=False, incoming=user))
            pending.append(user)
        else:
            await self.append([user], turn_complete=False)
            await self.model(await self.build(mid_turn=False))
        for step in turn.steps:
            calls = tuple(ToolCall(id=i, name=n, arguments_json=a) for i, n, a in step.calls)
            rows = [*pending, IncomingMessage(Message(role=Role.ASSISTANT, content=step.thought, tool_calls=calls))]
            rows += [
                IncomingMessage(
                    Message(role=Role.TOOL, content=r.content, tool_call_id=i, name=n),
                    images=tuple(IncomingImage(data=b) for b in r.images),
                )
                for (i, n, _), r in zip(step.calls, step.results, strict=True)
            ]
            pending = []
            await self.append(rows, turn_complete=False)
            await self.model(await self.build(mid_turn=True))
        await self.append(
            [*pending, IncomingMessage(Message(role=Role.ASSISTANT, content=turn.answer))], turn_complete=True
        )


@dataclass
class FactResult:
    fact: Fact
    in_view: bool
    in_live_summary: bool
    in_breadcrumbs: bool
    search_token: int  # rank (1-based) of the first chunk holding it, 0 = not found
    search_description: int

    @property
    def recoverable(self) -> bool:
        return self.in_live_summary or self.in_breadcrumbs or self.search_token > 0


async def _rank(engine: Engine, sid: str, query: str, token: str) -> int:
    hits = await engine.search_history(ANONYMOUS, sid, query=query, limit=10)
    for i, hit in enumerate(hits, 1):
        if token in hit.chunk.text or any(token in b for b in hit.chunk.breadcrumbs):
            return i
    return 0


async def facts_check(engine: Engine, sid: str, final_view: BuiltView | None, turns: int) -> list[FactResult]:
    context = await engine.store.load_context(sid, caller=ANONYMOUS)
    info = await engine.store.get_session(sid, caller=ANONYMOUS)
    history = await engine.store.get_messages(sid, caller=ANONYMOUS, first=1, last=info.last_sequence)
    live = [m for m in context if m.flags.is_summary]
    live_text = "\n".join(m.content + "\n" + "\n".join(m.metadata.get(BREADCRUMBS_KEY) or []) for m in live)
    crumbs = "\n".join(
        b
        for m in history
        if m.flags.is_compression or m.flags.is_summary
        for b in m.metadata.get(BREADCRUMBS_KEY) or []
    )
    view_text = "\n".join(vm.message.content for vm in final_view.messages) if final_view else ""
    out = []
    for f in FACTS:
        if f.turn >= turns:
            continue
        out.append(
            FactResult(
                fact=f,
                in_view=f.token in view_text,
                in_live_summary=f.token in live_text,
                in_breadcrumbs=f.token in crumbs,
                search_token=await _rank(engine, sid, f.token, f.token),
                search_description=await _rank(engine, sid, f.query, f.token),
            )
        )
    return out


@dataclass
class SimResult:
    reserve: int
    model: str
    stats: Stats
    events: list[StoredEvent]
    #: the turn the runtime was playing when each context_compressed event arrived, in stream order.
    compaction_turns: list[int]
    facts: list[FactResult]
    warnings: Counter[str]
    display: int
    context_rows: int
    compression_records: int
    #: the breadcrumbs of every summary compaction, in order (from the compression records).
    summary_breadcrumbs: list[tuple[str, ...]]
    seconds: float
    turns: int


async def simulate(turns: int, seed: int, root: Path, reserve: int, fake: str = "estimate") -> SimResult:
    settings = settings_for(root, reserve)
    store = FilesStore(root, settings)
    await store.open()
    bus = MemoryEventBus(retention=1000)
    engine = Engine(
        store=store, bus=bus, settings=settings, clock=SystemClock(), summarizers=build_summarizers(settings)
    )
    session = await engine.sessions.create(ANONYMOUS, profile_id=PROFILE_ID, name="bench", metadata={})
    events: list[StoredEvent] = []
    runtime = Runtime(engine, session.id, seed, events, fake)
    compaction_turns: list[int] = []

    async def watch() -> None:
        async for event in bus.subscribe(caller=ANONYMOUS, session_id=session.id):
            events.append(event)
            if event.kind == "context_compressed":
                compaction_turns.append(runtime.turn)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0)  # let the subscriber register before the first event
    plan = generate(turns, seed)
    t0 = time.perf_counter()
    with counting_warnings() as warned:
        for i, turn in enumerate(plan):
            await runtime.play(turn)
            if (i + 1) % 200 == 0:
                print(f"  turn {i + 1}/{turns}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        seconds = time.perf_counter() - t0
        runtime.turn = turns
        final = await runtime.build(mid_turn=False)
        await engine.post_turn.drain(120)
    facts = await facts_check(engine, session.id, final, turns)
    info = await engine.store.get_session(session.id, caller=ANONYMOUS)
    context = await engine.store.load_context(session.id, caller=ANONYMOUS)
    history = await engine.store.get_messages(session.id, caller=ANONYMOUS, first=1, last=info.last_sequence)
    records = sum(1 for m in history if m.flags.is_compression)
    crumbs = [
        tuple(m.metadata.get(BREADCRUMBS_KEY) or ())
        for m in history
        if m.flags.is_compression and m.metadata.get("method") == "summary"
    ]
    for _ in range(3):
        await asyncio.sleep(0)  # let the watcher take the last events
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    await engine.close()
    await store.close()
    return SimResult(
        reserve=reserve,
        model=fake,
        stats=runtime.stats,
        events=events,
        compaction_turns=compaction_turns,
        facts=facts,
        warnings=warned.counts,
        display=info.display_message_count,
        context_rows=len(context),
        compression_records=records,
        summary_breadcrumbs=crumbs,
        seconds=seconds,
        turns=turns,
    )


async def measure_growth(root: Path, rounds: int, seed: int) -> list[growth.GrowthRow]:
    # Summaries only: the cheap stage would leave a placeholder per cleared result, and the
    # contexts to compare must have the same shape whatever the history length.
    settings = settings_for(root, strategies=["summarize"])
    store = FilesStore(root, settings)
    await store.open()
    engine = Engine(
        store=store,
        bus=MemoryEventBus(retention=100),
        settings=settings,
        clock=SystemClock(),
        summarizers=build_summarizers(settings),
    )
    try:
        return await growth.measure(engine, rounds=rounds, seed=seed)
    finally:
        await engine.close()
        await store.close()


# --- tables -------------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def _md(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


@dataclass
class Analysis:
    """What one simulated session showed: table cells (value, verdict) by measure, and findings."""

    label: str
    sim: SimResult
    cells: dict[str, tuple[str, str]]
    compactions: str
    findings: list[str]


def analyse(sim: SimResult) -> Analysis:
    s = sim.stats
    profile = resolve_profile(settings_for(Path("unused"), sim.reserve), PROFILE_ID, None)
    c = profile.compression
    band = int((c.threshold - c.target) * WINDOW)
    budget = WINDOW - profile.output_reserve
    hard_target = settings_for(Path("unused")).summarizer.hard_truncate_fraction
    kinds = Counter(e.kind for e in sim.events)
    compactions: list[Compaction] = []
    truncated = False
    turns = iter(sim.compaction_turns)
    for e in sim.events:
        if e.kind == "context_truncated":
            truncated = True
        elif e.kind == "context_compressed":
            compactions.append(
                Compaction(
                    reason=str(e.payload["reason"]),
                    method=str(e.payload["method"]),
                    # the estimate the trigger compared (older engines: context_tokens_before)
                    before=int(e.payload.get("estimate_tokens", e.payload["context_tokens_before"])),
                    after=int(e.payload["context_tokens_after"]),
                    # Only a post-turn check compresses for the truncation flag; builds compress for size.
                    after_truncation=truncated and e.payload["reason"] == "postturn",
                    turn=next(turns, -1),
                    margin=int(e.payload.get("margin", 0)),
                    aim=int(e.payload.get("aim_tokens", 0)),
                    rate=float(e.payload.get("margin_rate", 0.0)),
                    priced=int(e.payload["context_tokens_before"]),
                )
            )
            truncated = False
    # The budget is the trigger when the reply reserve puts it under the threshold (8,192 / 2,048).
    budget_trigger = budget if budget < c.threshold * WINDOW else None
    band_check = hysteresis(compactions, band, budget_trigger)
    automatic = [k for k in compactions if k.reason != "forced"]
    above_target = [
        k
        for k in compactions
        if k.reason != "forced" and k.after > (hard_target if k.method == "hard_truncate" else c.target) * WINDOW
    ]
    refused = kinds["compression_refused"]
    recoverable = sum(1 for f in sim.facts if f.recoverable)
    display_ok = sim.display == s.appended + sim.compression_records
    cells = {
        "max view fill (estimate / window)": (
            f"{s.max_fill:.3f} ({s.max_fill_at}; limit {budget / WINDOW:.3f})",
            _verdict(s.max_fill <= budget / WINDOW),
        ),
        "views over window - reserve": (f"{s.over_budget} of {s.views:,}", _verdict(s.over_budget == 0)),
        "BuildContext refused CONTEXT_TOO_LARGE": (
            f"{s.too_large:,} (a forced Compress recovered {s.recovered_by_forced:,}; {s.failed_calls} calls lost)",
            _verdict(s.too_large == 0),
        ),
        "views at or over the threshold (0.90 x window)": (f"{s.over_threshold}", ""),
        "max reported prompt tokens / window": (f"{s.max_reported_fill:.3f}", ""),
        "compactions: automatic / forced by the runtime": (
            f"{len(automatic):,} / {len(compactions) - len(automatic):,}",
            "",
        ),
        f"hysteresis band violations (band {band:,} tokens)": (
            f"{len(band_check.violations)} of {band_check.pairs} pairs",
            _verdict(not band_check.violations),
        ),
        "... and, counted apart, post-turn ones right after a truncated prompt": (
            f"{len(band_check.after_truncation)} (min growth of all pairs: {band_check.min_growth})",
            _verdict(not band_check.after_truncation),
        ),
        "... and, counted apart, budget crossings the design exempts (reason)": (
            _exempt_cell(band_check.budget_exempt),
            "",
        ),
        "automatic compactions ending above their target": (
            f"{len(above_target)} of {len(automatic)}",
            _verdict(not above_target),
        ),
        "loop-guard refusals (compression_refused)": (f"{refused:,}", ""),
        "illegal views (independent check)": (f"{s.illegal} of {s.views:,}", _verdict(s.illegal == 0)),
        "tool groups split in a view": (f"{s.split_in_view}", _verdict(s.split_in_view == 0)),
        "tool groups split in the context buffer": (
            f"{s.split_in_context} views",
            _verdict(s.split_in_context == 0),
        ),
        "views where the repair left context rows out": (f"{s.repaired_views}", _verdict(s.repaired_views == 0)),
        "pinned messages verbatim, in order, in every view": (
            f"{s.pinned_views - s.pinned_missing:,} of {s.pinned_views:,}",
            _verdict(s.pinned_missing == 0),
        ),
        "planted facts recoverable (breadcrumbs or SearchHistory)": (
            f"{recoverable} of {len(sim.facts)}",
            _verdict(recoverable == len(sim.facts)),
        ),
        "display history = appended + compression records": (
            f"{sim.display:,} = {s.appended:,} + {sim.compression_records:,}"
            if display_ok
            else f"{sim.display:,} != {s.appended:,} + {sim.compression_records:,}",
            _verdict(display_ok),
        ),
        "truncated counts sent / context_truncated events": (
            f"{s.truncated_reports} / {kinds['context_truncated']}",
            _verdict(s.truncated_reports == kinds["context_truncated"]),
        ),
        "calibration after a baseline: overhead min..max / slope min..max / unfitted": (
            (
                f"{min(o for o, _ in s.lines):,.0f}..{max(o for o, _ in s.lines):,.0f} tokens / "
                f"{min(k for _, k in s.lines):.2f}..{max(k for _, k in s.lines):.2f} per unit / "
                f"{s.unfitted} of {s.unfitted + len(s.lines):,}"
            )
            if s.lines
            else f"never fitted ({s.unfitted})",
            "",
        ),
        "summary breadcrumbs: summaries / distinct lists / newest = first / odd entries in newest": (
            _crumb_cell(sim.summary_breadcrumbs),
            "",
        ),
        "images in views / image notices": (f"{s.images_in_views:,} / {s.image_notices:,}", ""),
        "memory_flush_due events": (f"{kinds['memory_flush_due']:,}", ""),
        "engine warnings": (
            "; ".join(f"{n} x {msg}" for msg, n in sim.warnings.most_common()) or "none",
            "",
        ),
        "BuildContext ms p50 / p90, no compaction": (
            f"{_pct(s.build_ms, 0.5):.1f} / {_pct(s.build_ms, 0.9):.1f}",
            "",
        ),
        "BuildContext ms p50 / p90, compacting": (
            f"{_pct(s.build_ms_compressing, 0.5):.1f} / {_pct(s.build_ms_compressing, 0.9):.1f}",
            "",
        ),
    }

    by = Counter((k.reason, k.method) for k in compactions)
    methods = sorted({m for _, m in by})
    reasons = [r for r in ("preturn", "midturn", "postturn", "forced") if any(rr == r for rr, _ in by)]
    rows = [[r, *[str(by[(r, m)]) for m in methods], str(sum(by[(r, m)] for m in methods))] for r in reasons]
    rows.append(["all", *[str(sum(by[(r, m)] for r in reasons)) for m in methods], str(len(compactions))])
    table = _md(["reason \\ method", *methods, "all"], rows)
    after = [k.after / WINDOW for k in compactions]
    if after:
        table += (
            f"\n\nContext left by a compaction, share of the window: median {statistics.median(after):.3f}, "
            f"max {max(after):.3f}. compression_started {kinds['compression_started']:,}, context_compressed "
            f"{len(compactions):,}, compression_refused {refused:,}."
        )
        rates = [k.rate for k in compactions if k.reason != "forced"]
        aims = [k.aim / WINDOW for k in compactions if k.reason != "forced" and k.aim > 0]
        if rates and aims:
            table += (
                f" Margin rate the automatic ones aimed with (margin per token of the context priced whole): "
                f"median {statistics.median(rates):.3f}, p90 {_pct(rates, 0.9):.3f}; their aim, share of the "
                f"window: median {statistics.median(aims):.3f}."
            )

    label = MODEL_LABELS[sim.model] + ("" if sim.reserve == DEFAULT_RESERVE else f", reserve {sim.reserve:,}")
    findings: list[str] = []
    if s.too_large:
        findings.append(
            f"{label}: BuildContext refused {s.too_large:,} views with CONTEXT_TOO_LARGE; first: "
            + "; ".join(s.too_large_examples)
        )
    if s.failed_calls:
        findings.append(f"{label}: {s.failed_calls} model calls lost; first: " + "; ".join(s.failed_examples))
    for what, examples, count in (
        ("illegal views", s.illegal_examples, s.illegal),
        ("tool groups split in views", s.split_examples, s.split_in_view),
        ("tool groups split in the context buffer", s.context_split_examples, s.split_in_context),
        ("context rows left out by the repair", s.repaired_examples, s.repaired_views),
        ("pinned messages missing", s.pinned_examples, s.pinned_missing),
        ("honest prompt counts refused as truncated", s.false_truncation_examples, s.false_truncations),
        ("truncated prompt counts recorded as honest", s.missed_truncation_examples, s.missed_truncations),
    ):
        if count:
            findings.append(f"{label}: {what}: {count}; first: " + "; ".join(examples))
    if band_check.violations:
        findings.append(
            f"{label}: hysteresis band violated {len(band_check.violations)} times; first: "
            + "; ".join(band_check.violations[:EXAMPLES])
        )
    if band_check.after_truncation:
        findings.append(
            f"{label}: {len(band_check.after_truncation)} post-turn compactions inside the hysteresis band right "
            "after a truncated prompt (DESIGN §5.3 compresses regardless of the threshold, §5.4 exempts only "
            "forced runs from the band); first: " + "; ".join(band_check.after_truncation[:EXAMPLES])
        )
    if band_check.budget_exempt:
        findings.append(
            f"{label}: {len(band_check.budget_exempt)} compactions inside the hysteresis band at the budget, "
            "exempt by design (not failures; see the rule in docs/calibration.md); first: "
            + "; ".join(band_check.budget_exempt[:EXAMPLES])
        )
    if above_target:
        findings.append(
            f"{label}: {len(above_target)} automatic compactions ended above their target; first: "
            + "; ".join(
                f"turn {k.turn} {k.reason}/{k.method} {k.priced or k.before} -> {k.after}"
                for k in above_target[:EXAMPLES]
            )
        )
    lost = [f.fact.key for f in sim.facts if not f.recoverable]
    if lost:
        findings.append(f"{label}: facts not recoverable: {', '.join(lost)}")
    return Analysis(label, sim, cells, table, findings)


def _exempt_cell(exempt: list[str]) -> str:
    """How many budget crossings inside the band the design exempts, by reason."""
    if not exempt:
        return "0"
    above = sum(1 for e in exempt if ABOVE_AIM in e)
    wider = len(exempt) - above
    return f"{len(exempt)} ({above} after a compaction above its aim; {wider} margin wider than aimed for)"


_ODD_CRUMB = re.compile(r"^[^\w/~.\"'`(\[<$@#-]|^[\d.,:\s]+$")


def _crumb_cell(lists: list[tuple[str, ...]]) -> str:
    """How the breadcrumb trail evolved: does it take in new entities, and how clean is it."""
    if not lists:
        return "no summaries"
    newest = lists[-1]
    odd = [b for b in newest if _ODD_CRUMB.search(b)]
    example = f" (e.g. `{odd[0]}`)" if odd else ""
    return (
        f"{len(lists)} / {len(set(lists))} / {'yes' if newest == lists[0] else 'no'} / "
        f"{len(odd)} of {len(newest)}{example}"
    )


def summary_table(analyses: list[Analysis]) -> str:
    return _md(
        [
            "variant",
            "turns",
            "model calls (views)",
            "pre-turn / mid-turn builds",
            "messages appended",
            "display history",
            "context rows at end",
            "compactions",
            "simulation time",
        ],
        [
            [
                a.label,
                f"{a.sim.turns:,}",
                f"{a.sim.stats.views:,}",
                f"{a.sim.stats.phases['preturn']:,} / {a.sim.stats.phases['midturn']:,}",
                f"{a.sim.stats.appended:,}",
                f"{a.sim.display:,}",
                f"{a.sim.context_rows:,}",
                f"{a.sim.compression_records:,}",
                f"{a.sim.seconds:.0f} s",
            ]
            for a in analyses
        ],
    )


def rules_table(analyses: list[Analysis]) -> str:
    header = ["measure"]
    for a in analyses:
        header += [a.label, "verdict"]
    rows = []
    for measure in analyses[0].cells:
        row = [measure]
        for a in analyses:
            row += list(a.cells[measure])
        rows.append(row)
    return _md(header, rows)


def facts_table(analyses: list[Analysis]) -> str:
    first = analyses[0]

    def rank(r: int) -> str:
        return f"#{r}" if r else "no"

    rows = []
    for i, f in enumerate(first.sim.facts):
        row = [
            f.fact.key,
            f"`{f.fact.token}`",
            str(f.fact.turn),
            f.fact.where,
            "yes" if f.in_view else "no",
            "yes" if f.in_live_summary else "no",
            "yes" if f.in_breadcrumbs else "no",
            rank(f.search_token),
            rank(f.search_description),
            _verdict(f.recoverable),
        ]
        row += [_verdict(a.sim.facts[i].recoverable) for a in analyses[1:]]
        rows.append(row)
    header = [
        "fact",
        "token",
        "turn",
        "planted in",
        "in final view",
        "in live summary",
        "in any breadcrumbs",
        "search: token",
        "search: description",
        f"recoverable ({first.label})",
    ]
    header += [f"recoverable ({a.label})" for a in analyses[1:]]
    return _md(header, rows)


def growth_table(rows: list[growth.GrowthRow]) -> tuple[str, list[str]]:
    compressed = [g for g in rows if g.compactions]
    fresh = next((g for g in rows if not g.compactions), None)
    base = compressed[0].median_ms
    table = _md(
        [
            "session",
            "display messages",
            "compactions",
            "context rows",
            "view tokens",
            "BuildContext p50 ms",
            "p90 ms",
            "ratio to ~100",
        ],
        [
            [
                g.label,
                f"{g.display:,}",
                str(g.compactions),
                str(g.context_rows),
                f"{g.context_tokens:,}",
                f"{g.median_ms:.2f}",
                f"{g.p90_ms:.2f}",
                f"{g.median_ms / base:.2f}",
            ]
            for g in rows
        ],
    )
    worst = max(g.median_ms / base for g in compressed)
    flat = worst <= 1 + GROWTH_FLAT
    table += f"\n\nFlat within {GROWTH_FLAT:.0%} of ~100 display messages: {_verdict(flat)} (worst ratio {worst:.2f})"
    if fresh is not None:
        largest = compressed[-1]
        table += (
            f"; {largest.label} against the fresh session of the same context size: "
            f"{largest.median_ms / fresh.median_ms:.2f}"
        )
    table += "."
    findings = [] if flat else [f"BuildContext cost grows with the display history: worst ratio {worst:.2f}"]
    return table, findings


def render(analyses: list[Analysis], growth_rows: list[growth.GrowthRow]) -> str:
    parts = ["Sessions:", "", summary_table(analyses), "", "Rules (DESIGN §5.2, §5.4, §7):", "", rules_table(analyses)]
    for a in analyses:
        parts += ["", f"Compactions by reason and method, {a.label} (event stream):", "", a.compactions]
    parts += [
        "",
        "Planted facts after the whole session (search: rank of the first SearchHistory chunk holding the token, "
        "top 10; `description` asks in words, without the token):",
        "",
        facts_table(analyses),
    ]
    findings = [f for a in analyses for f in a.findings]
    if growth_rows:
        table, more = growth_table(growth_rows)
        findings += more
        parts += [
            "",
            "BuildContext against display-history length (medians of interleaved calls, same run):",
            "",
            table,
        ]
    parts += ["", "Findings (rules broken in this run):", ""]
    parts += [f"- {f}" for f in findings] or ["- none"]
    return "\n".join(parts) + "\n"


def _models(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in MODELS]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"models are {', '.join(MODELS)}; got {text!r}")
    return values


def command(args: argparse.Namespace) -> str:
    cmd = "python bench/compression/run.py --record"
    if args.turns != 1000:
        cmd += f" --turns {args.turns}"
    if args.seed != 1:
        cmd += f" --seed {args.seed}"
    if args.rounds != 60:
        cmd += f" --rounds {args.rounds}"
    if args.models != list(MODELS):
        cmd += " --models " + ",".join(args.models)
    if args.reserve != DEFAULT_RESERVE:
        cmd += f" --reserve {args.reserve}"
    return cmd


def engine_revision() -> str:
    """The code measured: the commit, the uncommitted engine files, and a digest of contextsvc/
    (several people change it at once, so a commit alone does not name what ran)."""
    root = HERE.parents[1]
    digest = hashlib.sha256()
    for path in sorted((root / "contextsvc").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())

    def git(*argv: str) -> str:
        try:
            out = subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True, check=False, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.rstrip()

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "contextsvc").splitlines()]
    changes = f" + uncommitted changes to {', '.join(f'`{d}`' for d in dirty)}" if dirty else ""
    return f"commit {commit}{changes}; sha256 of contextsvc/*.py {digest.hexdigest()[:12]}"


def record(text: str, args: argparse.Namespace) -> None:
    path = HERE.parent / "RESULTS.md"
    section = "\n".join(
        [
            "## Compression",
            "",
            f"- date: {dt.date.today().isoformat()}; machine: {os.cpu_count()} cores (nproc), "
            f"Python {platform.python_version()}, {platform.system()} {platform.machine()}",
            f"- command: `{command(args)}`",
            f"- engine measured: {engine_revision()}",
            f"- engine in process: files store (temp dir), in-memory event bus, extractive summarizer; profile: "
            f"{WINDOW:,}-token window, vision, every other number at its default (threshold 0.90, target 0.65, "
            f"keep_recent 4, strategies clear_tool_results then summarize, output reserve {args.reserve:,}); the "
            f"files store's cache at {CACHE_MB:,.0f} MB (default 40: past ~300 turns the session alone is larger, "
            "and the store re-reads and re-indexes it on every call).",
            f"- session: seed {args.seed}; per turn a user ask (5% with 1-2 PNGs of 64x64 to 3000x2000), 0-20 tool "
            "steps of 1-3 calls (results 72% 0.2-2 KB, 20% 2-20 KB, 8% 20-200 KB; 2% screenshots), an answer; two "
            "pinned instructions (turns 0 and 3); 12 facts planted in turns 1-27; 25% of asks passed as "
            "`incoming`. The session is played once per fake model: `estimate` reports the view's estimate "
            f"+-{NOISE:.0%} per call; `hidden tokenizer` a deterministic count (size units x 0.5, each message off by "
            f"its own fixed +-{NOISE:.0%}, plus images and framing); both send a silently truncated count "
            f"(40-65% of the estimate) on {TRUNCATED_SHARE:.0%} of calls. On CONTEXT_TOO_LARGE the runtime calls "
            "Compress (forced) and retries once.",
            "- verdicts: `FAIL` marks a rule of DESIGN §5.2/§5.4/§7 broken in this run (the findings below say where); "
            "`hysteresis band violations` counts pairs of automatic compactions with less than "
            "(threshold - target) x window of growth between them (growth = the view estimate that triggered the "
            "second minus the context the first left, both from the events); the next row counts, apart, those whose "
            "second compaction was a post-turn check right after a `context_truncated` event; the one after that, "
            "apart and not a failure, crossings of the budget (estimate + margin) inside the band that the design "
            "exempts (docs/calibration.md): the compaction before ended above its aim, or the view's margin is a "
            "larger share of it than the rate that compaction aimed for, each judged on the events' own numbers.",
            "",
            text.rstrip("\n"),
            "",
        ]
    )
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n\n"
    pattern = re.compile(r"## Compression\n.*?(?=\n## |\Z)", re.S)
    new = (
        pattern.sub(lambda _: section.rstrip("\n") + "\n", old)
        if pattern.search(old)
        else old.rstrip("\n") + "\n\n" + section
    )
    path.write_text(new, encoding="utf-8")
    print(f"\nrecorded in {path}")


def simulate_in_process(turns: int, seed: int, root: Path, reserve: int, model: str) -> SimResult:
    """One simulated session in its own event loop (a worker process runs it)."""
    print(f"simulating {turns} turns (seed {seed}, {MODEL_LABELS[model]}) ...", file=sys.stderr)
    return asyncio.run(simulate(turns, seed, root, reserve, model))


def run_all(args: argparse.Namespace) -> str:
    """The sessions side by side, one process each (they share nothing), then the growth timing
    alone, so no simulation competes with the timed calls."""
    with tempfile.TemporaryDirectory(prefix="bench-compression-") as tmp:
        jobs = max(1, min(args.jobs, len(args.models)))
        # fork: the workers start from this process as it is (no event loop running yet).
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = [
                pool.submit(simulate_in_process, args.turns, args.seed, Path(tmp) / model, args.reserve, model)
                for model in args.models
            ]
            analyses = [analyse(f.result()) for f in futures]
        growth_rows: list[growth.GrowthRow] = []
        if args.rounds:
            print("timing BuildContext against display-history length ...", file=sys.stderr)
            with counting_warnings():
                growth_rows = asyncio.run(measure_growth(Path(tmp) / "growth", args.rounds, args.seed))
    return render(analyses, growth_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=1000, help="turns in the simulated session (default 1000)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the generated session (default 1)")
    parser.add_argument(
        "--models",
        type=_models,
        default=list(MODELS),
        help="fake models to replay the session with, comma-separated (default estimate,tokenizer)",
    )
    parser.add_argument(
        "--reserve",
        type=int,
        default=DEFAULT_RESERVE,
        help=f"the profile's output reserve (default {DEFAULT_RESERVE}, the service default)",
    )
    parser.add_argument("--rounds", type=int, default=60, help="timed BuildContext calls per growth session (0 = skip)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="sessions simulated at once, one process each (default: the number of cores)",
    )
    parser.add_argument("--record", action="store_true", help="write the tables into bench/RESULTS.md")
    args = parser.parse_args()
    if not 1 <= args.turns <= 20_000:
        parser.error("--turns must be in [1, 20000]")
    if args.reserve < 0:
        parser.error("--reserve must not be negative")
    if not 0 <= args.rounds <= 1000:
        parser.error("--rounds must be in [0, 1000]")
    text = run_all(args)
    print(text)
    if args.record:
        record(text, args)


if __name__ == "__main__":
    main()
