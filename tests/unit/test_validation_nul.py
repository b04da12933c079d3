"""NUL characters are refused in every text field of an appended message, each named by its path."""

from __future__ import annotations

import pytest

from contextsvc.config import Settings
from contextsvc.core.messages import Message, Role, ToolCall
from contextsvc.engine.validation import IncomingMessage, check_messages
from contextsvc.errors import InvalidArgument

LIMITS = Settings().limits


def _fields_refused(message: Message) -> list[str]:
    with pytest.raises(InvalidArgument) as caught:
        check_messages([IncomingMessage(Message(Role.USER, "fine")), IncomingMessage(message)], LIMITS)
    return [v.field for v in caught.value.violations if "NUL" in v.description]


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (Message(Role.USER, "a \x00 b"), "messages[1].content"),
        (Message(Role.ASSISTANT, "ok", thinking="\x00"), "messages[1].thinking"),
        (Message(Role.USER, "ok", name="bo\x00b"), "messages[1].name"),
        (Message(Role.TOOL, "ok", tool_call_id="c\x00"), "messages[1].tool_call_id"),
        (
            Message(Role.ASSISTANT, "ok", tool_calls=(ToolCall(id="c1", name="r\x00", arguments_json="{}"),)),
            "messages[1].tool_calls[0].name",
        ),
        (
            Message(Role.ASSISTANT, "ok", tool_calls=(ToolCall(id="c\x001", name="r", arguments_json="{}"),)),
            "messages[1].tool_calls[0].id",
        ),
        (
            Message(Role.ASSISTANT, "ok", tool_calls=(ToolCall(id="c1", name="r", arguments_json='{"a": "\\u0000"}'),)),
            None,  # an escaped NUL inside JSON text is six characters, not a NUL
        ),
        (
            Message(Role.ASSISTANT, "ok", tool_calls=(ToolCall(id="c1", name="r", arguments_json='{"a": "\x00"}'),)),
            "messages[1].tool_calls[0].arguments_json",
        ),
        (Message(Role.USER, "ok", metadata={"k": ["x\x00"]}), "messages[1].metadata"),
    ],
)
def test_each_field_with_a_nul_is_named(message: Message, field: str | None) -> None:
    if field is None:
        check_messages([IncomingMessage(message)], LIMITS)  # accepted
        return
    assert _fields_refused(message) == [field]


def test_every_field_with_a_nul_is_named_at_once() -> None:
    message = Message(Role.USER, "\x00", thinking="\x00", name="\x00", metadata={"\x00": 1})
    assert _fields_refused(message) == [
        "messages[1].content",
        "messages[1].thinking",
        "messages[1].name",
        "messages[1].metadata",
    ]


def test_messages_without_a_nul_pass() -> None:
    check_messages(
        [
            IncomingMessage(Message(Role.USER, "plain text", metadata={"k": "v"})),
            IncomingMessage(
                Message(Role.ASSISTANT, "", tool_calls=(ToolCall(id="c1", name="read", arguments_json='{"p": 1}'),))
            ),
        ],
        LIMITS,
    )
