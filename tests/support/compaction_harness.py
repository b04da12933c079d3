"""An in-process engine for compaction tests: the real ``Engine`` over ``MemoryStore`` + ``MemoryEventBus``.

* ``Rig`` builds the engine with a small window and any extra summarizers (registered through a
  real ``SummarizerSet``), and wraps the calls a runtime makes (append, build, compress, baseline).
* ``ScriptedSummarizer`` is a real ``Summarizer``: it answers each call from a script (a normal
  summary, an error, an empty text, a summary larger than its input) and records every request.
* ``AgentLoop`` simulates an agent runtime: turns of a user ask and tool rounds with big outputs,
  BuildContext before every LLM call (pre-turn, then mid-turn), RecordBaseline with a "real"
  count from a fixed tokenizer line, turn_complete and the post-turn check. Every message carries
  a unique token, so a test can find any demoted row in the raw history index.
* Invariant checks shared by the tests: legal views, the display history unchanged, every demoted
  original indexed, ExpandSummary exact.
"""

from __future__ import annotations

import asyncio
import io
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from contextsvc.config import ProfileConfig, Settings
from contextsvc.core.codec import message_to_dict
from contextsvc.core.compression.cheap import is_placeholder
from contextsvc.core.compression.records import DEMOTED_RANGES_KEY
from contextsvc.core.legal import is_legal
from contextsvc.core.messages import Flags, Message, Role, ToolCall
from contextsvc.core.profile import CompressionOverrides, ProfileOverrides
from contextsvc.core.session import ANONYMOUS
from contextsvc.core.tokens import messages_chars
from contextsvc.engine.engine import Engine
from contextsvc.engine.validation import IncomingImage, IncomingMessage
from contextsvc.engine.views import BuiltView
from contextsvc.events.memory_bus import MemoryEventBus
from contextsvc.ports import (
    SessionStore,
    StoredEvent,
    Summarizer,
    SummarizerError,
    SummarizerUnavailable,
    SummaryRequest,
)
from contextsvc.stores.memory import MemoryStore
from contextsvc.summarizers.extractive import ExtractiveSummarizer
from contextsvc.summarizers.registry import SummarizerSet
from tests.support.stores import Backing, TickingClock

