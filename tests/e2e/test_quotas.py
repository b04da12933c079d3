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


async def _tokens(url: str, *users: str) -> dict[str, str]:
    from datetime import UTC, datetime

    from contextsvc.config import Settings
    from contextsvc.core.credentials import issue
    from contextsvc.stores.token_access import token_store_at

    made: dict[str, str] = {}
    async with token_store_at(url, Settings()) as store:
        for name in users:
            issued = issue(user=name, is_admin=False, now=datetime.now(UTC), expire_time=None)
            await store.add_api_token(issued.record)
            made[name] = issued.secret
    return made


def test_quotas_are_per_token_user(tmp_path: Path) -> None:
    """With API tokens, each user has their own buckets and caps: one user at a limit does not
    hold another back."""
    import asyncio

    url = f"files:{tmp_path / 'data'}"
    tokens = asyncio.run(_tokens(url, "ada", "bob"))
    env = {"CONTEXTSVC_QUOTAS__SESSIONS_PER_USER": "1", "CONTEXTSVC_AUTH__CACHE_SECONDS": "0"}
    server = ServerProcess(url, extra_args=["--auth", "tokens"], env=env).start()
    try:
        with server.channel() as ch:
            stub = server.stub(ch)
            ada = [("authorization", f"Bearer {tokens['ada']}")]
            bob = [("authorization", f"Bearer {tokens['bob']}")]
            stub.CreateSession(pb.CreateSessionRequest(name="ada-1"), metadata=ada)
            with pytest.raises(grpc.RpcError) as caught:
                stub.CreateSession(pb.CreateSessionRequest(name="ada-2"), metadata=ada)
            assert _quota_details(caught.value)[0] == ["user:ada sessions_per_user"]
            assert stub.CreateSession(pb.CreateSessionRequest(name="bob-1"), metadata=bob).user_id == "bob"
            with pytest.raises(grpc.RpcError) as caught:
                stub.CreateSession(pb.CreateSessionRequest(name="none"))
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED  # no token: refused before quotas
    finally:
        server.kill()
