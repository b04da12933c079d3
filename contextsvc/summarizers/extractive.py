"""The default summarizer: no model, no network, the same summary for the same input (DESIGN §5.5).

It reads the dropped rows themselves (``request.messages``), not the capped text, and writes what
a person needs to pick the thread up again: the first and latest asks, the answers and decisions,
the tools used, the errors seen, the files and commands involved, and a final ``KEYS:`` line.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from contextsvc.config import ExtractiveSummarizerConfig, Settings
from contextsvc.core.breadcrumbs import (
    DEFAULT_LIMIT,
    DEFAULT_MAX_CHARS,
    DEFAULT_SCAN_CHARS,
    Entity,
    EntityKind,
    extract_entities,
    format_keys_line,
    split_keys_line,
)
from contextsvc.core.facts import FACTS_HEADER, fact_lines, strip_facts
from contextsvc.core.messages import Message, Role
from contextsvc.core.turns import split_turns
from contextsvc.ports import SummarizerError, SummaryRequest

__all__ = ["ExtractiveSummarizer"]

_ERROR_LINE = re.compile(
    r"\b(?:error|exception|traceback|failed|failure|fatal|panic|denied|refused|not found|no such file"
    r"|timed out|timeout|exit (?:code|status):? ?[1-9]\d*|non-zero exit)\b",
    re.I,
)
_DECISION = re.compile(
    r"\b(?:decided|decision|we will|we'll|i will|i'll|going with|chose|choose|agreed|the plan is|plan:"
    r"|conclusion|root cause|fixed by|the fix is|switched to)\b",
    re.I,
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_SPACES = re.compile(r"\s+")
#: the smallest summary budget, whatever ``max_tokens`` says: a header and a KEYS line must fit.
_MIN_BUDGET_CHARS = 160
#: the shortest a quote is made to leave room for the sections after it (a request's gist)
_MIN_QUOTE_CHARS = 60


@dataclass(slots=True)
class _Facts:
    """What was found in the dropped rows, before it is written out."""

    first_sequence: int = 0
    last_sequence: int = 0
    message_count: int = 0
    turn_count: int = 0
    image_count: int = 0
    carried: list[str] = field(default_factory=list)
    asks: list[str] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)
    tools: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


class ExtractiveSummarizer:
    """Summaries built from the dropped rows by rules; never raises except for empty input."""

    name = "extractive"
    vision = False

    def __init__(
        self,
        config: ExtractiveSummarizerConfig | None = None,
        *,
        chars_per_token: float = 1.8,
        breadcrumb_limit: int = DEFAULT_LIMIT,
        breadcrumb_max_chars: int = DEFAULT_MAX_CHARS,
        breadcrumb_scan_chars: int = DEFAULT_SCAN_CHARS,
    ) -> None:
        if chars_per_token <= 0:
            raise ValueError(f"chars_per_token must be positive, got {chars_per_token}")
        self.config = config or ExtractiveSummarizerConfig()
        self._chars_per_token = chars_per_token
        self._limit = breadcrumb_limit
        self._max_chars = breadcrumb_max_chars
        self._scan_chars = breadcrumb_scan_chars

    @classmethod
    def from_settings(cls, settings: Settings) -> ExtractiveSummarizer:
        s = settings.summarizer
        # The fallback ratio is the pessimistic one (more tokens per char): the summary then
        # stays within max_tokens however the model's tokenizer counts it.
        return cls(
            s.extractive,
            chars_per_token=settings.tokens.fallback_chars_per_token,
            breadcrumb_limit=s.breadcrumb_limit,
            breadcrumb_max_chars=s.breadcrumb_max_chars,
            breadcrumb_scan_chars=s.breadcrumb_scan_chars,
        )

    async def summarize(self, request: SummaryRequest) -> str:
        # In a worker thread: a summary of a few hundred rows is ~0.1 s of CPU, which on the event
        # loop would stall every other session's calls for as long. There it shares the
        # interpreter with them at the switch interval instead.
        return await asyncio.to_thread(self.summarize_sync, request)

    async def close(self) -> None:
        """Nothing to release."""

    def summarize_sync(self, request: SummaryRequest) -> str:
        """The summary (pure; ``summarize`` is its async face)."""
        items: Sequence[Message | str] = list(request.messages)
        if not items:
            if not request.text.strip():
                raise SummarizerError("extractive summarizer: nothing to summarize (no messages, no text)")
            items = [request.text]
        budget = max(_MIN_BUDGET_CHARS, int(request.max_tokens * self._chars_per_token))
        entities = extract_entities(items, limit=self._limit, max_chars=self._max_chars, scan_chars=self._scan_chars)
        keys = [e.text for e in entities]
        facts = self._collect(list(request.messages)) if request.messages else _Facts()
        cfg = self.config
        facts.lines = fact_lines(
            request.messages, max_facts=cfg.max_facts, max_chars=int(budget * cfg.fact_share), fact_chars=cfg.fact_chars
        )
        keys_line = _fit_keys(keys, max(40, budget // 4))
        room = budget - len(keys_line) - 1
        quote = cfg.quote_chars
        body = self._body(request, facts, entities, budget, quote)
        # The body is cut from its end to fit: on a small window the quoted requests alone filled
        # it, and the answers, decisions, tools and errors after them were all cut. Quotes are
        # shortened first, in proportion, so each section keeps a line (at most two passes more).
        for _ in range(2):
            size = sum(len(line) + 1 for line in body)
            if size <= room or quote <= _MIN_QUOTE_CHARS:
                break
            quote = max(_MIN_QUOTE_CHARS, quote * room // size)
            body = self._body(request, facts, entities, budget, quote)
        return _fit_lines(body, room) + "\n" + keys_line

    # --- collecting -----------------------------------------------------------------------

    def _collect(self, messages: list[Message]) -> _Facts:
        facts = _Facts(message_count=len(messages))
        numbers = [m.sequence_number for m in messages if m.sequence_number > 0]
        if numbers:
            facts.first_sequence, facts.last_sequence = min(numbers), max(numbers)
        call_names = {c.id: c.name for m in messages for c in m.tool_calls if c.id}
        for m in messages:
            facts.image_count += len(m.images)
            if m.flags.is_summary:
                text, _ = split_keys_line(m.content)
                # Fold, never nest: its facts join ours (fact_lines reads them), its own header and
                # any "Earlier summary" it carried are dropped, the rest is quoted once.
                rest = [
                    line
                    for line in strip_facts(text).splitlines()
                    if line.strip() and not line.startswith(("Summary of ", "Earlier summary: "))
                ]
                if rest:
                    facts.carried.append("\n".join(rest))
                continue
            if m.role is Role.USER and m.content.strip():
                facts.asks.append(m.content)
            for call in m.tool_calls:
                facts.tools[call.name or "(unnamed tool)"] += 1
            if m.role is Role.TOOL and (error := _error_of(m)):
                tool = call_names.get(m.tool_call_id) or m.name or "tool"
                facts.errors.append(f"{tool}: {error}")
        conversation = [m for m in messages if not m.flags.is_summary]
        turns = split_turns(conversation)
        facts.turn_count = sum(1 for t in turns if not t.is_preamble)
        for turn in turns:
            rows = [conversation[i] for i in turn.rows]
            facts.outcomes.extend(_outcomes_of(rows))
        facts.errors = _dedupe(facts.errors)
        facts.outcomes = _dedupe(facts.outcomes)
        return facts

    # --- writing --------------------------------------------------------------------------

    def _body(
        self, request: SummaryRequest, facts: _Facts, entities: Sequence[Entity], budget: int, q: int
    ) -> list[str]:
        """The summary's lines, each quote at most ``q`` characters."""
        cfg = self.config
        lines = [_header(request, facts)]
        # Facts first: the body is cut to the budget from the end, and they are what must survive.
        if facts.lines:
            lines.append(FACTS_HEADER)
            lines.extend("- " + f for f in facts.lines)
        for carried in facts.carried[-2:]:
            share = max(80, int(budget * cfg.carried_summary_share) // max(1, min(2, len(facts.carried))))
            lines.append("Earlier summary: " + _quote(carried, share))
        if not request.messages:
            lines.append("Text: " + _quote(request.text, q))
        if facts.asks:
            lines.append("First request: " + _quote(facts.asks[0], q))
            middle = facts.asks[1:-1]
            if middle:
                shown = middle[-3:]
                more = f" (and {len(middle) - len(shown)} more)" if len(middle) > len(shown) else ""
                lines.append(f"Other requests ({len(middle)}): " + "; ".join(_quote(a, q // 3) for a in shown) + more)
            if len(facts.asks) > 1:
                lines.append("Latest request: " + _quote(facts.asks[-1], q))
        if facts.outcomes:
            # Newest first: the body is cut from its end, and the newest are nearest the kept turns.
            lines.append("Answers and decisions (newest first):")
            lines.extend("- " + _quote(o, q) for o in reversed(facts.outcomes[-cfg.max_outcomes :]))
        if facts.tools:
            ranked = sorted(facts.tools.items(), key=lambda kv: -kv[1])  # stable: first use breaks ties
            lines.append("Tools used: " + ", ".join(f"{name} \u00d7{count}" for name, count in ranked))
        if facts.errors and cfg.max_errors:
            lines.append("Errors seen:")
            lines.extend("- " + _quote(e, q // 2) for e in facts.errors[: cfg.max_errors])
            if len(facts.errors) > cfg.max_errors:
                lines.append(f"- … and {len(facts.errors) - cfg.max_errors} more")
        files = [e.text for e in entities if e.kind is EntityKind.PATH][: cfg.max_files]
        commands = [e.text for e in entities if e.kind is EntityKind.COMMAND][: cfg.max_commands]
        if files:
            lines.append("Files: " + ", ".join(files))
        if commands:
            lines.append("Commands run: " + "; ".join(f"`{c}`" for c in commands))
        if facts.image_count:
            lines.append(f"Images shared: {facts.image_count}")
        return lines


def _header(request: SummaryRequest, facts: _Facts) -> str:
    if not request.messages:
        return "Summary of earlier text (extracted without a model)."
    span = ""
    if facts.first_sequence:
        span = f", #{facts.first_sequence}..#{facts.last_sequence}"
    turns = f", {facts.turn_count} turn{'s' if facts.turn_count != 1 else ''}" if facts.turn_count else ""
    n = facts.message_count
    return f"Summary of {n} earlier message{'s' if n != 1 else ''}{span}{turns} (extracted without a model)."


def _outcomes_of(turn: list[Message]) -> list[str]:
    """The turn's final assistant answer, plus sentences of earlier assistant text that decide something."""
    assistants = [m for m in turn if m.role is Role.ASSISTANT and m.content.strip()]
    if not assistants:
        return []
    final = next((m for m in reversed(assistants) if not m.tool_calls), assistants[-1])
    found: list[str] = []
    for m in assistants:
        if m is final:
            continue
        for sentence in _SENTENCE_END.split(_SPACES.sub(" ", m.content).strip()):
            if _DECISION.search(sentence):
                found.append(sentence)
    found.append(final.content)
    return found


def _error_of(m: Message) -> str:
    """The first error-looking line of a tool result ('' when it does not look like a failure)."""
    flagged = m.metadata.get("is_error") or m.metadata.get("error")
    lines = [line.strip() for line in m.content[:20_000].splitlines() if line.strip()]
    for line in lines:
        if _ERROR_LINE.search(line):
            return line
    if flagged:
        return lines[0] if lines else "failed"
    return ""


def _quote(text: str, limit: int) -> str:
    flat = _SPACES.sub(" ", text).strip()
    return flat if len(flat) <= limit else flat[: max(1, limit - 1)].rstrip() + "…"


def _dedupe(values: list[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for value in values:
        key = _SPACES.sub(" ", value).strip().casefold()
        if key and key not in seen:
            seen.add(key)
            out.append(value)
    return out


def _fit_lines(lines: list[str], budget: int) -> str:
    """Lines in order while they fit ``budget`` chars; the line that does not fit is cut."""
    out: list[str] = []
    used = 0
    for line in lines:
        room = budget - used - (1 if out else 0)
        if room <= 0:
            break
        if len(line) > room:
            if room >= 24:
                out.append(line[: room - 1].rstrip() + "…")
            break
        out.append(line)
        used += len(line) + (1 if len(out) > 1 else 0)
    return "\n".join(out)


def _fit_keys(keys: list[str], budget: int) -> str:
    """The KEYS line with as many keys (in order) as fit ``budget`` chars."""
    kept: list[str] = []
    for key in keys:
        if len(format_keys_line([*kept, key])) > budget:
            break
        kept.append(key)
    return format_keys_line(kept)
