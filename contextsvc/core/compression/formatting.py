"""What the summarizer reads, and what comes back (DESIGN §5.4).

The dropped rows become plain text, one block per message, oldest first:

* a tool call is a preview ``→ name(arguments)``, the arguments cut to ``args_preview_chars`` (120);
* a critical tool result (flag ``is_compression_critical`` or a tool in ``critical_tool_names``) is
  verbatim up to ``critical_result_chars`` (4000), else its head 2000 + tail 2000 around a marker:
  a long result the work depends on keeps its beginning and its conclusion;
* any other tool result, and a system record, is cut to ``result_preview_chars`` (800);
* user and assistant text is kept like a critical result (asks and answers are what a summary is
  about, but one pasted megabyte must not crowd out everything else); thinking is left out;
* an older summary is labelled as such, verbatim — or replaced by its merge (``merged_summary``)
  when several were first merged into one (``needs_meta_summary``);
* images: for a vision summarizer, newest first, as many as fit ``image_budget_fraction * window``
  tokens (each priced by its own size); a message notes ``[N image(s) attached]`` and
  ``[+N image(s)]`` for those left out (all of them for a summarizer without vision), so the
  summary does not pretend they never existed.

The whole text is capped at ``input_cap_chars`` (32,000): head 75% (the oldest work) + a marker +
tail (the work right before the kept part). A head-only cut once dropped exactly the newest
summarized work. An ``appendix`` (the fact lines a model summarizer is asked to carry) counts
within the cap: it takes at most a quarter of it, and the rows are cut to the rest.

The summary prompt asks for a last ``KEYS:`` line; ``split_keys`` takes it off the summary and
returns its items, which become the summary's breadcrumbs. ``summary_parts`` reads a model's
answer: a code fence wrapped around the whole answer goes, then the KEYS line is split off.
``is_refusal`` tells a model's refusal ("I'm sorry, but I can't help with that.") from a
summary: it is not stored as one. ``cut_summary_text`` completes an answer the output cap cut
short: marked as cut, with the fact lines it was asked to carry added back.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from contextsvc.config import SummarizerSettings
from contextsvc.core.breadcrumbs import split_keys_line
from contextsvc.core.compression.importance import call_names, is_critical, tool_name
from contextsvc.core.facts import strip_facts
from contextsvc.core.images import DEFAULT_FALLBACK_TOKENS, ref_tokens
from contextsvc.core.messages import Message, Role

_DEFAULTS = SummarizerSettings()

DEFAULT_SUMMARY_PROMPT = (
    "You are shown the earlier part of a conversation between a user and an AI assistant, including "
    "the assistant's tool calls and their results. It is about to be removed from the assistant's "
    "working memory, and your summary is all that will remain of it. Write a concise summary as "
    "bullet points that lets the assistant carry on the work without the original.\n"
    "Keep, exactly as written: decisions and the reasons for them; facts that were established; "
    "names of people, projects, services and tools; file paths, URLs, commands, identifiers and "
    "configuration keys; numbers, amounts, versions and dates; errors that occurred and how they "
    "were resolved; the user's instructions, preferences and corrections; and the tasks still open, "
    "including what was about to happen next.\n"
    "Leave out greetings, small talk and tool output that nothing later depends on. An earlier "
    "summary in the input is part of the history: carry its facts forward. Never add anything "
    "that is not in the input.\n"
    "Finish with one last line that starts with 'KEYS:' and lists the most important exact items "
    "(names, paths, commands, ids, amounts, decisions, links) separated by semicolons, for example: "
    "KEYS: src/app/main.py; make deploy ENV=prod; ticket OPS-4411; budget 12,000 EUR"
)

META_SUMMARY_PROMPT = (
    "You are shown several summaries of consecutive parts of one conversation, oldest first. Merge "
    "them into a single concise summary as bullet points. Where a later summary updates or "
    "contradicts an earlier one, keep the later state. Keep every decision, fact, name, path, "
    "command, identifier, number and open task exactly as written, and add nothing that is not in "
    "them. Finish with one last line that starts with 'KEYS:' and lists the most important exact "
    "items separated by semicolons."
)

_KEYS_INSTRUCTION = (
    "Finish with one last line that starts with 'KEYS:' and lists the most important exact items "
    "(names, paths, commands, ids, amounts, decisions, links) separated by semicolons."
)


@dataclass(slots=True, frozen=True)
class SummaryInput:
    """The formatted input. ``image_blob_ids`` are the images to send with it (oldest first; the
    engine loads their bytes); ``images_omitted`` were only noted. ``uncapped_chars`` is the text's
    size before the whole-input cap."""

    text: str
    image_blob_ids: tuple[str, ...]
    images_omitted: int
    uncapped_chars: int

    @property
    def capped(self) -> bool:
        return self.uncapped_chars > len(self.text)


def summary_instructions(custom_prompt: str = "") -> str:
    """The profile's summary prompt (or ``DEFAULT_SUMMARY_PROMPT``), with the KEYS request added if missing."""
    prompt = custom_prompt.strip() or DEFAULT_SUMMARY_PROMPT
    if "keys:" not in prompt.lower():
        prompt = f"{prompt}\n{_KEYS_INSTRUCTION}"
    return prompt


