"""A socket reconnecting with a ``last_event_id`` the service never gave (past its newest event)
neither goes deaf itself nor takes the session's shared upstream stream down with it: the hub used
to open its stream from that id, the service refused it (INVALID_ARGUMENT) at every reopening, and
every other socket of the session got no live event again."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from websockets.asyncio.client import connect

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
from tests.support.gateway import Process, bundled_gateway, recv, recv_type
from tests.support.rpc import user

pytestmark = pytest.mark.e2e


@pytest.fixture
def bundled() -> Iterator[Process]:
    with bundled_gateway() as proc:
        yield proc


@pytest.mark.parametrize("last_event_id", ["99999999999999999999", "9000000000000000000"])
async def test_a_future_last_event_id_leaves_every_socket_live(bundled: Process, last_event_id: str) -> None:
    with grpc.insecure_channel(bundled.grpc_address) as channel:
        stub = ContextServiceStub(channel)
        sid = stub.CreateSession(pb.CreateSessionRequest(name="s")).id
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("before")]))
        async with connect(bundled.ws_url(sid, f"last_event_id={last_event_id}")) as guess:
            assert (await recv(guess))["type"] == "session_sync"
            assert await recv(guess) == {"type": "replay_start", "count": 0}
            assert (await recv(guess))["type"] == "replay_end"
            async with connect(bundled.ws_url(sid)) as other:
                assert (await recv(other))["type"] == "session_sync"
                stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("after")]))
                for ws in (guess, other):
                    event = await recv_type(ws, "messages_appended", wait=5)
                    assert event["sequence_numbers"] == [2], json.dumps(event)
