"""AppendMessages.request_id over a real server: a retry replays, a reuse with another body is refused."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.rpc import all_messages, error_details, user
from tests.support.server import ServerProcess


def test_request_id_reused_with_a_different_body_appends_nothing(server: ServerProcess, stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest(name="idem")).id
    body = [user("first"), r.Message(role=r.ROLE_ASSISTANT, content="answer")]
    first = stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=body, request_id="req-1"))
    retry = stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=body, request_id="req-1"))
    assert list(first.sequence_numbers) == list(retry.sequence_numbers) == [1, 2]

    changed = [
        [user("first, edited"), body[1]],  # content
        [body[0]],  # fewer messages
        [body[0], r.Message(role=r.ROLE_ASSISTANT, content="answer", flags=r.MessageFlags(is_pinned=True))],
    ]
    for messages in changed:
        with pytest.raises(grpc.RpcError) as caught:
            stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=messages, request_id="req-1"))
        details = error_details(caught.value)
        assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT
        assert details["reason"] == "REQUEST_ID_REUSED"
        assert details["fields"] == ["request_id"]
        assert details["metadata"] == {"request_id": "req-1"}
    assert [m.content for m in all_messages(stub, sid)] == ["first", "answer"]

    # After a restart on the same files the first answer still stands, and so does the refusal.
    assert server.terminate() == 0
    server.start()
    with server.channel() as ch:
        again = server.stub(ch)
        replay = again.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=body, request_id="req-1"))
        assert list(replay.sequence_numbers) == [1, 2]
        with pytest.raises(grpc.RpcError) as caught:
            again.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=changed[0], request_id="req-1"))
        assert error_details(caught.value)["reason"] == "REQUEST_ID_REUSED"
        assert len(all_messages(again, sid)) == 2
