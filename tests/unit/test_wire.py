"""The BuildContext response written from cached encodings equals the one built as a message."""

from __future__ import annotations

import dataclasses
import operator
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc.api import wire as wire_module
from contextsvc.api.views import build_response, response_fields
from contextsvc.api.wire import (
    ENTRY_OVERHEAD_BYTES,
    EncodedResponse,
    WireCache,
    encode_build_response,
    frame,
    serialize,
)
from contextsvc.core.messages import Flags, ImageRef, Message, Role, ToolCall
from contextsvc.core.tokens import EstimateMethod, TokenEstimate, TokenSegments
from contextsvc.engine.views import BuiltView, ViewMessage

T0 = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)


def stored(seq: int, content: str = "hello", **kw: object) -> Message:
    base = {"role": Role.USER, "content": content, "sequence_number": seq, "create_time": T0, "token_count": 7}
    base.update(kw)
    return Message(**base)  # type: ignore[arg-type]


def estimate() -> TokenEstimate:
    return TokenEstimate(
        total=120,
        text=100,
        images=20,
        method=EstimateMethod.FALLBACK,
        window=8192,
        budget=6000,
        fraction=0.0146,
        segments=TokenSegments(system=10, records=0, summaries=0, pinned=0, messages=90, images=20, incoming=0),
    )


def view(messages: list[ViewMessage]) -> BuiltView:
    return BuiltView(messages=messages, view_id="v1", estimate=estimate(), notices=["note one", "note two"])


def encoded(built: BuiltView, cache: WireCache) -> pb.BuildContextResponse:
    return pb.BuildContextResponse.FromString(encode_build_response(built, "s1", cache, response_fields(built)).data)


def sample() -> BuiltView:
    prompt = Message(role=Role.SYSTEM, content="be brief", flags=Flags(is_display=False))
    call = stored(
        2,
        "reading",
        role=Role.ASSISTANT,
        tool_calls=(ToolCall(id="c1", name="read", arguments_json='{"p": 1}'),),
        metadata={"source": "agent", "n": 3, "nested": {"a": [1, "x"]}},
    )
    result = stored(3, "x" * 5000, role=Role.TOOL, tool_call_id="c1", flags=Flags(is_pinned=True))
    summary = stored(4, "summary", flags=Flags(is_summary=True, is_display=False), replaces=(1, 2))
    cut = dataclasses.replace(stored(5, "y" * 9000), content="y" * 10 + "[cut]")
    image = stored(6, "look", images=(ImageRef(blob_id="b" * 64, mime_type="image/png", width=2, height=3),))
    incoming = Message(role=Role.USER, content="new ask")
    return view(
        [
            ViewMessage(prompt, (), truncated=False),
            ViewMessage(call, (), truncated=False, stored=True),
            ViewMessage(result, (), truncated=False, stored=True),
            ViewMessage(summary, (), truncated=False, stored=True),
            ViewMessage(cut, (), truncated=True),
            ViewMessage(image, (b"\x89PNG",), truncated=False, stored=True),
            ViewMessage(incoming, (), truncated=False),
        ]
    )


def test_encoded_response_equals_the_message_built_response() -> None:
    built = sample()
    cache = WireCache(1 << 20)
    assert encoded(built, cache) == build_response(built)
    # Cut, image-carrying, prompt and incoming messages are never cached: 3 stored rows are.
    assert cache.stats()["entries"] == 3
    assert encoded(built, cache) == build_response(built)
    assert cache.stats()["hits"] == 3


def test_compression_report_and_empty_fields_survive() -> None:
    from contextsvc.engine.compaction import CompressionReport, Method, Reason

    built = dataclasses.replace(
        view([ViewMessage(stored(1), (), truncated=False, stored=True)]),
        compression=CompressionReport(
            compressed=True,
            method=Method.SUMMARY,
            reason=Reason.PRETURN,
            summary="s",
            messages_before=10,
            messages_after=3,
            context_tokens_before=900,
            context_tokens_after=300,
            breadcrumbs=("a",),
        ),
    )
    assert encoded(built, WireCache(1 << 20)) == build_response(built)
    empty = view([])
    assert encoded(empty, WireCache(1 << 20)) == build_response(empty)


