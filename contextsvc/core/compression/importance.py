"""Which rows and turns matter most when a compaction must choose (DESIGN §5.4).

* A **critical result** is a tool result flagged ``is_compression_critical`` or produced by a tool
  named in the profile's ``critical_tool_names``. The summarizer input keeps it (nearly) verbatim,
  the cheap stage never clears it, and it makes its turn important.
* An **important** turn scores above zero, one point per signal (a critical row counts two):
  it holds a critical row; a tool result reports an error (first line starts with error,
  exception, traceback, fatal, failed, or ``metadata.is_error`` is true); or its user message is a
  correction or a decision ("don't", "never", "always", "instead", "actually", "wrong", "from now
  on", "decided", "let's go with", a leading "no," ...). These are the turns whose loss users
  notice after a compaction: the result a later step relies on, the failure not to repeat, the
  rule the user already gave once.
* A **filler** turn is a short exchange with nothing to lose: no tool calls or results, no
  images, nothing pinned, not important, and all its text within ``filler_turn_chars`` — "thanks",
  "ok, go on", "you're welcome".
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence

from contextsvc.core.lazy_re import folded
from contextsvc.core.message_memo import IdentityMemo
from contextsvc.core.messages import Message, Role

_ERROR_FIRST_LINE = re.compile(r"^\W*(error|exception|traceback|fatal|failed|failure)\b", re.IGNORECASE)
#: Searched lower-cased in ASCII text (``folded``: a third of the time of ``re.I``, the same finds).
_CORRECTION = folded(
    r"^\s*no\b[\s,.!]"
    r"|\b(don'?t|do not|never|always|instead|actually|wrong|incorrect|not what i|from now on|remember"
    r"|decided|decision|let'?s go with|correction)\b"
)
#: an error is recognized in the head of a result only: scanning a megabyte is not worth it.
_SCAN_CHARS = 2000


def call_names(rows: Sequence[Message]) -> dict[str, str]:
    """tool_call_id -> tool name, from the assistant messages' calls (first occurrence wins)."""
    names: dict[str, str] = {}
    for m in rows:
        for call in m.tool_calls:
            if call.id and call.id not in names:
                names[call.id] = call.name
    return names


def tool_name(m: Message, names: Mapping[str, str]) -> str:
    """The tool a result came from: its own ``name``, else the name of the call it answers."""
    return m.name or names.get(m.tool_call_id, "")


def is_critical(m: Message, names: Mapping[str, str], critical_tool_names: Collection[str]) -> bool:
    """A row flagged critical, or a tool result of a tool named critical by the profile."""
    if m.flags.is_compression_critical:
        return True
    return m.role is Role.TOOL and bool(critical_tool_names) and tool_name(m, names) in critical_tool_names


#: Each message's two text signals, found once per message object: every compaction plans more
#: than once and scores every older turn, over the same stored rows, and the correction pattern
#: scans up to ``_SCAN_CHARS`` of each user message.
_ERRORS: IdentityMemo[bool] = IdentityMemo()
_CORRECTIONS: IdentityMemo[bool] = IdentityMemo()


def is_error_result(m: Message) -> bool:
    """A tool result that reports a failure (see the module docstring)."""
    return m.role is Role.TOOL and _ERRORS.get(m, _is_error_result)


def _is_error_result(m: Message) -> bool:
    if m.metadata.get("is_error") is True:
        return True
    head = m.content[:_SCAN_CHARS]
    return bool(_ERROR_FIRST_LINE.match(head)) or "Traceback (most recent call last)" in head


def is_correction(m: Message) -> bool:
    """A user message that corrects the assistant or records a decision."""
    return m.role is Role.USER and not m.flags.is_summary and _CORRECTIONS.get(m, _is_correction)


def _is_correction(m: Message) -> bool:
    return bool(_CORRECTION.search(m.content[:_SCAN_CHARS]))


def turn_importance(rows: Sequence[Message], names: Mapping[str, str], critical_tool_names: Collection[str]) -> int:
    """Importance score of a turn's rows: 2 for a critical row, 1 for an error, 1 for a correction."""
    score = 0
    if any(is_critical(m, names, critical_tool_names) for m in rows):
        score += 2
    if any(is_error_result(m) for m in rows):
        score += 1
    if any(is_correction(m) for m in rows):
        score += 1
    return score


def is_filler(
    rows: Sequence[Message], names: Mapping[str, str], critical_tool_names: Collection[str], max_chars: int
) -> bool:
    """A short exchange without tool work, images, pins or importance (module docstring)."""
    if not rows or any(m.tool_calls or m.role is Role.TOOL or m.images or m.flags.is_pinned for m in rows):
        return False
    if any(m.flags.is_summary for m in rows):
        return False
    if sum(len(m.content) + len(m.thinking) for m in rows) > max_chars:
        return False
    return turn_importance(rows, names, critical_tool_names) == 0
