"""The pure part of the view builder (DESIGN §5.2): which messages are sent, in which order.

Order, each message tagged with its segment:

1. ``system`` — a fresh ``role=system`` message carrying the profile's system prompt. It is built at
   every call and never stored, so a profile change takes effect at once; omitted when the prompt is
   empty or blank.
2. ``records`` — the stored ``role=system`` rows of the context buffer whose ``metadata.source`` is
   in the allow-list, in context order. Other system rows never reach the view (they stay in the
   display history). Records are not turn members: they are placed before the conversation.
3. the conversation — the buffer's other rows plus the incoming message, made legal by
   ``core.legal`` as one sequence (the incoming message is the newest row, so an assistant message
   with calls left pending by the buffer is no longer last when an incoming message follows). Each
   kept buffer row is tagged ``summaries`` (``is_summary``), else ``pinned`` (``is_pinned``), else
   ``messages``; the incoming message, when it survives the rules, is last and tagged ``incoming``.
   A user incoming message always survives; a tool result survives only if it answers the pending
   call of the buffer's last row. A ``role=system`` incoming message is never sent (it would not be
   system content that leads the prompt); it is reported in ``View.dropped`` — callers should have
   refused it already.

Per-message truncation and image budgeting work on the result and live elsewhere. O(context size).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum

from contextsvc.core.legal import is_legal, repair
from contextsvc.core.messages import Flags, Message, Role


class Segment(StrEnum):
    """Where a view message comes from; the names of the estimate breakdown (DESIGN §4)."""

    SYSTEM = "system"
    RECORDS = "records"
    SUMMARIES = "summaries"
    PINNED = "pinned"
    MESSAGES = "messages"
    INCOMING = "incoming"
    #: excerpts of compacted history, added after assembly between the records and the
    #: conversation (``engine/recall.py``); ``build_view`` never tags a message with it.
    RECALL = "recall"


@dataclass(slots=True, frozen=True)
class View:
    """An ordered view: ``messages[k]`` belongs to ``segments[k]``.

    ``dropped`` holds the buffer rows (and the incoming message) the legal repair left out, and
    ``trimmed`` the kept rows whose unanswered tool calls it removed, as the stored originals, so
    the engine can report them.
    """

    messages: tuple[Message, ...]
    segments: tuple[Segment, ...]
    dropped: tuple[Message, ...] = ()
    trimmed: tuple[Message, ...] = ()

    def __len__(self) -> int:
        return len(self.messages)

    def of(self, *segments: Segment) -> list[Message]:
        """The view messages of the given segments, in view order."""
        wanted = set(segments)
        return [m for m, s in zip(self.messages, self.segments, strict=True) if s in wanted]

    @property
    def system_prompt(self) -> str:
        """The prompt text of the ``system`` segment ('' when omitted)."""
        return next((m.content for m, s in zip(self.messages, self.segments, strict=True) if s is Segment.SYSTEM), "")

    @property
    def records(self) -> list[Message]:
        return self.of(Segment.RECORDS)

    @property
    def context(self) -> list[Message]:
        """The legal conversation from the buffer: summaries, pinned and other messages, in view order."""
        return self.of(Segment.SUMMARIES, Segment.PINNED, Segment.MESSAGES)

    @property
    def incoming(self) -> list[Message]:
        return self.of(Segment.INCOMING)


def system_prompt_message(prompt: str) -> Message | None:
    """The profile's prompt as an unstored system message; None when there is no prompt."""
    if not prompt.strip():
        return None
    return Message(role=Role.SYSTEM, content=prompt, flags=Flags(is_context=True, is_display=False))


def build_view(
    system_prompt: str,
    allowed_sources: Collection[str],
    context: Sequence[Message],
    incoming: Message | None = None,
) -> View:
    """Order the view of a context buffer (rows already in context order); see the module docstring."""
    messages: list[Message] = []
    segments: list[Segment] = []
    dropped: list[Message] = []

    prompt = system_prompt_message(system_prompt)
    if prompt is not None:
        messages.append(prompt)
        segments.append(Segment.SYSTEM)

    allowed = frozenset(allowed_sources)
    system = Role.SYSTEM  # bound once: an enum member lookup costs more than the comparison
    records = [m for m in context if m.role is system]
    # A record whose source is not allowed is display-only by design, not a repair.
    shown = [m for m in records if m.source in allowed]
    messages += shown
    segments += [Segment.RECORDS] * len(shown)
    conversation = [m for m in context if m.role is not system] if records else list(context)
    if incoming is not None and incoming.role is Role.SYSTEM:
        dropped.append(incoming)
        incoming = None
    if incoming is not None:
        conversation.append(incoming)

    trimmed: list[Message] = []
    if is_legal(conversation):  # nearly always: every row kept as it is
        messages += conversation
        segments += map(_segment_of, conversation)
        if incoming is not None:
            segments[-1] = Segment.INCOMING
    else:
        kept = repair(conversation)
        kept_rows = {i for i, _ in kept}
        dropped[:0] = [m for i, m in enumerate(conversation) if i not in kept_rows]
        trimmed = [conversation[i] for i, m in kept if m is not conversation[i]]
        incoming_index = len(conversation) - 1 if incoming is not None else -1
        for i, m in kept:
            messages.append(m)
            segments.append(Segment.INCOMING if i == incoming_index else _segment_of(m))
    return View(messages=tuple(messages), segments=tuple(segments), dropped=tuple(dropped), trimmed=tuple(trimmed))


#: Bound once: on Python 3.11 ``Segment.MESSAGES`` costs a class attribute lookup several times
#: the price of the rest of ``_segment_of``, which runs for every row of a view.
_SUMMARIES, _PINNED, _MESSAGES = Segment.SUMMARIES, Segment.PINNED, Segment.MESSAGES


def _segment_of(m: Message) -> Segment:
    # A summary that is also pinned counts as a summary, as in the token breakdown.
    flags = m.flags
    if flags.is_summary:
        return _SUMMARIES
    if flags.is_pinned:
        return _PINNED
    return _MESSAGES