WINDOW = 8192


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A small PNG of the given size (distinct bytes per seed, so each is its own blob)."""
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (seed % 256, (seed // 256) % 256, 90)).save(buf, format="PNG")
    return buf.getvalue()


# --- messages --------------------------------------------------------------------------------


def u(content: str, *, pinned: bool = False, **kw: Any) -> IncomingMessage:
    return IncomingMessage(Message(role=Role.USER, content=content, flags=Flags(is_pinned=pinned), **kw))


def a(content: str = "", *calls: tuple[str, str]) -> IncomingMessage:
    tool_calls = tuple(ToolCall(id=cid, name=name, arguments_json='{"path": "src/app.py"}') for cid, name in calls)
    return IncomingMessage(Message(role=Role.ASSISTANT, content=content, tool_calls=tool_calls))


def t(call_id: str, content: str, **kw: Any) -> IncomingMessage:
    return IncomingMessage(Message(role=Role.TOOL, content=content, tool_call_id=call_id, **kw))


_WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "handler",
    "module",
    "request",
    "response",
    "config",
    "deploy",
    "build",
    "cache",
    "index",
    "query",
    "token",
    "window",
    "value",
    "result",
    "error",
    "retry",
    "commit",
    "branch",
    "release",
    "service",
    "client",
    "server",
    "table",
]


def words(n: int, rng: random.Random | None = None) -> str:
    """``n`` filler words (deterministic for a given ``rng``)."""
    r = rng or random.Random(n)
    return " ".join(r.choice(_WORDS) for _ in range(n))


# --- a summarizer with a script ----------------------------------------------------------------

#: ``ok`` a short summary, ``raise`` SummarizerError, ``unavailable`` SummarizerUnavailable (no
#: answer at all), ``empty`` a KEYS line and nothing else,
#: ``huge`` a summary larger than its whole input; or a function of the request.
Reply = str | Callable[[SummaryRequest], str]


class ScriptedSummarizer:
    """A real ``Summarizer``: answers from ``script`` (then ``default``) and records every request."""

    vision = False

    def __init__(
        self, name: str = "scripted", *, script: Sequence[Reply] = (), default: Reply = "ok", delay: float = 0.0
    ) -> None:
        self.name = name
        self.delay = delay
        self.script = list(script)
        self.default = default
        self.calls: list[SummaryRequest] = []
        self.closed = False

    async def summarize(self, request: SummaryRequest) -> str:
        self.calls.append(request)
        reply = self.script.pop(0) if self.script else self.default
        if self.delay:
            await asyncio.sleep(self.delay)  # lets concurrent requests interleave with a compaction
        if callable(reply):
            return reply(request)
        if reply == "raise":
            raise SummarizerError("scripted failure")
        if reply == "unavailable":
            raise SummarizerUnavailable("scripted: no answer within the whole call's bound")
        if reply == "empty":
            return "KEYS: nothing-else"
        if reply == "huge":
            # Larger than everything it replaces, however the view prices or cuts it.
            return "\n".join(f"- padding line {k} " + words(30) for k in range(len(request.text) // 40 + 400))
        if reply == "ok":
            n = len(self.calls)
            return f"- summarized {len(request.messages)} messages (call {n})\nKEYS: scripted-{n}"
        raise AssertionError(f"unknown scripted reply {reply!r}")

    async def close(self) -> None:
        self.closed = True


# --- the rig -----------------------------------------------------------------------------------


def make_settings(
    *, window: int = WINDOW, reserve: int = 512, system_prompt: str = "", vision: bool = False, **settings: Any
) -> Settings:
    profile = ProfileConfig(
        model="m", context_window=window, output_reserve_tokens=reserve, system_prompt=system_prompt, vision=vision
    )
    return Settings(profiles={"default": profile}, store="memory", event_retention=100_000, **settings)


def overrides(**compression: Any) -> ProfileOverrides:
    """Inline profile overrides: compression fields only (``strategies`` as a list is fine)."""
    if "strategies" in compression:
        compression["strategies"] = tuple(compression["strategies"])
    return ProfileOverrides(compression=CompressionOverrides(**compression))


class ContextReadingStore(MemoryStore):
    """A memory store counting its context reads (``context_reads``): how tests see that a path
    priced a view, or did not, without timing it; and its reads of a session alone
    (``session_reads``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.context_reads = 0
        self.session_reads = 0

    async def get_session(self, session_id: str, *, caller: Any) -> Any:
        self.session_reads += 1
        return await super().get_session(session_id, caller=caller)

    async def load_context(self, session_id: str, *, caller: Any) -> Any:
        self.context_reads += 1
        return await super().load_context(session_id, caller=caller)

    async def context_and_session(self, session_id: str, *, caller: Any) -> Any:
        self.context_reads += 1
        return await super().context_and_session(session_id, caller=caller)


class Rig:
    """The engine, its store and bus, and the calls a runtime makes."""

    def __init__(
        self,
        settings: Settings,
        *extra: Summarizer,
        store: type[MemoryStore] = MemoryStore,
        opened: SessionStore | None = None,
    ) -> None:
        self.settings = settings
        # ``opened``: an already opened store of any kind (files, PostgreSQL) instead of ``store``.
        self.store: Any = opened if opened is not None else store(settings)
        self.bus = MemoryEventBus(retention=settings.event_retention)
        summarizers: dict[str, Summarizer] = {"extractive": ExtractiveSummarizer.from_settings(settings)}
        summarizers.update({s.name: s for s in extra})
        self.engine = Engine(
            store=self.store,
            bus=self.bus,
            settings=settings,
            clock=TickingClock(),
            summarizers=SummarizerSet(summarizers),
        )

    @classmethod
    async def start(cls, *extra: Summarizer, store: type[MemoryStore] = MemoryStore, **settings: Any) -> Rig:
        rig = cls(make_settings(**settings), *extra, store=store)
        await rig.store.open()
        return rig

    @classmethod
    async def over(cls, backing: Backing, *extra: Summarizer, **settings: Any) -> Rig:
        """A rig over a conformance backing (tests/support/stores.py): memory, files or PostgreSQL."""
        made = make_settings(**settings)
        return cls(made, *extra, opened=await backing.open(clock=TickingClock(), settings=made))

    async def close(self) -> None:
        await self.engine.close()
        await self.store.close()

    @property
    def window(self) -> int:
        return self.settings.profiles["default"].context_window

    @property
    def reserve(self) -> int:
        """The reply reserve the size guard takes off the window (capped at window / 4)."""
        profile = self.settings.profiles["default"]
        return min(profile.output_reserve_tokens or 0, profile.context_window // 4)

    def sized(self, tokens: int, *, prefix: str = "", role: Role = Role.TOOL) -> str:
        """Text that, as one ``role`` message, costs about ``tokens`` (fallback pricing, model ``m``)."""

        def cost(n: int) -> int:
            content = f"{prefix} {words(n)}".strip()
            return self.engine.accounting.message_tokens("m", Message(role=role, content=content))

        lo, hi = 0, max(8, tokens * 2)
        while lo < hi:
            mid = (lo + hi) // 2
            if cost(mid) < tokens:
                lo = mid + 1
            else:
                hi = mid
        return f"{prefix} {words(lo)}".strip()

    async def session(self) -> str:
        s = await self.engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})
        return s.id

    async def session_of_turns(self, turns: int, *, answer_words: int = 80) -> str:
        """A new session of ``turns`` question/answer pairs (each question names its own file)."""
        sid = await self.session()
        for k in range(turns):
            await self.append(sid, u(f"ask {k} about module_{k}.py"), a(f"answer {k} " + words(answer_words)))
        return sid

    async def append(self, sid: str, *messages: IncomingMessage, turn_complete: bool = False) -> list[int]:
        out = await self.engine.append(ANONYMOUS, sid, list(messages), request_id="", turn_complete=turn_complete)
        return out.sequence_numbers

    async def build(
        self,
        sid: str,
        *,
        incoming: IncomingMessage | None = None,
        mid_turn: bool = False,
        auto: bool = True,
        profile: ProfileOverrides | None = None,
    ) -> BuiltView:
        return await self.engine.build_context(
            ANONYMOUS,
            sid,
            profile=profile or ProfileOverrides(),
            incoming=incoming,
            mid_turn=mid_turn,
            auto_compress=auto,
        )

    async def compress(self, sid: str, *, profile: ProfileOverrides | None = None, dry_run: bool = False) -> Any:
        return await self.engine.compress(
            ANONYMOUS, sid, profile=profile or ProfileOverrides(), note="test", dry_run=dry_run
        )

    def compaction_of(self, sid: str) -> tuple[list[Any], Callable[[], Awaitable[None]]]:
        """A compaction of ``sid`` for a store hook to run mid-call, and the list its result lands in."""
        done: list[Any] = []

        async def compact() -> None:
            done.append(await self.compress(sid))

        return done, compact

    async def estimate(self, sid: str, profile: ProfileOverrides | None = None) -> int:
        est = await self.engine.estimate_tokens(
            ANONYMOUS, model="", messages=(), session_id=sid, profile=profile or ProfileOverrides()
        )
        return est.total

    async def baseline(self, sid: str, view: BuiltView, *, slope: float = 0.6, overhead: int = 12) -> Any:
        """RecordBaseline with the count a fixed tokenizer line gives the view's own size."""
        real = real_tokens(view, slope=slope, overhead=overhead)
        return await self.engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=real)

    def events(self, sid: str, *kinds: str) -> list[StoredEvent]:
        return [e for e in self.bus._log if e.session_id == sid and (not kinds or e.kind in kinds)]

    async def session_info(self, sid: str) -> Any:
        return await self.store.get_session(sid, caller=ANONYMOUS)

    async def context(self, sid: str) -> list[Message]:
        return await self.store.load_context(sid, caller=ANONYMOUS)

    async def rows(self, sid: str) -> list[Message]:
        """Every stored row, both buffers, by sequence."""
        info = await self.session_info(sid)
        return await self.store.get_messages(sid, caller=ANONYMOUS, first=1, last=max(info.last_sequence, 1))


