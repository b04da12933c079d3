"""``Message.copy_with``: what ``dataclasses.replace`` gives, for the rows an append copies; and
``make_message``: what the constructor gives, for the rows a store reads."""

from __future__ import annotations

import dataclasses
import weakref
from datetime import UTC, datetime

import pytest

from contextsvc.core.messages import Flags, ImageRef, Message, Role, ToolCall, make_message


def _row() -> Message:
    return Message(
        role=Role.ASSISTANT,
        content="calling",
        images=(ImageRef(blob_id="b", mime_type="image/png", width=2, height=3, size_bytes=9, token_count=7),),
        tool_calls=(ToolCall(id="c1", name="read", arguments_json="{}"),),
        name="bot",
        thinking="hm",
        flags=Flags(is_pinned=True),
        metadata={"k": [1]},
        sequence_number=4,
        token_count=11,
        replaces=(1, 3),
        context_anchor=2,
    )


def test_a_copy_equals_what_dataclasses_replace_makes_and_shares_the_unchanged_fields() -> None:
    row = _row()
    when = datetime(2026, 12, 2, tzinfo=UTC)
    copied = row.copy_with(sequence_number=9, create_time=when, metadata={})
    assert copied == dataclasses.replace(row, sequence_number=9, create_time=when, metadata={})
    assert copied is not row and row.sequence_number == 4 and row.metadata == {"k": [1]}
    assert copied.content is row.content and copied.tool_calls is row.tool_calls  # the measures carry over
    weakref.ref(copied)  # still weakly referenceable (per-message caches follow its life)
    with pytest.raises(dataclasses.FrozenInstanceError):
        copied.content = "x"  # type: ignore[misc]
    assert row.copy_with() == row


def test_an_unknown_field_is_refused() -> None:
    with pytest.raises(TypeError, match="no field colour"):
        _row().copy_with(colour="red")


def test_make_message_equals_the_constructor_given_every_field() -> None:
    row = _row()
    fields = {f.name: getattr(row, f.name) for f in dataclasses.fields(Message)}
    made = make_message(**fields)
    assert made == row and hash(made.flags) == hash(row.flags) and type(made) is Message
    weakref.ref(made)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.content = "x"  # type: ignore[misc]


def test_make_message_wants_every_field_and_no_other() -> None:
    fields = {f.name: getattr(_row(), f.name) for f in dataclasses.fields(Message)}
    del fields["thinking"]
    with pytest.raises(TypeError, match="thinking"):
        make_message(**fields)
    with pytest.raises(TypeError, match="colour"):
        make_message(**fields, thinking="", colour="red")