def format_for_summary(
    rows: Sequence[Message],
    *,
    window: int,
    vision: bool = False,
    critical_tool_names: Collection[str] = (),
    merged_summary: str | None = None,
    settings: SummarizerSettings = _DEFAULTS,
    image_fallback_tokens: int = DEFAULT_FALLBACK_TOKENS,
    appendix: str = "",
) -> SummaryInput:
    """The summarizer input for the dropped ``rows`` (context order), then ``appendix``, all within
    ``input_cap_chars``; see the module docstring."""
    names = call_names(rows)
    budget = math.floor(settings.image_budget_fraction * window) if vision else 0
    attached = _choose_images(rows, budget, image_fallback_tokens)
    blocks: list[str] = []
    blob_ids: list[str] = []
    omitted = 0
    merged_done = False
    for r, m in enumerate(rows):
        if m.flags.is_summary and merged_summary is not None:
            if not merged_done:
                blocks.append(f"[earlier summaries, merged]\n{merged_summary.strip()}")
                merged_done = True
            continue
        picked = [ref for k, ref in enumerate(m.images) if (r, k) in attached]
        blob_ids += [ref.blob_id for ref in picked]
        omitted += len(m.images) - len(picked)
        blocks.append(_block(m, names, critical_tool_names, settings, len(picked), len(m.images) - len(picked)))
    text = "\n\n".join(blocks)
    cap = settings.input_cap_chars
    if appendix:
        appendix = preview(appendix, cap // 4)
    return SummaryInput(
        text=cap_text(text, cap - len(appendix), settings.input_head_share) + appendix,
        image_blob_ids=tuple(blob_ids),
        images_omitted=omitted,
        uncapped_chars=len(text) + len(appendix),
    )


def needs_meta_summary(summaries: Sequence[Message], threshold_chars: int = _DEFAULTS.meta_summary_chars) -> bool:
    """True when there are several old summaries and together they exceed ``threshold_chars`` (10,600)."""
    return len(summaries) >= 2 and sum(len(s.content) for s in summaries) > threshold_chars


def format_meta_summary_input(summaries: Sequence[Message], *, settings: SummarizerSettings = _DEFAULTS) -> str:
    """The merge request's text: every summary labelled, oldest first, capped like any input."""
    total = len(summaries)
    blocks = [f"[summary {k} of {total}{_range_label(s)}]\n{s.content.strip()}" for k, s in enumerate(summaries, 1)]
    return cap_text("\n\n".join(blocks), settings.input_cap_chars, settings.input_head_share)


# --- caps ------------------------------------------------------------------------------------


def preview(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, the cut marked and the full size named."""
    if len(text) <= limit:
        return text
    suffix = f" … [{len(text)} chars]"
    if len(suffix) > limit // 2:
        suffix = "…"
    return text[: limit - len(suffix)] + suffix


def preview_args(arguments_json: str, limit: int = _DEFAULTS.args_preview_chars) -> str:
    """A tool call's arguments on one line, at most ``limit`` characters."""
    flat = " ".join(arguments_json.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def head_tail(text: str, keep: int) -> str:
    """``text`` verbatim up to ``keep`` chars, else its first and last ``keep // 2`` around a marker."""
    if len(text) <= keep:
        return text
    half = keep // 2
    tail = keep - half
    return f"{text[:half]}\n[… {len(text) - half - tail} chars omitted …]\n{text[-tail:]}"


def cap_result(text: str, *, critical: bool, settings: SummarizerSettings = _DEFAULTS) -> str:
    """A tool result as the summarizer sees it: critical ones head + tail, others a preview."""
    if critical:
        return head_tail(text, settings.critical_result_chars)
    return preview(text, settings.result_preview_chars)


def cap_text(text: str, limit: int, head_share: float) -> str:
    """``text`` cut to exactly ``limit`` characters when longer: ``floor(limit * head_share)`` of its
    head, a marker naming what was left out, and the rest of the room from its tail."""
    if len(text) <= limit:
        return text
    head = math.floor(limit * head_share)
    marker = ""
    for _ in range(8):  # the marker's length depends on the number it prints; it settles at once
        tail = max(0, limit - head - len(marker))
        again = f"\n\n[… {len(text) - head - tail} chars of the middle omitted …]\n\n"
        if len(again) == len(marker):
            marker = again  # same length, same tail: this number is exact
            break
        marker = again
    tail = max(0, limit - head - len(marker))
    return text[:head] + marker + (text[-tail:] if tail else "")


# --- KEYS ------------------------------------------------------------------------------------

#: The one KEYS-line parser lives with the breadcrumbs it produces (see its docstring for the rule).
split_keys = split_keys_line

#: A fence line: three backticks, an optional language tag (```markdown).
_FENCE_OPEN = re.compile(r"\A```[\w+.-]*[ \t]*\n")
_FENCE_CLOSE = re.compile(r"\n[ \t]*```[ \t]*\Z")

#: How a model declines: a short answer that opens with an apology or a "can't" (a bullet does not:
#: "- I can't reproduce it" reports what happened).
_A = "['\u2019]?"  # an apostrophe, typed or typographic, or none
_REFUSAL = re.compile(
    r"\A[\s\"'\u201c]*(?:"
    + "|".join(
        [
            r"i" + _A + r"m\s+(?:sorry|not\s+able|unable)",
            r"i\s+am\s+(?:sorry|not\s+able|unable)",
            r"sorry\b",
            r"i\s+(?:can" + _A + r"t|cannot|won" + _A + r"t)",
            r"as\s+an\s+ai\b",
            r"unfortunately,?\s+i\s+(?:can|cannot|am)\b",
        ]
    )
    + ")",
    re.I,
)
#: Longer than this, an answer is taken for a summary whatever its first words.
_REFUSAL_MAX_CHARS = 600


def unfence(text: str) -> str:
    """``text`` without a code fence wrapped around all of it (```markdown … ```), as models often
    answer; a fence inside the text, or one that does not wrap it whole, stays."""
    stripped = text.strip()
    opening = _FENCE_OPEN.match(stripped)
    closing = _FENCE_CLOSE.search(stripped) if opening else None
    if opening is None or closing is None or closing.start() < opening.end() - 1:
        return text
    inner = stripped[opening.end() : closing.start()]
    return text if "```" in inner else inner.strip()


def summary_parts(answer: str) -> tuple[str, list[str]]:
    """A summarizer's answer as the summary's text and its KEYS items: a fence around the whole
    answer (or around the text before its KEYS line) removed, the KEYS line split off."""
    text, keys = split_keys(unfence(answer))
    return unfence(text).strip(), keys


#: where a summary the summarizer's output cap cut short ends (``cut_summary_text``).
CUT_MARKER = "[summary cut short at the summarizer's output limit]"


def cut_summary_text(text: str, facts: str) -> str:
    """A summary the output cap cut short (``summary_parts`` of it), marked as cut, then ``facts``
    (the ``Facts:`` section the summarizer was sent, ``facts_block``) in place of any part of it
    the answer reached: the facts and the KEYS line come last, where the cap cuts."""
    kept = " ".join(p for p in (strip_facts(text).rstrip(), CUT_MARKER) if p)
    return f"{kept}\n\n{facts}" if facts else kept


def is_refusal(text: str, keys: Sequence[str] = ()) -> bool:
    """True when a model's answer (``summary_parts``) is a refusal rather than a summary: short, no
    KEYS line, and it opens like "I'm sorry", "I can't", "As an AI"."""
    return not keys and len(text) <= _REFUSAL_MAX_CHARS and _REFUSAL.match(text) is not None


# --- blocks ----------------------------------------------------------------------------------


def _block(
    m: Message,
    names: Mapping[str, str],
    critical_tool_names: Collection[str],
    settings: SummarizerSettings,
    attached: int,
    omitted: int,
) -> str:
    seq = f"#{m.sequence_number} " if m.sequence_number else ""
    if m.flags.is_summary:
        head, body = f"[{seq}earlier summary{_range_label(m)}]", m.content.strip()
    elif m.role is Role.TOOL:
        critical = is_critical(m, names, critical_tool_names)
        label = "critical tool result" if critical else "tool result"
        name = tool_name(m, names)
        head = f"[{seq}{label}{': ' + name if name else ''}]"
        body = cap_result(m.content, critical=critical, settings=settings)
    elif m.role is Role.SYSTEM:
        head = f"[{seq}note{': ' + m.source if m.source else ''}]"
        body = preview(m.content, settings.result_preview_chars)
    else:
        head = f"[{seq}{m.role.value}]"
        body = head_tail(m.content, settings.critical_result_chars)
    lines = [head]
    if body:
        lines.append(body)
    for call in m.tool_calls:
        lines.append(f"→ {call.name}({preview_args(call.arguments_json, settings.args_preview_chars)})")
    if attached:
        lines.append(f"[{attached} image(s) attached]")
    if omitted:
        lines.append(f"[+{omitted} image(s)]")
    return "\n".join(lines)


def _range_label(m: Message) -> str:
    return f" of #{m.replaces[0]}-#{m.replaces[1]}" if m.replaces else ""


#: image types a vision summarizer is sent (what OpenAI-compatible vision endpoints document);
#: a row stored without a type (``""``) is sent as before, labelled by its magic bytes.
SENDABLE_IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})


def _choose_images(rows: Sequence[Message], budget: int, fallback: int) -> set[tuple[int, int]]:
    """``(row, image)`` positions to send: newest first, each taken while it fits the budget.
    Bytes no image reader recognized (stored 0x0, ``application/octet-stream``) and types vision
    endpoints do not take (BMP, TIFF, icons: ``SENDABLE_IMAGE_TYPES``) are never sent: an endpoint
    refuses the whole request for one image it cannot decode (HTTP 400), and the compaction fell
    back to dropping the turns; they are noted as the images left out are."""
    chosen: set[tuple[int, int]] = set()
    left = budget
    for r in range(len(rows) - 1, -1, -1):
        for k in range(len(rows[r].images) - 1, -1, -1):
            ref = rows[r].images[k]
            if ref.width <= 0 or ref.height <= 0 or (ref.mime_type and ref.mime_type not in SENDABLE_IMAGE_TYPES):
                continue
            price = ref_tokens(ref, fallback_tokens=fallback)
            if price <= left:
                chosen.add((r, k))
                left -= price
    return chosen