def test_a_flag_change_re_encodes_the_row() -> None:
    cache = WireCache(1 << 20)
    m = stored(1)
    before = encoded(view([ViewMessage(m, (), truncated=False, stored=True)]), cache)
    assert not before.messages[0].flags.is_pinned
    pinned = m.with_flags(is_pinned=True)
    after = encoded(view([ViewMessage(pinned, (), truncated=False, stored=True)]), cache)
    assert after.messages[0].flags.is_pinned
    assert cache.stats()["misses"] == 2


def test_the_cache_is_bounded_in_bytes_and_drops_the_oldest() -> None:
    one = len(frame(b"")) + 200  # a rough size of one entry
    cache = WireCache(5 * (one + ENTRY_OVERHEAD_BYTES))
    for seq in range(1, 50):
        cache.framed("s1", stored(seq, "z" * 150))
    stats = cache.stats()
    assert stats["bytes"] <= stats["max_bytes"]
    assert 0 < stats["entries"] < 49
    # The newest rows are the ones kept.
    cache.framed("s1", stored(49, "z" * 150))
    assert cache.stats()["hits"] == 1
    cache.forget_session("s1")
    assert cache.stats()["entries"] == 0
    assert cache.stats()["bytes"] == 0


def test_a_zero_sized_cache_still_answers() -> None:
    cache = WireCache(0)
    built = sample()
    assert encoded(built, cache) == build_response(built)
    assert cache.stats()["entries"] == 0


def test_serialize_passes_bytes_through_and_encodes_messages() -> None:
    assert serialize(EncodedResponse(b"abc")) == b"abc"
    msg = pb.BuildContextResponse(view_id="v")
    assert serialize(msg) == msg.SerializeToString()


def test_the_tail_kept_with_a_reused_view_follows_the_view_id_and_notices() -> None:
    """Without a given tail the response's other fields are encoded once per reused view (the
    estimate object and notices) and only the view id is written per build."""
    cache = WireCache(1 << 20)
    messages = [ViewMessage(stored(1), (), truncated=False, stored=True), ViewMessage(stored(2), (), False, True)]
    first = view(messages)

    def plain(built: BuiltView) -> pb.BuildContextResponse:
        return pb.BuildContextResponse.FromString(encode_build_response(built, "s1", cache).data)

    assert plain(first) == build_response(first)
    reused = dataclasses.replace(first, view_id="v2")  # same messages list, same estimate object
    assert plain(reused) == build_response(reused)
    noticed = dataclasses.replace(first, view_id="v3", notices=["another"])
    assert plain(noticed) == build_response(noticed)
    other_estimate = dataclasses.replace(first, view_id="", estimate=dataclasses.replace(estimate(), total=7))
    assert plain(other_estimate) == build_response(other_estimate)
    assert plain(reused) == build_response(reused)


def test_a_view_extended_by_new_rows_reuses_the_last_views_framed_messages() -> None:
    cache = WireCache(1 << 20)
    first = [ViewMessage(stored(seq, f"row {seq}"), (), truncated=False, stored=True) for seq in range(1, 6)]
    assert encoded(view(first), cache) == build_response(view(first))
    misses = cache.stats()["misses"]
    # The same ViewMessage objects, then two new rows (and a fresh incoming message): only those
    # are encoded, and the response equals one built as a message.
    added = [ViewMessage(stored(seq, f"row {seq}"), (), truncated=False, stored=True) for seq in (6, 7)]
    extended = [*first, *added, ViewMessage(Message(role=Role.USER, content="ask"), (), truncated=False)]
    assert encoded(view(extended), cache) == build_response(view(extended))
    assert cache.stats()["misses"] == misses + 2
    # Not a prefix: another object for row 3 (same row, now pinned), longer than the last view.
    pinned = ViewMessage(first[2].message.with_flags(is_pinned=True), (), truncated=False, stored=True)
    changed = [*first[:2], pinned, *first[3:], *added, extended[-1], added[0]]
    got = encoded(view(changed), cache)
    assert got == build_response(view(changed))
    assert got.messages[2].flags.is_pinned
    # A shorter view than the last one is no extension of it either.
    assert encoded(view(first[:3]), cache) == build_response(view(first[:3]))