def real_tokens(view: BuiltView, *, slope: float = 0.6, overhead: int = 12) -> int:
    """The provider's count: a fixed line over the text's size, plus the images the view carried."""
    return overhead + round(slope * messages_chars([vm.message for vm in view.messages])) + view.estimate.images


def view_rows(view: BuiltView) -> list[Message]:
    return [vm.message for vm in view.messages]


def display_dict(m: Message) -> dict[str, Any]:
    """The codec form of a display row without the one flag compression may change."""
    d = message_to_dict(m)
    flags = dict(d.pop("flags", {}))
    flags.pop("is_context", None)
    if flags:
        d["flags"] = flags
    return d


# --- invariant checks --------------------------------------------------------------------------


class DisplayLedger:
    """The display rows as they were stored; ``check`` proves no compaction rewrote any of them."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, Any]] = {}

    async def record(self, rig: Rig, sid: str, seqs: Sequence[int]) -> None:
        if not seqs:
            return
        for m in await rig.store.get_messages(sid, caller=ANONYMOUS, first=min(seqs), last=max(seqs)):
            if m.sequence_number in seqs and m.flags.is_display:
                self.rows[m.sequence_number] = display_dict(m)

    async def check(self, rig: Rig, sid: str) -> None:
        rows = await rig.rows(sid)
        display = {m.sequence_number: m for m in rows if m.flags.is_display}
        assert set(self.rows) <= set(display), "a display row disappeared"
        for seq, before in self.rows.items():
            assert display_dict(display[seq]) == before, f"display row #{seq} changed"
        extra = [m for seq, m in display.items() if seq not in self.rows]
        assert all(m.flags.is_compression and m.role is Role.SYSTEM for m in extra), "unexpected display rows"


def demoted_originals(rows: Sequence[Message]) -> list[Message]:
    """Display rows some compaction demoted (from the compression records' demoted ranges)."""
    demoted: set[int] = set()
    for m in rows:
        if m.flags.is_compression:
            for first, last in m.metadata.get(DEMOTED_RANGES_KEY, []):
                demoted.update(range(int(first), int(last) + 1))
    return [m for m in rows if m.sequence_number in demoted and m.flags.is_display and not is_placeholder(m)]


def unique_token(m: Message) -> str | None:
    """The ``zq…x`` token every harness message carries (None for rows not written by it)."""
    for word in (m.content or "").split():
        if word.startswith("zq") and word.endswith("x"):
            return word
    return None


async def check_raw_index(rig: Rig, sid: str) -> int:
    """Every demoted original is in the raw history index; returns how many were checked."""
    rows = await rig.rows(sid)
    checked = 0
    for m in demoted_originals(rows):
        token = unique_token(m)
        if token is None:
            continue
        found = await rig.engine.search_history(ANONYMOUS, sid, query=token, limit=5)
        assert any(
            token in c.chunk.text and c.chunk.first_sequence <= m.sequence_number <= c.chunk.last_sequence
            for c in found
        ), f"demoted #{m.sequence_number} ({token}) is not in the raw history index"
        checked += 1
    return checked


def check_view(view: BuiltView) -> None:
    rows = view_rows(view)
    assert is_legal(rows), [(m.sequence_number, m.role.value) for m in rows]


# --- the simulated agent loop -------------------------------------------------------------------


@dataclass
class AgentLoop:
    """A runtime driving one session: turns of tool rounds with big outputs (see module docstring)."""

    rig: Rig
    sid: str
    seed: int = 1
    profile: ProfileOverrides = field(default_factory=ProfileOverrides)
    rounds: tuple[int, int] = (0, 4)
    output_words: tuple[int, int] = (20, 700)
    parallel: tuple[int, int] = (1, 2)
    baselines: bool = True
    #: AppendMessages(turn_complete) at the end of each turn (schedules the post-turn check).
    turn_complete: bool = True
    pin_every: int = 0
    #: every n-th tool result carries a screenshot (0 = none).
    image_every: int = 0
    ledger: DisplayLedger = field(default_factory=DisplayLedger)
    views: list[BuiltView] = field(default_factory=list)
    #: (turn, view) for every build that reported a compaction.
    compressed_views: list[tuple[int, BuiltView]] = field(default_factory=list)
    #: estimates of the context measured right after each compaction, in event order.
    after_estimates: list[int] = field(default_factory=list)
    #: their margins (triggers and the hysteresis band are on estimate + margin).
    after_margins: list[int] = field(default_factory=list)
    on_view: Callable[[BuiltView], None] | None = None
    _n: int = 0
    _results: int = 0
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def token(self) -> str:
        self._n += 1
        return f"zq{self.seed:02d}{self._n:05d}x"

    def _compactions(self) -> int:
        return len(self.rig.events(self.sid, "context_compressed"))

    async def _settle(self, seen: int) -> None:
        """Wait for the post-turn check; measure the context if it compressed."""
        assert await self.rig.engine.post_turn.drain(30)
        if self._compactions() > seen:
            est = await self.rig.engine.estimate_tokens(
                ANONYMOUS, model="", messages=(), session_id=self.sid, profile=self.profile
            )
            self.after_estimates.append(est.total)
            self.after_margins.append(est.margin)

    async def _build(self, turn: int, incoming: IncomingMessage | None, *, mid_turn: bool) -> BuiltView:
        seen = self._compactions()
        view = await self.rig.build(self.sid, incoming=incoming, mid_turn=mid_turn, profile=self.profile)
        check_view(view)
        if self.on_view is not None:
            self.on_view(view)
        self.views.append(view)
        if self._compactions() > seen:
            assert view.compression is not None and view.compression.compressed
            self.compressed_views.append((turn, view))
            self.after_estimates.append(view.estimate.total)
            self.after_margins.append(view.estimate.margin)
        if self.baselines:
            seen = self._compactions()
            await self.rig.baseline(self.sid, view)  # schedules a post-turn check too
            await self._settle(seen)
        return view

    async def _append(self, *messages: IncomingMessage, turn_complete: bool = False) -> None:
        seen = self._compactions()
        seqs = await self.rig.append(self.sid, *messages, turn_complete=turn_complete)
        await self.ledger.record(self.rig, self.sid, seqs)
        await self._settle(seen)

    async def turn(self, k: int) -> None:
        r = self._rng
        if self.pin_every and k % self.pin_every == 0:
            await self._append(u(f"{self.token()} standing rule {k}: keep answers short", pinned=True))
        ask = u(f"{self.token()} task {k}: please inspect module_{k}.py and fix it")
        await self._build(k, ask, mid_turn=False)
        await self._append(ask)
        for rnd in range(r.randint(*self.rounds)):
            if rnd:
                await self._build(k, None, mid_turn=True)
            ids = [
                (f"c{k}_{rnd}_{j}", r.choice(["read_file", "grep", "run_tests"]))
                for j in range(r.randint(*self.parallel))
            ]
            results = [t(cid, f"{self.token()} " + words(r.randint(*self.output_words), r)) for cid, _ in ids]
            if self.image_every:
                results = [self._maybe_image(m) for m in results]
            await self._append(a(f"{self.token()} checking", *ids), *results)
        await self._build(k, None, mid_turn=True)
        await self._append(
            IncomingMessage(Message(role=Role.ASSISTANT, content=f"{self.token()} done with task {k}")),
            turn_complete=self.turn_complete,
        )

    def _maybe_image(self, m: IncomingMessage) -> IncomingMessage:
        self._results += 1
        if self._results % self.image_every:
            return m
        side = self._rng.choice([512, 1024, 1400])
        return IncomingMessage(m.message, images=(IncomingImage(data=png(side, side, self._results)),))

    async def run(self, turns: int) -> None:
        for k in range(turns):
            await self.turn(k)
