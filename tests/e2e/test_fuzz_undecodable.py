"""Raw, undecodable and hostile request bodies against a real server (issue 13, item 5).

Every method the server registers (ContextService, health) gets bodies sent through a generic
channel as raw bytes: random bytes, valid requests with bytes flipped, strings that are not UTF-8
(a lone surrogate), metadata nested past the depth limit and past the decoder's limit, and valid
random requests. None may end in UNKNOWN or INTERNAL; the server must stay up and its log must
stay short (refusals are throttled, no tracebacks).
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
from collections import Counter
from typing import Any

import grpc
from google.protobuf import descriptor, message_factory, struct_pb2
from grpc_health.v1 import health_pb2

from contextsvc._gen.v1 import context_service_pb2 as pb
from tests.support.rpc import error_details
from tests.support.server import ServerProcess

SERVICE = pb.DESCRIPTOR.services_by_name["ContextService"]
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS}
REQUESTS_PER_METHOD = 300  # x 18 methods (15 ContextService, 3 health) = 5,400 requests
MARKER = b"ZZQQZZ"
LONE_SURROGATE = b"ZZ\xed\xa0\x80Z"  # same length as MARKER: the framing stays valid, the UTF-8 does not


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


class Bodies:
    """Request bodies for one method's input type, drawn from a seeded generator."""

    def __init__(self, method: descriptor.MethodDescriptor, rng: random.Random, session_ids: list[str]):
        self.type = message_factory.GetMessageClass(method.input_type)
        self.rng = rng
        self.session_ids = session_ids

    def _text(self) -> str:
        return "".join(self.rng.choice("ab é中\n{}\"'\\") for _ in range(self.rng.randint(0, 12)))

    def _fill(self, msg: Any, depth: int) -> None:
        rng = self.rng
        if isinstance(msg, struct_pb2.Struct):
            msg.update({"source": self._text(), "n": rng.randint(-5, 5)})
            return
        for field in msg.DESCRIPTOR.fields:
            if rng.random() < 0.4:
                continue
            count = rng.randint(0, 2) if field.is_repeated else 1
            for _ in range(count):
                self._set(msg, field, depth)

    def _value(self, field: descriptor.FieldDescriptor) -> Any:
        rng = self.rng
        t = field.type
        if t == field.TYPE_STRING:
            if field.name in ("session_id", "id", "view_id") and rng.random() < 0.6:
                return rng.choice(self.session_ids)
            return self._text()
        if t == field.TYPE_BYTES:
            return rng.randbytes(rng.randint(0, 16))
        if t == field.TYPE_BOOL:
            return rng.random() < 0.5
        if t == field.TYPE_ENUM:
            return rng.randint(-1, 5)
        if t in (field.TYPE_FLOAT, field.TYPE_DOUBLE):
            return rng.uniform(-2, 2)
        if t in (field.TYPE_INT32, field.TYPE_SINT32, field.TYPE_SFIXED32):
            return rng.randint(-(2**31), 2**31 - 1)
        if t in (field.TYPE_UINT32, field.TYPE_FIXED32):
            return rng.randint(0, 2**32 - 1)
        if t in (field.TYPE_UINT64, field.TYPE_FIXED64):
            return rng.randint(0, 2**64 - 1)
        return rng.randint(-(2**40), 2**40)

    def _set(self, msg: Any, field: descriptor.FieldDescriptor, depth: int) -> None:
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry or depth > 3:
                return
            if field.is_repeated:
                child = getattr(msg, field.name).add()
            else:
                child = getattr(msg, field.name)
                child.SetInParent()
            self._fill(child, depth + 1)
        elif field.is_repeated:
            getattr(msg, field.name).append(self._value(field))
        else:
            setattr(msg, field.name, self._value(field))

    def valid(self) -> bytes:
        msg = self.type()
        self._fill(msg, 0)
        return bytes(msg.SerializeToString())

    def flipped(self) -> bytes:
        raw = bytearray(self.valid() or b"\x0a\x01a")
        for _ in range(self.rng.randint(1, 4)):
            raw[self.rng.randrange(len(raw))] = self.rng.randrange(256)
        return bytes(raw)

    def random_bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.randint(1, 200))

    def bad_utf8(self) -> bytes | None:
        """A valid request whose first string field (at any depth) holds a lone surrogate."""
        msg = self.type()
        self._fill(msg, 0)
        if not self._plant(msg, 0):
            return None
        raw = bytes(msg.SerializeToString())
        assert MARKER in raw
        return raw.replace(MARKER, LONE_SURROGATE, 1)

    def _plant(self, msg: Any, depth: int) -> bool:
        for field in msg.DESCRIPTOR.fields:
            if field.type == field.TYPE_STRING and not field.is_repeated:
                setattr(msg, field.name, MARKER.decode())
                return True
        for field in msg.DESCRIPTOR.fields:
            if field.message_type is not None and not field.is_repeated and depth < 3:
                if field.message_type.full_name == "google.protobuf.Struct":
                    getattr(msg, field.name).update({MARKER.decode(): 1})
                    return True
                if self._plant(getattr(msg, field.name), depth + 1):
                    return True
        return False

    def deep(self, depth: int) -> bytes | None:
        """Metadata nested ``depth`` levels in the first Struct field the request can carry."""
        msg = self.type()
        for field in msg.DESCRIPTOR.fields:
            if field.message_type is None:
                continue
            if field.message_type.full_name == "google.protobuf.Struct":
                getattr(msg, field.name).update(_nested(depth))
                return bytes(msg.SerializeToString())
            if field.message_type.name == "Message":
                target = getattr(msg, field.name).add() if field.is_repeated else None
                if target is None:
                    target = getattr(msg, field.name)
                target.role = 1
                target.content = "deep"
                target.metadata.update(_nested(depth))
                return bytes(msg.SerializeToString())
        return None


