"""Message builders and hypothesis strategies for message sequences, realistic and adversarial.

Builders (``user``, ``assistant``, ``tool``, ``summary``, ``record``, ``numbered``) keep table-driven
tests short. Strategies:

* ``well_formed_conversations()`` — legal by construction: an optional summary and pinned messages,
  then turns of user + rounds of (assistant with 1..3 calls, every result, in any order inside the
  run) + an optional final answer, optionally ending with a pending assistant call.
* ``message_sequences()`` — the same, then damaged by random mutations: results dropped, moved
  later (out of order), duplicated; orphan results with unknown, reused or empty ids; assistants
  with 0..3 calls drawn from a small id pool (collisions, repeats, empty ids); stray user messages,
  summaries and pinned messages; ``role=system`` records with allowed and other sources anywhere;
  junk before the first user message. ``system_records=False`` leaves the records out.

Every generated sequence is numbered 1..n (``sequence_number``), so a test can trace any output
message back to its input row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from hypothesis import strategies as st

from contextsvc.core.messages import Flags, Message, Role, ToolCall

#: Record sources: the default allow-list, a compression record's, none at all, and a foreign one.
RECORD_SOURCES = ("task_note", "synapse_event", "compression", "", "debug")
DEFAULT_ALLOWED = frozenset({"task_note", "synapse_event"})

# A small pool, so adversarial calls and results collide with each other and with real ids.
_ID_POOL = ("c1", "c2", "c3", "ghost", "")


# --- builders ------------------------------------------------------------------------------


def user(content: str = "hi", *, seq: int = 0, pinned: bool = False) -> Message:
    return Message(role=Role.USER, content=content, sequence_number=seq, flags=Flags(is_pinned=pinned))


def summary(content: str = "summary of earlier turns", *, seq: int = 0) -> Message:
    """A summary row: role=user, context-only."""
    return Message(role=Role.USER, content=content, sequence_number=seq, flags=Flags(is_summary=True, is_display=False))


def assistant(content: str = "", *call_ids: str, seq: int = 0) -> Message:
    calls = tuple(ToolCall(id=c, name=f"tool_{c or 'noid'}", arguments_json="{}") for c in call_ids)
    return Message(role=Role.ASSISTANT, content=content, tool_calls=calls, sequence_number=seq)


def tool(call_id: str, content: str = "ok", *, seq: int = 0) -> Message:
    return Message(role=Role.TOOL, content=content, tool_call_id=call_id, sequence_number=seq)


def record(source: str = "task_note", content: str = "note", *, seq: int = 0) -> Message:
    metadata = {"source": source} if source else {}
    return Message(role=Role.SYSTEM, content=content, metadata=metadata, sequence_number=seq)


def numbered(messages: Sequence[Message], first: int = 1) -> list[Message]:
    """Copies of ``messages`` with sequence numbers ``first, first + 1, ...``."""
    return [dataclasses.replace(m, sequence_number=first + k) for k, m in enumerate(messages)]


# --- well-formed conversations ---------------------------------------------------------------


@st.composite
def _turn(draw: st.DrawFn, turn_no: int) -> list[Message]:
    rows = [user(f"ask {turn_no}", pinned=draw(st.integers(0, 9)) == 0)]
    for r in range(draw(st.integers(0, 3))):
        ids = [f"t{turn_no}r{r}c{k}" for k in range(draw(st.integers(1, 3)))]
        rows.append(assistant(draw(st.sampled_from(["", "let me check"])), *ids))
        # Parallel calls: results may come back in any order inside the run.
        rows.extend(tool(i, f"result {i}") for i in draw(st.permutations(ids)))
    if draw(st.booleans()):
        rows.append(assistant(f"answer {turn_no}"))
    return rows


@st.composite
def well_formed_conversations(draw: st.DrawFn, *, max_turns: int = 5, pending: bool = True) -> list[Message]:
    """A legal conversation (no system rows); ``pending`` allows a trailing unanswered call."""
    rows: list[Message] = []
    if draw(st.booleans()):
        rows.append(summary())
        rows.extend(user(f"standing rule {k}", pinned=True) for k in range(draw(st.integers(0, 2))))
    for t in range(draw(st.integers(0 if rows else 1, max_turns))):
        rows.extend(draw(_turn(t)))
    if pending and draw(st.integers(0, 3)) == 0:
        rows.append(
            assistant(draw(st.sampled_from(["", "running"])), *[f"p{k}" for k in range(draw(st.integers(1, 2)))])
        )
    return numbered(rows)


# --- adversarial mutations -------------------------------------------------------------------

_Mutation = Callable[[st.DrawFn, list[Message]], None]


def _pos(draw: st.DrawFn, rows: list[Message]) -> int:
    return draw(st.integers(0, len(rows)))


def _known_ids(rows: list[Message]) -> list[str]:
    return sorted({c.id for m in rows for c in m.tool_calls} | {m.tool_call_id for m in rows if m.tool_call_id})


def _any_id(draw: st.DrawFn, rows: list[Message]) -> str:
    return draw(st.sampled_from([*_known_ids(rows), *_ID_POOL]))


def _drop_result(draw: st.DrawFn, rows: list[Message]) -> None:
    results = [k for k, m in enumerate(rows) if m.role is Role.TOOL]
    if results:
        del rows[draw(st.sampled_from(results))]


def _move_result_later(draw: st.DrawFn, rows: list[Message]) -> None:
    results = [k for k, m in enumerate(rows) if m.role is Role.TOOL]
    if results:
        k = draw(st.sampled_from(results))
        m = rows.pop(k)
        rows.insert(draw(st.integers(k, len(rows))), m)


def _duplicate_result(draw: st.DrawFn, rows: list[Message]) -> None:
    results = [k for k, m in enumerate(rows) if m.role is Role.TOOL]
    if results:
        k = draw(st.sampled_from(results))
        rows.insert(k + 1, dataclasses.replace(rows[k], content="again"))


def _orphan_result(draw: st.DrawFn, rows: list[Message]) -> None:
    rows.insert(_pos(draw, rows), tool(_any_id(draw, rows), "stray"))


def _odd_assistant(draw: st.DrawFn, rows: list[Message]) -> None:
    ids = draw(st.lists(st.sampled_from([*_ID_POOL, *_known_ids(rows)[:4]]), max_size=3))
    rows.insert(_pos(draw, rows), assistant(draw(st.sampled_from(["", " ", "thinking out loud"])), *ids))


def _stray_user(draw: st.DrawFn, rows: list[Message]) -> None:
    kind = draw(st.sampled_from(["plain", "pinned", "summary"]))
    m = summary("old summary") if kind == "summary" else user("interjection", pinned=kind == "pinned")
    rows.insert(_pos(draw, rows), m)


def _system_record(draw: st.DrawFn, rows: list[Message]) -> None:
    rows.insert(_pos(draw, rows), record(draw(st.sampled_from(RECORD_SOURCES))))


def _leading_junk(draw: st.DrawFn, rows: list[Message]) -> None:
    junk = draw(st.sampled_from([tool(_any_id(draw, rows), "early"), assistant("hello"), assistant("", "c1")]))
    rows.insert(0, junk)


_CONVERSATION_MUTATIONS: tuple[_Mutation, ...] = (
    _drop_result,
    _move_result_later,
    _duplicate_result,
    _orphan_result,
    _odd_assistant,
    _stray_user,
    _leading_junk,
)


@st.composite
def message_sequences(
    draw: st.DrawFn, *, max_turns: int = 5, max_mutations: int = 6, system_records: bool = True
) -> list[Message]:
    """Any sequence a context buffer could hold, including broken ones (module docstring)."""
    rows = [dataclasses.replace(m, sequence_number=0) for m in draw(well_formed_conversations(max_turns=max_turns))]
    if draw(st.integers(0, 9)) == 0:
        rows = []  # sometimes nothing but noise
    mutations = list(_CONVERSATION_MUTATIONS) + ([_system_record, _system_record] if system_records else [])
    for mutate in draw(st.lists(st.sampled_from(mutations), max_size=max_mutations)):
        mutate(draw, rows)
    return numbered(rows)
