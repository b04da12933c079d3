"""Gateway frames (pure): protobuf events to JSON frames, client frames parsed and validated,
and the per-socket queue's bounds."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from contextsvc._gen.v1 import events_pb2 as ev
from contextsvc._gen.v1 import resources_pb2 as r
from contextsvc.gateway import frames
from contextsvc.gateway.hub import CLOSE_SLOW, Subscriber

LIMITS = {"max_images": 8, "max_image_bytes": 1000, "max_files": 2}


def event(**payload: Any) -> ev.Event:
    return ev.Event(event_id=1796099665795662, session_id="s1", time=Timestamp(seconds=1_700_000_000), **payload)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (
            {"messages_appended": ev.MessagesAppended(sequence_numbers=[3, 4], context_tokens=120, turn_complete=True)},
            {"sequence_numbers": [3, 4], "context_tokens": 120, "request_id": "", "turn_complete": True},
        ),
        (
            {
                "compression_started": ev.CompressionStarted(
                    reason=ev.COMPRESSION_REASON_FORCED,
                    context_tokens=900,
                    max_context_tokens=1000,
                    plan=ev.CompressionPlan(would_compress=True, messages_to_drop=4),
                )
            },
            {"reason": "forced", "context_tokens": 900, "max_context_tokens": 1000},
        ),
        (
            {
                "context_compressed": ev.ContextCompressed(
                    reason=ev.COMPRESSION_REASON_PRETURN,
                    method=ev.COMPRESSION_METHOD_CLEAR_TOOL_RESULTS,
                    breadcrumbs=["a.py"],
                )
            },
            {"reason": "preturn", "method": "clear_tool_results", "breadcrumbs": ["a.py"]},
        ),
        (
            {
                "compression_refused": ev.CompressionRefused(
                    reason=ev.COMPRESSION_REASON_LOOP_GUARD, trigger=ev.COMPRESSION_REASON_POSTTURN, detail="band"
                )
            },
            {"reason": "loop_guard", "trigger": "postturn", "detail": "band"},
        ),
        (
            {"memory_flush_due": ev.MemoryFlushDue(context_tokens=25_000, threshold_tokens=29_491)},
            {"context_tokens": 25_000, "threshold_tokens": 29_491},
        ),
        (
            {"baseline_recorded": ev.BaselineRecorded(view_id="v", prompt_tokens=10, estimated_tokens=11, model="m")},
            {"view_id": "v", "prompt_tokens": 10, "estimated_tokens": 11, "model": "m"},
        ),
        (
            {"context_truncated": ev.ContextTruncated(view_id="v", prompt_tokens=10, estimated_tokens=90)},
            {"prompt_tokens": 10, "estimated_tokens": 90},
        ),
        ({"session_deleted": ev.SessionDeleted()}, {}),
    ],
)
def test_every_event_kind_becomes_a_typed_frame(payload: dict[str, Any], expected: dict[str, Any]) -> None:
    frame = frames.event_frame(event(**payload))
    kind = next(iter(payload))
    assert frame["type"] == kind and kind in frames.EVENT_FRAMES
    assert frame["event_id"] == 1796099665795662 and isinstance(frame["event_id"], int)
    assert frame["session_id"] == "s1" and frame["time"] == "2023-11-14T22:13:20Z"
    for key, value in expected.items():
        assert frame[key] == value
    assert json.loads(frames.dumps(frame)) == frame


def test_messages_leave_image_bytes_out_and_keep_flags_and_metadata() -> None:
    message = r.Message(
        sequence_number=5,
        role=r.ROLE_TOOL,
        content="x",
        images=[r.Image(data=b"\x89PNG", blob_id="ab", mime_type="image/png", width=2, height=3)],
        flags=r.MessageFlags(is_context=False, is_pinned=True),
        replaces=r.SequenceRange(first=1, last=4),
    )
    message.metadata.update({"cleared_from": 3})
    out = frames.to_json(message)
    assert out["role"] == "tool" and out["sequence_number"] == 5
    assert out["images"] == [{"blob_id": "ab", "mime_type": "image/png", "width": 2, "height": 3, "token_count": 0}]
    assert out["flags"]["is_context"] is False and out["flags"]["is_pinned"] is True
    assert "is_display" not in out["flags"]  # unset optional fields stay absent
    assert out["metadata"] == {"cleared_from": 3} and out["replaces"] == {"first": 1, "last": 4}
    assert "create_time" not in out


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"\x00", "BAD_FRAME"),
        ("{", "BAD_FRAME"),
        ("3", "BAD_FRAME"),
        ('{"type": "message", "id": true}', "BAD_FRAME"),
        ('{"type": "message", "id": 1.5}', "BAD_FRAME"),
        ('{"type": "nope", "id": "x"}', "UNKNOWN_TYPE"),
        ("{}", "UNKNOWN_TYPE"),
    ],
)
def test_parse_rejects_with_a_code(raw: str | bytes, code: str) -> None:
    with pytest.raises(frames.FrameError) as caught:
        frames.parse(raw)
    assert caught.value.code == code


def test_parse_keeps_the_id_for_unknown_types() -> None:
    with pytest.raises(frames.FrameError) as caught:
        frames.parse('{"type": "nope", "id": "x"}')
    assert caught.value.frame_id == "x"


def test_message_images_as_base64_and_data_uris_and_files() -> None:
    data = b"\x89PNG\r\n\x1a\n" + b"\x00" * 20
    b64 = base64.b64encode(data).decode()
    msg = frames.parse_message(
        {
            "type": "message",
            "content": "see",
            "images": [b64, f"data:image/png;base64,{b64}"],
            "files": [{"name": "a.pdf", "path": "/x/a.pdf"}, {"path": "/x/b.txt"}],
            "request_id": "r1",
        },
        **LIMITS,
    )
    assert msg.images == [data, data] and msg.request_id == "r1" and not msg.turn_complete
    assert msg.content == "see\n\n[Uploaded files on disk: a.pdf (/x/a.pdf), /x/b.txt]"


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ({"content": ""}, "INVALID_MESSAGE"),
        ({"content": 5}, "INVALID_MESSAGE"),
        ({"content": "x", "images": ["aGk="] * 9}, "TOO_MANY_IMAGES"),
        ({"content": "x", "images": [base64.b64encode(b"x" * 600).decode()] * 2}, "IMAGES_TOO_LARGE"),
        ({"content": "x", "images": ["!!!"]}, "INVALID_MESSAGE"),
        ({"content": "x", "images": [""]}, "INVALID_MESSAGE"),
        ({"content": "x", "files": [{"path": "/a"}] * 3}, "INVALID_MESSAGE"),
        ({"content": "x", "files": [{"name": 1, "path": "/a"}]}, "INVALID_MESSAGE"),
        ({"content": "x", "request_id": 7}, "INVALID_MESSAGE"),
    ],
)
def test_message_limits(frame: dict[str, Any], code: str) -> None:
    with pytest.raises(frames.FrameError) as caught:
        frames.parse_message({"type": "message", **frame}, **LIMITS)
    assert caught.value.code == code


async def test_subscriber_queue_is_bounded_and_closes_4008() -> None:
    closed: list[tuple[int, str]] = []
    sub = Subscriber(3, lambda code, reason: closed.append((code, reason)))
    sub.go_live(0)
    for n in range(1, 4):
        sub.offer((n, b"x"))
    assert not closed and sub.queue.qsize() == 3
    sub.offer((4, b"x"))
    assert closed and closed[0][0] == CLOSE_SLOW and sub.closed
    sub.offer((5, b"x"))  # ignored once closed
    assert len(closed) == 1


async def test_subscriber_queue_is_bounded_in_bytes_too() -> None:
    closed: list[tuple[int, str]] = []
    sub = Subscriber(100, lambda code, reason: closed.append((code, reason)), max_bytes=10)
    sub.go_live(0)
    sub.offer((0, b"x" * 25))  # nothing waits: a frame bigger than the bound still goes
    assert not closed and sub.waiting_bytes == 25
    assert await sub.next() == (0, b"x" * 25)
    assert sub.waiting_bytes == 0
    sub.offer((1, b"x" * 6))
    sub.offer((2, b"x" * 4))
    assert not closed and sub.waiting_bytes == 10
    assert await sub.next() == (1, b"x" * 6)
    sub.offer((3, b"x" * 6))  # 4 + 6 waiting: at the bound, not past it
    assert not closed
    sub.offer((4, b"x"))
    assert closed == [(CLOSE_SLOW, "too slow: 11 bytes waiting")] and sub.closed


async def test_subscriber_bytes_of_replayed_events_are_not_counted_once_live() -> None:
    closed: list[tuple[int, str]] = []
    sub = Subscriber(100, lambda code, reason: closed.append((code, reason)), max_bytes=10)
    for n in (5, 6, 7):
        sub.offer((n, b"e" * 3))
    assert sub.waiting_bytes == 9
    sub.go_live(6)  # 5 and 6 were in the replay: only 7 still waits
    assert sub.waiting_bytes == 3
    sub.offer((8, b"e" * 7))
    assert not closed


async def test_subscriber_pending_events_after_the_replay_go_live_once() -> None:
    sub = Subscriber(10, lambda code, reason: None)
    for n in (5, 6, 7):
        sub.offer((n, b"e"))
    assert sub.queue.empty()
    sub.go_live(6)  # 5 and 6 were in the replay
    assert [sub.queue.get_nowait() for _ in range(sub.queue.qsize())] == [(7, b"e")]


async def test_subscriber_writes_directly_only_when_nothing_waits() -> None:
    written: list[bytes] = []
    accept = True

    def write_now(data: bytes) -> bool:
        if accept:
            written.append(data)
        return accept

    sub = Subscriber(10, lambda code, reason: None, write_now=write_now)
    sub.go_live(0)
    sub.offer((1, b"a"))
    accept = False
    sub.offer((2, b"b"))
    accept = True
    sub.offer((3, b"c"))  # b is still queued: c waits behind it, order kept
    assert written == [b"a"] and [sub.queue.get_nowait() for _ in range(2)] == [(2, b"b"), (3, b"c")]


def test_an_upstream_error_passes_through_a_generator_context_manager() -> None:
    """The tracer's span (telemetry on) is a generator context manager, which sets the
    ``__traceback__`` of an exception passing through it: a frozen dataclass refused that with a
    TypeError, and a refused call closed its socket 1011 instead of 4003."""
    import contextlib

    from contextsvc.gateway.upstream import UpstreamError

    @contextlib.contextmanager
    def span() -> Iterator[None]:
        yield

    with pytest.raises(UpstreamError) as caught, span():
        raise UpstreamError("UNAUTHENTICATED", "the API token is not valid", "TOKEN_INVALID")
    assert caught.value.denied and caught.value.reason == "TOKEN_INVALID"
    assert str(caught.value) == "UNAUTHENTICATED: the API token is not valid"
    assert len({caught.value, UpstreamError("UNAUTHENTICATED", "the API token is not valid")}) == 2
