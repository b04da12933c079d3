"""AppendMessages' per-call work (issue #15): each message measured once, copies that keep what
was measured, PostgreSQL columns built without copying, the same answers as before."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from contextsvc._gen.v1 import resources_pb2
from contextsvc.api import mapping
from contextsvc.clock import SystemClock
from contextsvc.config import Limits, Settings
from contextsvc.core import tokens
from contextsvc.core.codec import message_to_dict
from contextsvc.core.messages import Flags, ImageRef, Message, Role, ToolCall
from contextsvc.core.profile import ProfileOverrides
from contextsvc.core.session import Principal
from contextsvc.core.sizing import text_size
from contextsvc.engine.validation import IncomingMessage, check_messages
from contextsvc.errors import InvalidArgument
from contextsvc.stores.memory import MemoryStore
from contextsvc.stores.postgres.rows import append_columns, dumps, stamped
from tests.support.engines import make_engine

OWNER = Principal(user_id="u1")


def _old_append_columns(messages: list[Message], now: datetime) -> list[list[object]]:
    """The columns as ``append_columns`` built them before: through ``stamped`` copies."""
    columns: list[list[object]] = [[] for _ in range(7)]
    for m in stamped(messages, 0, now):
        body = message_to_dict(m)
        body.pop("content", None)
        body.pop("seq", None)
        values = (m.role.value, m.flags.is_context, m.flags.is_display, m.context_anchor or 0, m.content)
        for column, value in zip(columns, (*values, m.create_time, dumps(body)), strict=True):
            column.append(value)
    return columns


def test_append_columns_are_the_stamped_rows_columns() -> None:
    now = datetime(2026, 12, 2, 1, 2, 3, 456789, tzinfo=UTC)
    rows = [
        Message(role=Role.USER, content="plain"),
        Message(role=Role.USER, content="naive time", create_time=datetime(2026, 1, 2, 3, 4, 5)),
        Message(
            role=Role.ASSISTANT,
            content="",
            tool_calls=(ToolCall(id="c1", name="read", arguments_json='{"a": 1}'),),
            create_time=datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=3))),
            token_count=17,
            thinking="hmm",
        ),
        Message(role=Role.TOOL, content="r", tool_call_id="c1", metadata={"k": [1, "é"]}, context_anchor=4),
        Message(
            role=Role.SYSTEM,
            content="s",
            flags=Flags(is_display=False, is_summary=True),
            replaces=(1, 3),
            images=(ImageRef(blob_id="b" * 64, mime_type="image/png", width=2, height=3),),
        ),
    ]
    new = append_columns(rows, now)
    old = _old_append_columns(rows, now)
    assert new[:6] == old[:6]
    # The bodies are the same JSON (key order may differ: jsonb does not keep it).
    assert [json.loads(b) for b in new[6]] == [json.loads(str(b)) for b in old[6]]


def _remembered(memo: object, m: Message) -> object:
    entry = memo._entries.get(id(m))  # type: ignore[attr-defined]
    return entry.value if entry is not None and entry() is m else None


def test_a_copy_keeps_what_was_measured_and_a_changed_text_does_not() -> None:
    m = Message(role=Role.USER, content="measure me " * 20)
    size, features = tokens.message_size(m), tokens.message_features(m)
    copy = tokens.carry_measures(m, dataclasses.replace(m, sequence_number=3, metadata={"x": 1}))
    assert _remembered(tokens._SIZES, copy) == size
    assert _remembered(tokens._FEATURES, copy) == features
    other = tokens.carry_measures(m, dataclasses.replace(m, content="something else"))
    assert _remembered(tokens._FEATURES, other) is None  # not carried: its text differs
    assert _remembered(tokens._SIZES, other) is None
    assert tokens.message_features(other) == tokens._features(other) != features
    unmeasured = Message(role=Role.USER, content="never measured")
    assert _remembered(tokens._FEATURES, tokens.carry_measures(unmeasured, dataclasses.replace(unmeasured))) is None


def test_message_tokens_with_images_is_the_price_of_the_message_carrying_them() -> None:
    settings = Settings()
    engine = make_engine(MemoryStore(settings), settings, clock=SystemClock(), retention=10)
    acc = engine.accounting
    m = Message(role=Role.USER, content="look at this")
    images = (ImageRef(blob_id="a" * 64, width=640, height=480), ImageRef(blob_id="b" * 64))
    carrying = dataclasses.replace(m, images=images)
    assert acc.message_tokens("gpt-4o", m, images=images) == acc.message_tokens("gpt-4o", carrying)
    assert acc.message_tokens("gpt-4o", m, images=()) == acc.message_tokens("gpt-4o", m)


def test_stored_rows_are_not_measured_again_at_the_first_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory store keeps a numbered copy of each appended message; the build prices that
    copy with what the append measured (no second measure of a new message)."""

    async def scenario() -> None:
        settings = Settings()
        store = MemoryStore(settings)
        await store.open()
        engine = make_engine(store, settings, clock=SystemClock(), retention=10)
        session = await engine.sessions.create(OWNER, profile_id="", name="", metadata={})
        measured: list[str] = []
        real = tokens._features

        def counting(m: Message) -> tuple[int, ...]:
            measured.append(m.content)
            return real(m)

        monkeypatch.setattr(tokens, "_features", counting)
        texts = ["first question " * 5, "an answer " * 7]
        await engine.append(
            OWNER,
            session.id,
            [
                IncomingMessage(Message(role=Role.USER, content=texts[0])),
                IncomingMessage(Message(role=Role.ASSISTANT, content=texts[1])),
            ],
            request_id="",
            turn_complete=False,
        )
        assert measured == texts
        built = await engine.build_context(
            OWNER, session.id, profile=ProfileOverrides(), incoming=None, mid_turn=False, auto_compress=False
        )
        assert [v.message.content for v in built.messages][-2:] == texts
        assert measured == texts  # the build measured nothing new
        await engine.close()

    asyncio.run(scenario())


