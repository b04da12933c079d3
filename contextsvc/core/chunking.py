"""Cutting demoted messages into raw-history chunks (DESIGN §5.6) so each fact is findable.

A turn (a user message and what followed it, up to the next user message) is one chunk when its
text fits ``max_chars``. A longer turn is cut by message: consecutive short messages are packed
together up to ``max_chars``, and a message longer than that (a long tool output, typically) is
cut into windows of whole lines, each at most ``max_chars``, the next window repeating the last
``overlap_lines`` lines of the previous one so a fact on a boundary is whole in one of them. Each
window starts with its message's header (``#12 tool c3:``), so an excerpt says where it came
from. A single line longer than ``max_chars`` is cut at whitespace (or hard, without any).

Why: BM25 normalizes by length, so a one-line fact inside a 60-line log scores as a sixtieth of
a chunk; as a window of its own it ranks like a short message, and a recalled excerpt carries the
fact instead of a whole log. Pure: the engine turns the pieces into ``HistoryChunk`` values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contextsvc.core.messages import Message, Role

__all__ = ["Piece", "chunk_line", "message_text", "pieces", "turns"]


@dataclass(slots=True, frozen=True)
class Piece:
    """The text of one chunk and the rows it covers (one row for a window of a long message)."""

    text: str
    rows: tuple[Message, ...]


def message_text(m: Message) -> str:
    """A message's content with its tool calls, as it is indexed (no header)."""
    parts = [m.content]
    parts.extend(f"[call {call.name} {call.arguments_json}]" for call in m.tool_calls)
    return " ".join(p for p in parts if p)


def _header(m: Message) -> str:
    label = m.role.value if m.role is not Role.TOOL else f"tool {m.tool_call_id}"
    return f"#{m.sequence_number} {label}:"


def chunk_line(m: Message) -> str:
    """A message as one indexed entry: ``#<sequence> <role>: <text>``."""
    return f"{_header(m)} {message_text(m)}"


def turns(rows: Sequence[Message]) -> list[list[Message]]:
    """Consecutive rows split before every user message: one group per turn, nothing left out."""
    groups: list[list[Message]] = []
    for m in rows:
        if not groups or m.role is Role.USER:
            groups.append([])
        groups[-1].append(m)
    return groups


def _split_line(line: str, limit: int) -> list[str]:
    """``line`` cut into parts of at most ``limit`` characters, at whitespace where there is some."""
    out: list[str] = []
    while len(line) > limit:
        cut = line.rfind(" ", limit // 2, limit + 1)
        if cut <= 0:
            cut = limit
        out.append(line[:cut].rstrip())
        line = line[cut:].lstrip()
    if line:
        out.append(line)
    return out


def _windows(m: Message, max_chars: int, overlap_lines: int) -> list[str]:
    """The windows of one long message, each starting with the message's header line."""
    header = _header(m)
    room = max(16, max_chars - len(header) - 1)
    lines: list[str] = []
    for raw in message_text(m).splitlines():
        if raw.strip():
            lines.extend(_split_line(raw, room))
    out: list[str] = []
    start = 0
    while start < len(lines):
        end, size = start, 0
        while end < len(lines) and (end == start or size + len(lines[end]) + 1 <= room):
            size += len(lines[end]) + 1
            end += 1
        out.append(header + "\n" + "\n".join(lines[start:end]))
        if end >= len(lines):
            break
        # Overlap, but always move forward.
        start = max(start + 1, end - overlap_lines)
    return out


def _packed(packs: list[list[tuple[str, Message]]]) -> list[Piece]:
    """The non-empty packs as pieces; ``packs`` is emptied to one open pack."""
    done = [Piece("\n".join(t for t, _ in p), tuple(m for _, m in p)) for p in packs if p]
    packs[:] = [[]]
    return done


def pieces(rows: Sequence[Message], *, max_chars: int, overlap_lines: int = 1) -> list[Piece]:
    """The chunks of demoted rows (in order); see the module docstring. ``max_chars`` <= 0: one per turn."""
    out: list[Piece] = []
    for turn in turns(rows):
        lines = [chunk_line(m) for m in turn]
        whole = "\n".join(lines)
        if max_chars <= 0 or len(whole) <= max_chars:
            out.append(Piece(whole, tuple(turn)))
            continue
        packs: list[list[tuple[str, Message]]] = [[]]
        for m, line in zip(turn, lines, strict=True):
            if len(line) > max_chars:
                packs.append([])
                out.extend(_packed(packs))
                out.extend(Piece(w, (m,)) for w in _windows(m, max_chars, overlap_lines))
                continue
            if packs[-1] and sum(len(t) + 1 for t, _ in packs[-1]) + len(line) > max_chars:
                packs.append([])
            packs[-1].append((line, m))
        out.extend(_packed(packs))
    return out
