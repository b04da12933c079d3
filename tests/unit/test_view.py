"""The pure view builder (contextsvc.core.view): order, allow-list, legality, segments."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextsvc.config import Settings
from contextsvc.core.legal import legal_view
from contextsvc.core.messages import Message, Role
from contextsvc.core.view import Segment, View, build_view, system_prompt_message
from tests.support.legal_oracle import legality_violations
from tests.support.message_strategies import (
    DEFAULT_ALLOWED,
    RECORD_SOURCES,
    assistant,
    message_sequences,
    numbered,
    record,
    summary,
    tool,
    user,
)

ALLOWED = DEFAULT_ALLOWED


def layout(view: View) -> list[tuple[str, str]]:
    """(segment, content or call ids) per view message."""
    out = []
    for m, s in zip(view.messages, view.segments, strict=True):
        text = m.content or ",".join(c.id for c in m.tool_calls) or m.tool_call_id
        out.append((s.value, text))
    return out


def test_default_allow_list_matches_settings() -> None:
    assert frozenset(Settings().llm_system_sources) == DEFAULT_ALLOWED


def test_full_order_and_segments() -> None:
    context = numbered(
        [
            summary("sum"),
            record("task_note", "note-1"),
            user("rule", pinned=True),
            record("debug", "secret"),
            user("q1"),
            assistant("", "a"),
            record("synapse_event", "event-1"),
            tool("a", "res"),
            assistant("answer"),
            record("compression", "compressed"),
        ]
    )
    view = build_view("be brief", ALLOWED, context, user("q2"))
    assert layout(view) == [
        ("system", "be brief"),
        ("records", "note-1"),
        ("records", "event-1"),
        ("summaries", "sum"),
        ("pinned", "rule"),
        ("messages", "q1"),
        ("messages", "a"),
        ("messages", "res"),
        ("messages", "answer"),
        ("incoming", "q2"),
    ]
    assert view.system_prompt == "be brief"
    assert [m.content for m in view.records] == ["note-1", "event-1"]
    assert [m.content for m in view.context] == ["sum", "rule", "q1", "", "res", "answer"]
    assert [m.content for m in view.incoming] == ["q2"]
    assert view.dropped == () and view.trimmed == ()
    assert len(view) == 10


def test_system_prompt_is_fresh_and_unstored() -> None:
    prompt = system_prompt_message("you are helpful")
    assert prompt is not None
    assert (prompt.role, prompt.content, prompt.sequence_number) == (Role.SYSTEM, "you are helpful", 0)
    assert not prompt.flags.is_display


@pytest.mark.parametrize("prompt", ["", "   ", "\n"])
def test_empty_prompt_is_omitted(prompt: str) -> None:
    view = build_view(prompt, ALLOWED, numbered([user("q")]))
    assert layout(view) == [("messages", "q")]
    assert view.system_prompt == ""


def test_allow_list_is_the_callers() -> None:
    context = numbered([record("task_note", "n"), record("debug", "d"), record("", "none"), user("q")])
    assert [m.content for m in build_view("", {"debug"}, context).records] == ["d"]
    assert build_view("", (), context).records == []


def test_records_may_sit_inside_a_tool_run() -> None:
    context = numbered([user("q"), assistant("", "a"), record("task_note", "n"), tool("a", "r")])
    view = build_view("", ALLOWED, context)
    assert layout(view) == [("records", "n"), ("messages", "q"), ("messages", "a"), ("messages", "r")]


def test_repairs_are_reported() -> None:
    context = numbered([assistant("early"), user("q"), assistant("t", "a", "b"), tool("a", "r"), tool("z", "stray")])
    view = build_view("", ALLOWED, context, user("next"))
    assert layout(view) == [("messages", "q"), ("messages", "t"), ("messages", "r"), ("incoming", "next")]
    assert [m.sequence_number for m in view.dropped] == [1, 5]
    assert view.trimmed == (context[2],)
    assert [c.id for c in view.messages[1].tool_calls] == ["a"]


def test_incoming_user_ends_a_pending_call() -> None:
    context = numbered([user("q"), assistant("", "a")])
    view = build_view("", ALLOWED, context, user("next"))
    assert layout(view) == [("messages", "q"), ("incoming", "next")]
    assert view.dropped == (context[1],)


def test_pending_call_without_incoming_is_last() -> None:
    context = numbered([user("q"), assistant("", "a")])
    assert layout(build_view("", ALLOWED, context)) == [("messages", "q"), ("messages", "a")]


def test_incoming_tool_result_answers_the_pending_call() -> None:
    context = numbered([user("q"), assistant("", "a")])
    view = build_view("", ALLOWED, context, tool("a", "r"))
    assert layout(view) == [("messages", "q"), ("messages", "a"), ("incoming", "r")]


def test_orphan_incoming_tool_result_is_dropped() -> None:
    context = numbered([user("q"), assistant("done")])
    stray = tool("nope", "r")
    view = build_view("", ALLOWED, context, stray)
    assert view.incoming == [] and view.dropped == (stray,)


def test_system_incoming_is_never_sent() -> None:
    incoming = record("task_note", "sneaky")
    view = build_view("p", ALLOWED, numbered([user("q")]), incoming)
    assert layout(view) == [("system", "p"), ("messages", "q")]
    assert view.dropped == (incoming,)


def test_incoming_alone_and_empty_context() -> None:
    assert layout(build_view("p", ALLOWED, [], user("hello"))) == [("system", "p"), ("incoming", "hello")]
    assert layout(build_view("", ALLOWED, [])) == []


def test_pinned_summary_counts_as_summary() -> None:
    pinned_summary = summary("s").with_flags(is_pinned=True)
    assert build_view("", ALLOWED, numbered([pinned_summary])).segments == (Segment.SUMMARIES,)


# --- properties ------------------------------------------------------------------------------

_ORDER = {
    Segment.SYSTEM: 0,
    Segment.RECORDS: 1,
    Segment.SUMMARIES: 2,
    Segment.PINNED: 2,
    Segment.MESSAGES: 2,
    Segment.INCOMING: 3,
}

incomings = st.one_of(
    st.none(),
    st.just(user("incoming")),
    st.builds(lambda i: tool(i, "incoming result"), st.sampled_from(["p0", "p1", "c1", "ghost"])),
)


@given(
    st.sampled_from(["", "system prompt"]),
    st.sets(st.sampled_from(RECORD_SOURCES)),
    message_sequences(),
    incomings,
)
def test_view_invariants(prompt: str, allowed: set[str], context: list[Message], incoming: Message | None) -> None:
    view = build_view(prompt, allowed, context, incoming)
    ranks = [_ORDER[s] for s in view.segments]
    assert ranks == sorted(ranks)
    assert view.segments.count(Segment.SYSTEM) == (1 if prompt else 0)

    # Records: exactly the allowed system rows, in context order, the stored objects themselves.
    expected_records = [m for m in context if m.role is Role.SYSTEM and m.source in allowed]
    assert len(view.records) == len(expected_records)
    assert all(a is b for a, b in zip(view.records, expected_records, strict=True))

    # The conversation is the legal view of the buffer's other rows plus the incoming message.
    conversation = [m for m in context if m.role is not Role.SYSTEM] + ([incoming] if incoming else [])
    assert view.context + view.incoming == legal_view(conversation)
    assert legality_violations(list(view.messages)) == []

    # Every non-system row is either in the view (maybe trimmed) or reported dropped, never both.
    sent = {id(m) for m in view.messages}
    for m in conversation:
        trimmed = any(x is m for x in view.trimmed)
        dropped = any(x is m for x in view.dropped)
        assert (id(m) in sent) + trimmed + dropped == 1
    if incoming is not None and incoming.role is Role.USER:
        assert view.messages[-1] is incoming and view.segments[-1] is Segment.INCOMING

    for m, s in zip(view.messages, view.segments, strict=True):
        if s in (Segment.SUMMARIES, Segment.PINNED, Segment.MESSAGES):
            expected = (
                Segment.SUMMARIES if m.flags.is_summary else Segment.PINNED if m.flags.is_pinned else Segment.MESSAGES
            )
            assert s is expected