async def _call(
    channel: grpc.aio.Channel, path: str, streaming: bool, body: bytes, stream_timeout: float
) -> tuple[grpc.StatusCode, grpc.aio.AioRpcError | None]:
    """A stream that decoded stays open: it ends by its deadline (DEADLINE_EXCEEDED is allowed)."""
    try:
        if streaming:
            call = channel.unary_stream(path)(body, timeout=stream_timeout)
            async for _ in call:
                break
            call.cancel()
        else:
            await channel.unary_unary(path)(body, timeout=10)
        return grpc.StatusCode.OK, None
    except grpc.aio.AioRpcError as err:
        return err.code(), err


async def test_undecodable_and_fuzzed_bodies_never_unknown_or_internal(server: ServerProcess) -> None:
    rng = random.Random(1313)
    with server.channel() as sync_ch:
        stub = server.stub(sync_ch)
        session_ids = [stub.CreateSession(pb.CreateSessionRequest(name=f"s{i}")).id for i in range(4)]

    methods: list[tuple[str, bool, descriptor.MethodDescriptor]] = [
        (f"/{SERVICE.full_name}/{m.name}", m.server_streaming, m) for m in SERVICE.methods
    ] + [(f"/{HEALTH.full_name}/{m.name}", m.server_streaming, m) for m in HEALTH.methods]
    assert len(methods) == 18

    jobs: list[tuple[str, str, bool, bytes]] = []
    for path, streaming, method in methods:
        bodies = Bodies(method, rng, session_ids)
        for i in range(REQUESTS_PER_METHOD):
            kind = ("random", "flipped", "bad_utf8", "valid", "deep")[i % 5]
            body: bytes | None
            if kind == "random":
                body = bodies.random_bytes()
            elif kind == "flipped":
                body = bodies.flipped()
            elif kind == "bad_utf8":
                body = bodies.bad_utf8()
            elif kind == "deep":
                body = bodies.deep(rng.choice((20, 40, 60)))
            else:
                body = bodies.valid()
            if body is None:
                kind, body = "random", bodies.random_bytes()
            if "DeleteSession" in path and kind == "valid":
                body = pb.DeleteSessionRequest(session_id="00000000-0000-4000-8000-000000000000").SerializeToString()
            jobs.append((kind, path, streaming, body))
    assert len(jobs) >= 5000

    outcomes: Counter[tuple[str, grpc.StatusCode]] = Counter()
    bad: list[tuple[str, str, grpc.StatusCode, str]] = []
    utf8_reasons: Counter[tuple[str, str]] = Counter()
    gate = asyncio.Semaphore(32)

    async with grpc.aio.insecure_channel(server.address) as channel:

        async def run(kind: str, path: str, streaming: bool, body: bytes) -> None:
            async with gate:
                # Bodies that can never decode get a deadline long enough for a busy machine.
                code, err = await _call(channel, path, streaming, body, 10.0 if kind == "bad_utf8" else 0.5)
            outcomes[(kind, code)] += 1
            if code in FORBIDDEN:
                bad.append((kind, path, code, err.details() if err else ""))
            if kind == "bad_utf8" and err is not None:
                details = error_details(err)  # type: ignore[arg-type]
                utf8_reasons[(details["reason"], details["metadata"].get("cause", ""))] += 1

        await asyncio.gather(*(run(*job) for job in jobs))

    assert not bad, bad[:10]
    assert sum(outcomes.values()) >= 5000
    # A lone surrogate never decodes: every such body is refused the same clear way.
    n_utf8 = sum(n for (kind, _), n in outcomes.items() if kind == "bad_utf8")
    assert outcomes[("bad_utf8", grpc.StatusCode.INVALID_ARGUMENT)] == n_utf8
    assert utf8_reasons == Counter({("UNDECODABLE_REQUEST", "bad_utf8"): n_utf8})
    assert outcomes[("random", grpc.StatusCode.INVALID_ARGUMENT)] > REQUESTS_PER_METHOD

    # Still alive and serving.
    with server.channel() as sync_ch:
        assert server.proc is not None and server.proc.poll() is None
        stub = server.stub(sync_ch)
        assert stub.GetSession(pb.GetSessionRequest(session_id=session_ids[0])).id == session_ids[0]

    # The log stays short: refusals are throttled (10 lines a minute by default), no tracebacks.
    lines = [line for line in server.stderr_text.splitlines() if line.strip()]
    assert len(lines) <= 40, collections.Counter(json.loads(x)["event"] for x in lines)
    assert "Traceback" not in server.stderr_text
    entries = [json.loads(line) for line in lines]
    assert not [e for e in entries if e["level"] in ("error", "critical")]
    refusals = [e for e in entries if e["event"] == "request refused: body does not decode"]
    assert 1 <= len(refusals) <= 30
    assert {"method", "cause", "peer", "body_bytes"} <= set(refusals[0])


