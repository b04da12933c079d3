"""``api.mapping.message_to_pb``: every field of a stored row on the wire, whichever are set."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from contextsvc._gen.v1 import resources_pb2
from contextsvc.api.mapping import message_to_pb, timestamp
from contextsvc.core.messages import Flags, ImageRef, Message, Role, ToolCall

FULL = Message(
    role=Role.ASSISTANT,
    content="calling",
    images=(ImageRef(blob_id="b1", mime_type="image/png", width=4, height=3, size_bytes=10, token_count=85),),
    tool_calls=(ToolCall(id="c1", name="read", arguments_json='{"p": 1}'),),
    tool_call_id="c0",
    name="bot",
    thinking="hmm",
    flags=Flags(is_context=False, is_summary=True, is_pinned=True, is_recall=True),
    metadata={"source": "x", "n": 2},
    sequence_number=9,
    create_time=datetime(2026, 12, 2, 11, 30, tzinfo=UTC),
    token_count=42,
    replaces=(3, 7),
)


def _expected(m: Message, truncated: bool) -> resources_pb2.Message:
    """Every field written out, as the message is defined in the contract."""
    pb = resources_pb2.Message(
        sequence_number=m.sequence_number,
        role=resources_pb2.ROLE_ASSISTANT if m.role is Role.ASSISTANT else resources_pb2.ROLE_USER,
        content=m.content,
        images=[
            resources_pb2.Image(
                blob_id=i.blob_id, mime_type=i.mime_type, width=i.width, height=i.height, token_count=i.token_count
            )
            for i in m.images
        ],
        tool_calls=[
            resources_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json) for c in m.tool_calls
        ],
        tool_call_id=m.tool_call_id,
        name=m.name,
        thinking=m.thinking,
        flags=resources_pb2.MessageFlags(
            is_context=m.flags.is_context,
            is_display=m.flags.is_display,
            is_summary=m.flags.is_summary,
            is_compression=m.flags.is_compression,
            is_compression_critical=m.flags.is_compression_critical,
            is_plan=m.flags.is_plan,
            is_recall=m.flags.is_recall,
            is_pinned=m.flags.is_pinned,
        ),
        create_time=timestamp(m.create_time),
        token_count=m.token_count,
        truncated_in_view=truncated,
    )
    if m.metadata:
        pb.metadata.update(m.metadata)
    if m.replaces is not None:
        pb.replaces.first, pb.replaces.last = m.replaces
    return pb


@pytest.mark.parametrize("truncated", [False, True])
@pytest.mark.parametrize(
    "row",
    [FULL, Message(role=Role.USER, content="hi", sequence_number=1, create_time=FULL.create_time)],
    ids=["every-field", "plain"],
)
def test_a_row_on_the_wire_holds_every_field_it_has(row: Message, truncated: bool) -> None:
    got = message_to_pb(row, truncated_in_view=truncated)
    assert got == _expected(row, truncated)
    assert got.SerializeToString(deterministic=True) == _expected(row, truncated).SerializeToString(deterministic=True)


def test_rows_sharing_flags_do_not_share_their_flags_message() -> None:
    a = message_to_pb(FULL)
    b = message_to_pb(FULL)
    a.flags.is_pinned = False
    assert b.flags.is_pinned and message_to_pb(FULL).flags.is_pinned
