"""A message read back from its log form (``core.codec``) is the message written, for any field
values; reading makes each row through ``make_message``, not the constructor."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextsvc.core.codec import message_from_dict, message_to_dict
from contextsvc.core.messages import Flags, ImageRef, Message, Role, ToolCall

_text = st.text(max_size=40)
_ids = st.text(alphabet="abcdef0123456789_", min_size=1, max_size=12)
_images = st.builds(
    ImageRef,
    blob_id=_ids,
    mime_type=st.sampled_from(["image/png", "image/jpeg"]),
    width=st.integers(1, 4096),
    height=st.integers(1, 4096),
    size_bytes=st.integers(1, 10**7),
    token_count=st.integers(0, 5000),
)
_calls = st.builds(ToolCall, id=_ids, name=_ids, arguments_json=_text)
_flags = st.builds(Flags, **{name: st.booleans() for name in Flags.__dataclass_fields__})
_metadata = st.dictionaries(_ids, st.one_of(st.integers(-(2**40), 2**40), _text, st.booleans(), st.none()), max_size=3)
_times = st.one_of(
    st.none(), st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC))
)
_replaces = st.one_of(st.none(), st.tuples(st.integers(1, 10**6), st.integers(1, 10**6)))

_messages = st.builds(
    Message,
    role=st.sampled_from(list(Role)),
    content=_text,
    images=st.lists(_images, max_size=2).map(tuple),
    tool_calls=st.lists(_calls, max_size=2).map(tuple),
    tool_call_id=st.one_of(st.just(""), _ids),
    name=st.one_of(st.just(""), _ids),
    thinking=_text,
    flags=_flags,
    metadata=_metadata,
    sequence_number=st.integers(0, 10**9),
    create_time=_times,
    token_count=st.integers(0, 10**6),
    replaces=_replaces,
    context_anchor=st.integers(0, 10**9),
)


@settings(max_examples=300, deadline=None)
@given(_messages)
def test_a_message_reads_back_as_written(message: Message) -> None:
    line = json.loads(json.dumps(message_to_dict(message)))  # as a log line holds it
    read = message_from_dict(line)
    assert read == message
    assert type(read.flags) is Flags and type(read.images) is tuple and type(read.tool_calls) is tuple
    assert read.create_time is None or read.create_time.tzinfo is not None


def test_rows_without_flags_share_the_default_flags_and_fresh_metadata() -> None:
    first = message_from_dict({"seq": 1, "role": "user", "content": "a"})
    second = message_from_dict({"seq": 2, "role": "assistant"})
    assert first.flags == Flags() and first.flags is second.flags  # frozen: one is enough
    assert first.metadata == {} and first.metadata is not second.metadata
    assert second.content == "" and second.images == () and second.replaces is None


def test_an_unknown_role_is_refused_as_before() -> None:
    with pytest.raises(ValueError):
        message_from_dict({"seq": 1, "role": "robot"})