def test_metadata_depth_limit_is_a_named_field_violation(server: ServerProcess) -> None:
    with server.channel() as ch:
        stub = server.stub(ch)
        req = pb.CreateSessionRequest(name="deep")
        req.metadata.update(_nested(17))
        try:
            stub.CreateSession(req)
            raise AssertionError("17 levels of metadata were accepted")
        except grpc.RpcError as err:
            details = error_details(err)
        assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT
        assert details["fields"] == ["metadata"]
        assert "17 levels" in details["message"] and "16" in details["message"]

        ok = pb.CreateSessionRequest(name="ok")
        ok.metadata.update(_nested(16))
        sid = stub.CreateSession(ok).id
        msg = pb.AppendMessagesRequest(session_id=sid)
        m = msg.messages.add(role=1, content="x")
        m.metadata.update({"list": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]})
        try:
            stub.AppendMessages(msg)
            raise AssertionError("18 levels of metadata were accepted")
        except grpc.RpcError as err:
            details = error_details(err)
        assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT
        assert details["fields"] == ["messages[0].metadata"]

        # Past what the decoder accepts at all: still INVALID_ARGUMENT, with the cause named.
        too_deep = pb.CreateSessionRequest(name="deeper")
        too_deep.metadata.update(_nested(40))
        try:
            stub.CreateSession(too_deep)
            raise AssertionError("40 levels decoded")
        except grpc.RpcError as err:
            details = error_details(err)
        assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT
        assert details["reason"] == "UNDECODABLE_REQUEST"
        assert details["metadata"]["cause"] == "too_deep"
        assert details["fields"] == ["request"]
