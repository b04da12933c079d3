"""``serve`` runs store maintenance by itself: removals are events, streamed sessions are spared."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from contextsvc._gen.v1 import context_service_pb2 as pb
from tests.support.rpc import user
from tests.support.server import ServerProcess

pytestmark = pytest.mark.e2e

ENV = {
    "CONTEXTSVC_MAINTENANCE__MODE": "enforce",
    "CONTEXTSVC_MAINTENANCE__MAX_SESSIONS": "2",
    "CONTEXTSVC_MAINTENANCE__INTERVAL_SECONDS": "0.5",
}


def _watch(stub: Any, session_id: str, into: list[Any], ready: threading.Event) -> grpc.Future:
    call = stub.StreamEvents(pb.StreamEventsRequest(session_id=session_id))

    def run() -> None:
        try:
            for event in call:
                into.append(event)
                ready.set()
        except grpc.RpcError:
            pass  # cancelled at the end of the test

    threading.Thread(target=run, daemon=True).start()
    return call


def test_serve_removes_over_the_cap_never_a_streamed_session_and_says_so(tmp_path: Path) -> None:
    server = ServerProcess(f"files:{tmp_path / 'data'}", env=ENV).start()
    calls = []
    try:
        with server.channel() as ch:
            stub = server.stub(ch)
            oldest = stub.CreateSession(pb.CreateSessionRequest(name="watched")).id
            on_oldest: list[Any] = []
            everything: list[Any] = []
            first, second = threading.Event(), threading.Event()
            calls.append(_watch(stub, oldest, on_oldest, first))
            calls.append(_watch(stub, "", everything, second))
            for _ in range(100):  # bounded: until both streams are live
                stub.AppendMessages(pb.AppendMessagesRequest(session_id=oldest, messages=[user("ping")]))
                if first.wait(0.1) and second.wait(0.1):
                    break
            middle = stub.CreateSession(pb.CreateSessionRequest(name="idle")).id
            newest = stub.CreateSession(pb.CreateSessionRequest(name="new")).id
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if any(e.WhichOneof("payload") == "session_deleted" for e in everything):
                    break
                time.sleep(0.1)
            deleted = [e.session_id for e in everything if e.WhichOneof("payload") == "session_deleted"]
            assert deleted == [middle]
            (event,) = [e for e in everything if e.WhichOneof("payload") == "session_deleted"]
            assert event.session_deleted.reason == "max_sessions"  # the rule; the words in detail
            assert "max_sessions 2" in event.session_deleted.detail
            with pytest.raises(grpc.RpcError) as raised:
                stub.GetSession(pb.GetSessionRequest(session_id=middle))
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND
            for sid in (oldest, newest):  # the streamed one stays although it is the longest idle
                assert stub.GetSession(pb.GetSessionRequest(session_id=sid)).id == sid
            for call in calls:
                call.cancel()
    finally:
        assert server.terminate() == 0
    assert "maintenance removed a session" in server.stderr_text
