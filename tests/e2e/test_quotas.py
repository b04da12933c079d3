"""Per-user quotas over a real server (issue 13, item 4): RESOURCE_EXHAUSTED with QuotaFailure and
RetryInfo, and the server keeps serving once the client waits as told."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from contextsvc._gen.v1 import context_service_pb2 as pb
from tests.support.rpc import error_details
from tests.support.server import ServerProcess


def _quota_details(err: grpc.RpcError) -> tuple[list[str], float]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    subjects: list[str] = []
    delay = 0.0
    for detail in status.details:
        if detail.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
            quota = error_details_pb2.QuotaFailure()
            detail.Unpack(quota)
            subjects = [f"{v.subject} {v.description.split(':')[0]}" for v in quota.violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            delay = retry.retry_delay.ToNanoseconds() / 1e9
    return subjects, delay


def test_quotas_over_a_real_server(tmp_path: Path) -> None:
    env = {
        "CONTEXTSVC_QUOTAS__CALLS_PER_SECOND": "2",
        "CONTEXTSVC_QUOTAS__CALLS_BURST": "6",
        "CONTEXTSVC_QUOTAS__SESSIONS_PER_USER": "2",
        "CONTEXTSVC_QUOTAS__STREAMS_PER_USER": "1",
    }
    server = ServerProcess(f"files:{tmp_path / 'data'}", env=env).start()
    try:
        with server.channel() as ch:
            stub = server.stub(ch)
            first = stub.CreateSession(pb.CreateSessionRequest(name="a")).id  # call 1
            stub.CreateSession(pb.CreateSessionRequest(name="b"))  # call 2
            with pytest.raises(grpc.RpcError) as caught:  # call 3: the cap
                stub.CreateSession(pb.CreateSessionRequest(name="c"))
            details = error_details(caught.value)
            assert (details["code"], details["reason"]) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED")
            assert _quota_details(caught.value)[0] == ["user:anonymous sessions_per_user"]

            stream = stub.StreamEvents(pb.StreamEventsRequest(session_id=first))  # call 4, stays open
            time.sleep(0.3)
            with pytest.raises(grpc.RpcError) as caught:  # call 5
                next(iter(stub.StreamEvents(pb.StreamEventsRequest(session_id=first), timeout=5)))
            assert _quota_details(caught.value)[0] == ["user:anonymous streams_per_user"]
            stream.cancel()

            # The burst is spent: the call rate now refuses, and says when to come back.
            refused = None
            for _ in range(6):
                try:
                    stub.GetSession(pb.GetSessionRequest(session_id=first))
                except grpc.RpcError as err:
                    refused = err
                    break
            assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            subjects, delay = _quota_details(refused)
            assert subjects == ["user:anonymous calls_per_second"] and 0 < delay <= 0.5
            time.sleep(delay + 0.05)
            assert stub.GetSession(pb.GetSessionRequest(session_id=first)).id == first
    finally:
        server.kill()