def test_messages_without_metadata_are_checked_as_before() -> None:
    limits = Limits()
    ok = [IncomingMessage(Message(role=Role.USER, content="hi"))]
    check_messages(ok, limits)
    deep: dict[str, object] = {}
    node = deep
    for _ in range(limits.max_metadata_depth):
        node["a"] = {}
        node = node["a"]  # type: ignore[assignment]
    too_deep = [IncomingMessage(Message(role=Role.USER, content="hi", metadata=deep))]
    with pytest.raises(InvalidArgument, match="nested"):
        check_messages(too_deep, limits)
    big = [IncomingMessage(Message(role=Role.USER, content="hi", metadata={"k": "x" * limits.max_metadata_bytes}))]
    with pytest.raises(InvalidArgument, match="exceeds"):
        check_messages(big, limits)
    tiny = Limits(max_metadata_bytes=1)
    with pytest.raises(InvalidArgument, match="exceeds 1 bytes"):
        check_messages(ok, tiny)  # an empty object is 2 bytes, as before


def test_a_message_sent_without_flags_gets_the_default_flags() -> None:
    plain = mapping.incoming_from_pb(resources_pb2.Message(role=resources_pb2.ROLE_USER, content="x"), "m")
    assert plain.message.flags == Flags() and plain.images == ()
    sent = resources_pb2.Message(role=resources_pb2.ROLE_USER, content="x")
    sent.flags.is_display = False
    sent.flags.is_pinned = True
    flagged = mapping.incoming_from_pb(sent, "m")
    assert flagged.message.flags == Flags(is_display=False, is_pinned=True)
    assert Flags() == Flags(), "the shared default is not changed by a flagged message"


def test_a_client_message_is_the_message_its_fields_make() -> None:
    """``incoming_from_pb`` sets every field straight into its slot (``make_message``): the result
    equals ``Message(...)`` of the same fields, the output-only ones at their defaults."""
    sent = resources_pb2.Message(
        role=resources_pb2.ROLE_ASSISTANT,
        content="the answer",
        tool_call_id="",
        name="helper",
        thinking="let me see",
        sequence_number=41,  # output-only: ignored
        token_count=9,  # output-only: ignored
    )
    sent.tool_calls.add(id="call_1", name="read_file", arguments_json='{"path": "a.py"}')
    sent.metadata.update({"source": "test", "n": 2})
    sent.flags.is_pinned = True
    made = mapping.incoming_from_pb(sent, "m").message
    assert made == Message(
        role=Role.ASSISTANT,
        content="the answer",
        tool_calls=(ToolCall(id="call_1", name="read_file", arguments_json='{"path": "a.py"}'),),
        name="helper",
        thinking="let me see",
        flags=Flags(is_pinned=True),
        metadata={"source": "test", "n": 2.0},
    )
    assert made.sequence_number == 0 and made.create_time is None and made.token_count == 0
    assert made.replaces is None and made.context_anchor == 0 and made.images == ()


@pytest.mark.parametrize(
    "message",
    [
        Message(role=Role.USER, content="plain words and more words " * 9),
        Message(role=Role.USER, content="Привет, мир! 你好世界 こんにちは 안녕하세요\n\tdef f(x): return x**2  # ok"),
        Message(
            role=Role.ASSISTANT,
            content="",
            thinking="let me look",
            tool_calls=(ToolCall(id="call_1", name="read_file", arguments_json='{"path": "src/a.py"}'),) * 2,
        ),
        Message(role=Role.TOOL, content='{"rows": [1, 2, 3], "ok": true}', tool_call_id="call_1", name="r"),
        Message(role=Role.USER, content=""),
    ],
)
def test_a_message_size_is_its_class_units_plus_framing_as_measured_by_text(message: Message) -> None:
    """The size comes from the features (one pass over the text): the same units ``text_size`` gives."""
    m = dataclasses.replace(message)  # a fresh object: nothing remembered for it
    expected = tokens.message_frame_units(m) + sum(text_size(p) for p in tokens.message_parts(m))
    assert tokens.message_size(m) == expected
