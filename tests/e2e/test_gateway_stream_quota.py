"""A socket whose event stream the service refuses for the per-user streams quota
(``quotas.streams_per_user``) is closed 1013 (try again later), not left open and deaf: the gateway
retried the stream in the background while the page waited for events that never came."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
from tests.support.gateway import Process, bundled_gateway
from tests.support.rpc import user

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def one_stream() -> Iterator[Process]:
    env = {"CONTEXTSVC_QUOTAS__STREAMS_PER_USER": "1", "CONTEXTSVC_GATEWAY__HUB_LINGER_SECONDS": "0"}
    with bundled_gateway(env) as proc:
        yield proc


async def recv(ws: ClientConnection) -> dict[str, Any]:
    frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert isinstance(frame, dict)
    return frame


async def closed_with(ws: ClientConnection) -> tuple[int | None, str | None]:
    with pytest.raises(ConnectionClosed):
        for _ in range(100):  # bounded: frames before the close
            await asyncio.wait_for(ws.recv(), 10)
    return ws.close_code, ws.close_reason


async def test_a_socket_over_the_stream_quota_is_closed_1013_and_gets_in_once_a_stream_is_free(
    one_stream: Process,
) -> None:
    with grpc.insecure_channel(one_stream.grpc_address) as channel:
        stub = ContextServiceStub(channel)
        first, second = (stub.CreateSession(pb.CreateSessionRequest(name=n)).id for n in ("first", "second"))
        async with connect(one_stream.ws_url(first)) as holder:  # its hub holds the user's one stream
            assert (await recv(holder))["type"] == "session_sync"
            async with connect(one_stream.ws_url(second)) as ws:
                code, reason = await closed_with(ws)
                assert code == 1013 and "try again" in (reason or "")
        # The holder left (no linger): the stream is free, and a reconnect is served, live.
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while True:  # the service frees a cancelled stream's slot a moment after the cancel
            async with connect(one_stream.ws_url(second)) as ws:
                try:
                    frame = await recv(ws)
                except ConnectionClosed:
                    assert ws.close_code == 1013
                else:
                    assert frame["type"] == "session_sync"
                    stub.AppendMessages(pb.AppendMessagesRequest(session_id=second, messages=[user("hi")]))
                    assert (await recv(ws))["type"] == "messages_appended"
                    break
            assert loop.time() < end, "the stream slot was never freed"
            await asyncio.sleep(0.2)