def test_a_view_that_names_the_list_it_extends_reuses_that_encoding_and_a_wrong_name_is_caught() -> None:
    cache = WireCache(1 << 20)
    first = [ViewMessage(stored(seq, f"row {seq}"), (), truncated=False, stored=True) for seq in range(1, 6)]
    encoded(view(first), cache)
    hits = cache.stats()["hits"]
    added = [ViewMessage(stored(seq, f"row {seq}"), (), truncated=False, stored=True) for seq in (6, 7)]
    extended = [*first, *added]
    named = dataclasses.replace(view(extended), extends=first)
    assert encoded(named, cache) == build_response(named)
    assert cache.stats()["hits"] == hits + 1  # the last view's bytes, then the two new rows' misses
    # A view that names the last list but is not its extension (a row put in at the front, as
    # recall would) is compared row by row and encoded whole: never the last view's bytes.
    inserted = ViewMessage(stored(9, "recalled"), (), truncated=False, stored=True)
    wrong = dataclasses.replace(view([inserted, *extended]), extends=extended)
    got = encoded(wrong, cache)
    assert got == build_response(wrong)
    assert [m.content for m in got.messages][:2] == ["recalled", "row 1"]


def test_a_view_whose_cut_row_was_cut_again_copies_the_rows_around_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new calibration cuts a long row again and leaves every other row the same object: only
    that row is encoded, the rows before and after it are copied from the last view's bytes."""
    cache = WireCache(1 << 20)
    rows = [ViewMessage(stored(seq, f"row {seq}"), (), truncated=False, stored=True) for seq in range(1, 9)]
    long = stored(4, "z" * 4000)
    rows[3] = ViewMessage(dataclasses.replace(long, content="z" * 40 + "[cut]"), (), truncated=True)
    assert encoded(view(rows), cache) == build_response(view(rows))
    fresh: list[Message] = []
    original = wire_module._fresh

    def counting(vm: ViewMessage) -> bytes:
        fresh.append(vm.message)
        return original(vm)

    monkeypatch.setattr(wire_module, "_fresh", counting)
    misses = cache.stats()["misses"]
    recut = [
        *rows[:3],
        ViewMessage(dataclasses.replace(long, content="z" * 38 + "[cut]"), (), truncated=True),
        *rows[4:],
    ]
    got = encoded(view(recut), cache)
    assert got == build_response(view(recut))
    assert got.messages[3].content == "z" * 38 + "[cut]" and got.messages[3].truncated_in_view
    assert [m.content for m in fresh] == ["z" * 38 + "[cut]"]  # the one row cut again
    assert cache.stats()["misses"] == misses  # no stored row framed again
    # And the next view, extended from that one, still equals the message built whole.
    more = [*recut, ViewMessage(stored(9, "row 9"), (), truncated=False, stored=True)]
    assert encoded(dataclasses.replace(view(more), extends=recut), cache) == build_response(view(more))
    # Cut a third time: the rows after it come from bytes that were themselves copied at a shift.
    third = [*more[:3], ViewMessage(dataclasses.replace(long, content="z" * 90 + "[cut]"), (), truncated=True)]
    third += more[4:]
    assert encoded(view(third), cache) == build_response(view(third))
    assert len(fresh) == 2 and cache.stats()["misses"] == misses + 1  # that row, and row 9 once


_POOL = [ViewMessage(stored(seq, f"row {seq} " * (seq % 5)), (), truncated=False, stored=True) for seq in range(1, 13)]
_CUTS = [ViewMessage(stored(seq, f"cut {seq}"), (), truncated=True) for seq in range(1, 13)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 23), max_size=12), min_size=1, max_size=8))
def test_any_sequence_of_views_encodes_as_the_message_built_whole(views: list[list[int]]) -> None:
    """Views that keep, drop, move, replace and add rows against the last one: every response is
    the message built whole, whatever the last view's bytes offered."""
    cache = WireCache(1 << 20)
    last: list[ViewMessage] | None = None
    for picks in views:
        messages = [(_POOL + _CUTS)[k] for k in picks]
        # ``extends`` names the last view only when it is one (the engine's promise).
        prefix = last is not None and len(last) <= len(messages) and all(map(operator.is_, last, messages))
        built = dataclasses.replace(view(messages), extends=last if prefix else None)
        assert encoded(built, cache) == build_response(built)
        last = messages
