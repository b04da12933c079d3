"""The pieces behind refusing undecodable requests: classification, depth, throttled logging."""

from __future__ import annotations

import logging

import pytest

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc.api.decoding import Undecodable, safe_deserializer, undecodable_error
from contextsvc.config import Limits
from contextsvc.engine.validation import check_metadata, metadata_depth
from contextsvc.errors import InvalidArgument
from contextsvc.throttled_log import ThrottledLog


def _nested(depth: int) -> dict[str, object]:
    value: dict[str, object] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("value", "depth"),
    [({}, 1), ({"a": 1}, 1), ({"a": {"b": 1}}, 2), ({"a": [1, [2]]}, 3), (_nested(30), 30), ("x", 0)],
)
def test_metadata_depth(value: object, depth: int) -> None:
    assert metadata_depth(value) == depth


def test_metadata_depth_limit_names_field() -> None:
    check_metadata(_nested(16), Limits(), "metadata")
    with pytest.raises(InvalidArgument) as caught:
        check_metadata(_nested(17), Limits(), "metadata")
    assert [v.field for v in caught.value.violations] == ["metadata"]
    assert "17 levels" in caught.value.message


def _deep_body(depth: int) -> bytes:
    req = pb.CreateSessionRequest()
    req.metadata.update(_nested(depth))
    return bytes(req.SerializeToString())


@pytest.mark.parametrize(
    ("raw", "cause"),
    [
        (b"\xff\xff\xff", "malformed"),
        (pb.CreateSessionRequest(name="ZZZ").SerializeToString().replace(b"ZZZ", b"\xed\xa0\x80"), "bad_utf8"),
        (_deep_body(60), "too_deep"),
    ],
)
def test_safe_deserializer_returns_marker(raw: bytes, cause: str) -> None:
    result = safe_deserializer(pb.CreateSessionRequest.FromString)(raw)
    assert isinstance(result, Undecodable)
    assert result.cause == cause
    assert result.message_type == "contextsvc.v1.CreateSessionRequest"
    err = undecodable_error(result, "/contextsvc.v1.ContextService/CreateSession")
    assert err.reason == "UNDECODABLE_REQUEST"
    assert err.metadata["cause"] == cause
    assert [v.field for v in err.violations] == ["request"]


def test_safe_deserializer_passes_valid_bodies() -> None:
    raw = pb.CreateSessionRequest(name="ok").SerializeToString()
    assert safe_deserializer(pb.CreateSessionRequest.FromString)(raw).name == "ok"


def test_throttled_log_counts_what_it_leaves_out(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    logger = logging.getLogger("test.throttled")
    throttled = ThrottledLog(logger, per_minute=3, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        written = [throttled.write("refused", n=i) for i in range(10)]
        assert written == [True] * 3 + [False] * 7
        now[0] = 61.0
        assert throttled.write("refused", n=10)
    assert len(caplog.records) == 4
    assert caplog.records[-1].__dict__["suppressed"] == 7
    assert "suppressed" not in caplog.records[0].__dict__


def test_append_fingerprint_changes_with_anything_that_would_be_appended() -> None:
    import dataclasses

    from contextsvc.core.messages import Flags, Message, Role
    from contextsvc.engine.idempotency import append_fingerprint
    from contextsvc.engine.validation import IncomingImage, IncomingMessage

    base = IncomingMessage(Message(role=Role.USER, content="hi", metadata={"a": 1.0}))
    fp = append_fingerprint([base])
    assert fp.startswith("v1:") and fp == append_fingerprint([IncomingMessage(base.message)])
    variants = [
        [base, base],
        [IncomingMessage(dataclasses.replace(base.message, content="hi!"))],
        [IncomingMessage(dataclasses.replace(base.message, role=Role.ASSISTANT))],
        [IncomingMessage(dataclasses.replace(base.message, metadata={"a": 2.0}))],
        [IncomingMessage(dataclasses.replace(base.message, flags=Flags(is_pinned=True)))],
        [IncomingMessage(base.message, (IncomingImage(data=b"png"),))],
        [IncomingMessage(base.message, (IncomingImage(blob_id="sha256:x"),))],
    ]
    assert len({fp, *(append_fingerprint(v) for v in variants)}) == len(variants) + 1


def test_token_bucket_refills_and_lets_an_oversized_request_through_into_debt() -> None:
    from contextsvc.api.token_bucket import TokenBucket

    bucket = TokenBucket(capacity=10, rate=2, now=0.0)
    assert bucket.take(6, 0.0) == 0.0
    assert bucket.take(6, 0.0) == 1.0  # 4 left, 6 needed, 2 per second
    assert bucket.take(6, 1.0) == 0.0
    assert bucket.take(25, 6.0) == 0.0  # full (10): an oversized request passes ...
    assert bucket.take(1, 6.0) == 8.0  # ... and leaves a debt of 15 to pay back first
