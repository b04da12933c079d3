"""The Python client's retry rule and per-call tokens, against an in-process gRPC server whose
handlers fail on purpose (UNAVAILABLE with or without a "not started" ErrorInfo reason).

Idempotent calls keep the old behaviour (retried on UNAVAILABLE); calls that could be applied twice
(CreateSession, ForkSession, DeleteSession, RecordBaseline, Compress for real, AppendMessages
without a request id) are retried only when the server says it did not start them."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from contextsvc import errors
from contextsvc.client import ContextClient, RetryPolicy
from contextsvc.v1 import context_service_pb2 as pb
from contextsvc.v1 import context_service_pb2_grpc as pb_grpc
from contextsvc.v1 import resources_pb2

FAST = RetryPolicy(max_attempts=4, initial_backoff=0.001, max_backoff=0.01)


class Flaky(pb_grpc.ContextServiceServicer):
    """Every call fails ``failures`` times with UNAVAILABLE (reason ``reason``, none if empty), then works."""

    def __init__(self) -> None:
        self.failures = 0
        self.reason = ""
        self.calls: Counter[str] = Counter()
        self.tokens: list[str] = []

    async def _maybe_fail(self, name: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.calls[name] += 1
        self.tokens.append(dict(context.invocation_metadata() or ()).get("authorization", ""))
        if self.calls[name] <= self.failures:
            status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message="try again")
            if self.reason:
                detail = any_pb2.Any()
                detail.Pack(error_details_pb2.ErrorInfo(reason=self.reason, domain="contextsvc.test"))
                status.details.append(detail)
            await context.abort_with_status(rpc_status.to_status(status))

    async def GetSession(self, request: Any, context: Any) -> resources_pb2.Session:
        await self._maybe_fail("GetSession", context)
        return resources_pb2.Session(id=request.session_id)

    async def CreateSession(self, request: Any, context: Any) -> resources_pb2.Session:
        await self._maybe_fail("CreateSession", context)
        return resources_pb2.Session(id="new")

    async def AppendMessages(self, request: Any, context: Any) -> pb.AppendMessagesResponse:
        await self._maybe_fail("AppendMessages", context)
        return pb.AppendMessagesResponse(sequence_numbers=[1])

    async def Compress(self, request: Any, context: Any) -> pb.CompressResponse:
        await self._maybe_fail("Compress", context)
        return pb.CompressResponse(compressed=not request.dry_run)

    async def ForkSession(self, request: Any, context: Any) -> resources_pb2.Session:
        await self._maybe_fail("ForkSession", context)
        return resources_pb2.Session(id="fork")


@pytest.fixture
async def flaky() -> AsyncIterator[tuple[Flaky, ContextClient]]:
    servicer = Flaky()
    server = grpc.aio.server()
    pb_grpc.add_ContextServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = ContextClient(f"127.0.0.1:{port}", token="owner", timeout=10, retry=FAST)
    try:
        yield servicer, client
    finally:
        await client.close()
        await server.stop(0)


async def test_idempotent_calls_are_retried_on_unavailable(flaky: tuple[Flaky, ContextClient]) -> None:
    servicer, client = flaky
    servicer.failures = 2
    assert (await client.get_session("s"))["id"] == "s"
    # The client's own appends carry a generated request id: retried, applied once by the server.
    assert (await client.append_messages("s", [{"role": "user", "content": "x"}]))["sequence_numbers"] == [1]
    assert (await client.compress("s", dry_run=True))["compressed"] is False
    assert servicer.calls == Counter({"GetSession": 3, "AppendMessages": 3, "Compress": 3})


@pytest.mark.parametrize(
    ("method", "request_"),
    [
        ("CreateSession", pb.CreateSessionRequest()),
        ("ForkSession", pb.ForkSessionRequest(session_id="s")),
        ("Compress", pb.CompressRequest(session_id="s")),
        ("AppendMessages", pb.AppendMessagesRequest(session_id="s", messages=[resources_pb2.Message(content="x")])),
    ],
)
async def test_calls_that_could_apply_twice_are_not_retried_on_a_plain_unavailable(
    flaky: tuple[Flaky, ContextClient], method: str, request_: Any
) -> None:
    servicer, client = flaky
    servicer.failures = 1
    with pytest.raises(errors.Unavailable):
        await client.call(method, request_)
    assert servicer.calls[method] == 1
    # ... but they are when the server says it refused them before starting (draining, store not ready).
    servicer.calls.clear()
    servicer.reason = "SHUTTING_DOWN"
    await client.call(method, request_)
    assert servicer.calls[method] == 2


async def test_named_methods_follow_the_same_rule(flaky: tuple[Flaky, ContextClient]) -> None:
    servicer, client = flaky
    servicer.failures = 1
    for call in (client.create_session(), client.fork_session("s"), client.compress("s")):
        with pytest.raises(errors.Unavailable):
            await call
    assert servicer.calls == Counter({"CreateSession": 1, "ForkSession": 1, "Compress": 1})
    # An append with a caller's request id is still retried.
    await client.append_messages("s", [{"role": "user", "content": "x"}], request_id="r-1")
    assert servicer.calls["AppendMessages"] == 2


async def test_with_token_sends_another_token_on_the_same_channel(flaky: tuple[Flaky, ContextClient]) -> None:
    servicer, client = flaky
    alice, anonymous = client.with_token("alice-token"), client.with_token(None)
    assert alice._channel is client._channel
    await alice.get_session("a")
    await anonymous.call("GetSession", pb.GetSessionRequest(session_id="b"))
    await client.get_session("c")
    assert servicer.tokens == ["Bearer alice-token", "", "Bearer owner"]
    await alice.close()  # a view does not close the shared channel
    assert (await client.get_session("d"))["id"] == "d"


async def test_call_checks_the_method_and_request_type(flaky: tuple[Flaky, ContextClient]) -> None:
    _, client = flaky
    with pytest.raises(ValueError, match="not a unary RPC"):
        await client.call("StreamEvents", pb.StreamEventsRequest())
    with pytest.raises(ValueError, match="not a unary RPC"):
        await client.call("Nope", pb.GetSessionRequest())
    with pytest.raises(TypeError, match="GetSessionRequest"):
        await client.call("GetSession", pb.CreateSessionRequest())
