"""The auth interceptor in process (a grpc.aio server on loopback, memory store): each refusal's
status and ErrorInfo, the principal reaching the stores, and the audit lines of admin access."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from contextsvc import errors
from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
from contextsvc.api.errors import DOMAIN
from contextsvc.config import Settings
from contextsvc.core.credentials import issue
from contextsvc.server import RunningServer, start, stop
from contextsvc.stores.token_access import tokens_of


@pytest.fixture
async def running() -> AsyncIterator[RunningServer]:
    settings = Settings(store="memory", listen="127.0.0.1:0", auth={"mode": "tokens", "cache_seconds": 0})
    server = await start(settings)
    try:
        yield server
    finally:
        await stop(server, 0)


async def _token(server: RunningServer, user: str, *, admin: bool = False, **times: datetime) -> str:
    now = datetime.now(UTC)
    issued = issue(user=user, is_admin=admin, now=now, expire_time=times.get("expires"))
    await tokens_of(server.store).add_api_token(issued.record)
    if "revoked" in times:
        await tokens_of(server.store).revoke_api_token(issued.record.token_id, times["revoked"])
    return issued.secret


def _info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    assert len(infos) == 1
    info = error_details_pb2.ErrorInfo()
    infos[0].Unpack(info)
    return info


async def test_each_refusal_is_unauthenticated_with_its_reason(running: RunningServer) -> None:
    now = datetime.now(UTC)
    good = await _token(running, "alice")
    expired = await _token(running, "alice", expires=now - timedelta(seconds=1))
    revoked = await _token(running, "alice", revoked=now)
    cases = {
        None: "TOKEN_MISSING",
        "Basic YWxpY2U6cHc=": "TOKEN_INVALID",
        "Bearer ctx_short": "TOKEN_INVALID",
        f"Bearer {good[:-1]}A" if good[-1] != "A" else f"Bearer {good[:-1]}B": "TOKEN_INVALID",
        f"Bearer {expired}": "TOKEN_EXPIRED",
        f"Bearer {revoked}": "TOKEN_REVOKED",
    }
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = ContextServiceStub(channel)
        for header, reason in cases.items():
            md = [("authorization", header)] if header else None
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ListSessions(pb.ListSessionsRequest(), metadata=md)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = _info(caught.value)
            assert (info.reason, info.domain) == (reason, DOMAIN)
            assert header is None or header.split()[-1] not in (caught.value.details() or "")
            stream = stub.StreamEvents(pb.StreamEventsRequest(), metadata=md)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stream.read()
            assert _info(caught.value).reason == reason
        created = await stub.CreateSession(
            pb.CreateSessionRequest(name="mine"), metadata=[("authorization", f"Bearer {good}")]
        )
        assert created.user_id == "alice"


async def test_admin_access_to_another_users_session_is_one_audit_line(
    running: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    alice = [("authorization", f"Bearer {await _token(running, 'alice')}")]
    root = [("authorization", f"Bearer {await _token(running, 'root', admin=True)}")]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = ContextServiceStub(channel)
        sid = (await stub.CreateSession(pb.CreateSessionRequest(), metadata=alice)).id
        mine = (await stub.CreateSession(pb.CreateSessionRequest(), metadata=root)).id
        with caplog.at_level(logging.INFO, logger="contextsvc.audit"):
            await stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=alice)  # the owner: nothing
            await stub.GetSession(pb.GetSessionRequest(session_id=mine), metadata=root)  # the admin's own: nothing
            assert not [r for r in caplog.records if r.name == "contextsvc.audit"]
            await stub.BuildContext(pb.BuildContextRequest(session_id=sid), metadata=root)
            await stub.ListSessions(pb.ListSessionsRequest(), metadata=root)
        audit = [r for r in caplog.records if r.name == "contextsvc.audit"]
        foreign = [r for r in audit if r.getMessage() == "admin read of another user's session"]
        assert len(foreign) == 1  # once per call, however often the store checked
        assert (foreign[0].user, foreign[0].owner, foreign[0].method, foreign[0].session_id) == (  # type: ignore[attr-defined]
            "root",
            "alice",
            "BuildContext",
            sid,
        )
        assert [r.method for r in audit if r.getMessage() == "admin read across users"] == ["ListSessions"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("quiet", [False, True], ids=["events-flowing", "idle"])
async def test_an_open_stream_ends_once_its_token_is_revoked(quiet: bool) -> None:
    # A token checked only when the stream opened kept delivering events after its revocation.
    settings = Settings(
        store="memory", listen="127.0.0.1:0", auth={"mode": "tokens", "cache_seconds": 0, "stream_check_seconds": 0.2}
    )
    server = await start(settings)
    try:
        now = datetime.now(UTC)
        issued = issue(user="alice", is_admin=False, now=now, expire_time=None)
        tokens = tokens_of(server.store)
        await tokens.add_api_token(issued.record)
        md = [("authorization", f"Bearer {issued.secret}")]
        root = issue(user="root", is_admin=True, now=now, expire_time=None)
        await tokens.add_api_token(root.record)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = ContextServiceStub(channel)
            sid = (await stub.CreateSession(pb.CreateSessionRequest(), metadata=md)).id
            append = pb.AppendMessagesRequest(session_id=sid, messages=[{"role": "ROLE_USER", "content": "hi"}])
            await stub.AppendMessages(append, metadata=md)
            request = pb.StreamEventsRequest(session_id=sid, after_event_id=1)  # from the retained log
            stream = stub.StreamEvents(request, metadata=md, timeout=10)
            assert (await stream.read()).WhichOneof("payload") == "messages_appended"
            await tokens.revoke_api_token(issued.record.token_id, datetime.now(UTC))
            if not quiet:
                await asyncio.sleep(0.5)  # past the check interval: the next event finds the token revoked
                await stub.AppendMessages(append, metadata=[("authorization", f"Bearer {root.secret}")])
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stream.read()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _info(caught.value).reason == "TOKEN_REVOKED"
    finally:
        await stop(server, 0)


async def test_an_open_stream_outlives_a_token_store_that_cannot_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only a token known to be bad ends a stream: one the store could not look up (a failover, a
    # tokens file being replaced) is checked again at the next tick.
    settings = Settings(
        store="memory", listen="127.0.0.1:0", auth={"mode": "tokens", "cache_seconds": 0, "stream_check_seconds": 0.1}
    )
    server = await start(settings)
    try:
        issued = issue(user="alice", is_admin=False, now=datetime.now(UTC), expire_time=None)
        tokens = tokens_of(server.store)
        await tokens.add_api_token(issued.record)
        md = [("authorization", f"Bearer {issued.secret}")]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = ContextServiceStub(channel)
            sid = (await stub.CreateSession(pb.CreateSessionRequest(), metadata=md)).id
            append = pb.AppendMessagesRequest(session_id=sid, messages=[{"role": "ROLE_USER", "content": "hi"}])
            await stub.AppendMessages(append, metadata=md)
            stream = stub.StreamEvents(
                pb.StreamEventsRequest(session_id=sid, after_event_id=1), metadata=md, timeout=10
            )
            assert (await stream.read()).WhichOneof("payload") == "messages_appended"
            with monkeypatch.context() as patched:

                async def down(token_hash: str) -> Any:
                    raise errors.Unavailable("token store unreachable")

                patched.setattr(tokens, "find_api_token", down)
                await asyncio.sleep(0.5)  # several checks while the store cannot answer
            await stub.AppendMessages(append, metadata=md)
            assert (await stream.read()).WhichOneof("payload") == "messages_appended"
            stream.cancel()
    finally:
        await stop(server, 0)


async def test_several_authorization_values_are_refused_whatever_their_order(running: RunningServer) -> None:
    # The first value used to win: a proxy adding its own credentials after a client's (or before
    # them) decided silently whose call it was.
    alice, bob = await _token(running, "alice"), await _token(running, "bob")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = ContextServiceStub(channel)
        for first, second in ((alice, bob), (alice, alice), (alice, "ctx_" + "A" * 43)):
            md = [("authorization", f"Bearer {first}"), ("authorization", f"Bearer {second}")]
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ListSessions(pb.ListSessionsRequest(), metadata=md)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _info(caught.value).reason == "TOKEN_INVALID"
            assert first not in (caught.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.StreamEvents(pb.StreamEventsRequest(), metadata=md).read()
            assert _info(caught.value).reason == "TOKEN_INVALID"


async def test_tokens_kept_in_a_memory_store_are_a_warning_at_start(caplog: pytest.LogCaptureFixture) -> None:
    # Nothing outside the process can add a token there: every call would be refused, silently.
    settings = Settings(store="memory", listen="127.0.0.1:0", auth={"mode": "tokens"})
    with caplog.at_level(logging.WARNING, logger="contextsvc.server"):
        server = await start(settings)
        await stop(server, 0)
    warned = [r.getMessage() for r in caplog.records if r.name == "contextsvc.server" and r.levelno == logging.WARNING]
    assert any("auth.token_store" in m for m in warned), warned


async def test_a_flood_of_unknown_tokens_from_one_address_is_limited_and_known_tokens_keep_working(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every call with an unknown well-formed token cost a token lookup (a database round trip with
    PostgreSQL), however many a peer sent. Past ``auth.failures_per_peer_per_minute`` the peer's
    unknown tokens are refused RESOURCE_EXHAUSTED with RetryInfo, without a lookup, and with one
    log line; a token the server accepted from it before keeps working, and a missing token is
    still UNAUTHENTICATED (TOKEN_MISSING)."""
    import secrets

    settings = Settings(
        store="memory",
        listen="127.0.0.1:0",
        auth={"mode": "tokens", "cache_seconds": 0, "failures_per_peer_per_minute": 5},
    )
    server = await start(settings)
    try:
        good = [("authorization", f"Bearer {await _token(server, 'alice')}")]
        tokens = tokens_of(server.store)
        lookups = 0
        find = tokens.find_api_token

        async def counted(token_hash: str) -> Any:
            nonlocal lookups
            lookups += 1
            return await find(token_hash)

        assert server.authenticator is not None
        server.authenticator._tokens.find_api_token = counted  # type: ignore[method-assign]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = ContextServiceStub(channel)
            await stub.ListSessions(pb.ListSessionsRequest(), metadata=good)
            codes: list[grpc.StatusCode] = []
            with caplog.at_level(logging.INFO):
                for _ in range(40):
                    bad = [("authorization", "Bearer ctx_" + secrets.token_urlsafe(32))]
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.ListSessions(pb.ListSessionsRequest(), metadata=bad)
                    codes.append(caught.value.code())
                last = caught.value
                assert codes[:5] == [grpc.StatusCode.UNAUTHENTICATED] * 5
                assert codes[5:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 35
                assert lookups == 1 + 5  # the good token's and the five failures' only
                status = rpc_status.from_call(last)  # type: ignore[arg-type]
                assert status is not None
                retry = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
                assert len(retry) == 1
                info = error_details_pb2.RetryInfo()
                retry[0].Unpack(info)
                assert 1 <= info.retry_delay.ToTimedelta().total_seconds() <= 12  # one failure refills in 12 s
                # The token accepted before still works from the same address, looked up as ever.
                assert (await stub.ListSessions(pb.ListSessionsRequest(), metadata=good)) is not None
                assert lookups == 1 + 5 + 1
                with pytest.raises(grpc.aio.AioRpcError) as missing:
                    await stub.ListSessions(pb.ListSessionsRequest())
                assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert _info(missing.value).reason == "TOKEN_MISSING"
            lines = [r for r in caplog.records if r.name == "contextsvc.api.auth_limit"]
            assert len(lines) == 1 and lines[0].peer == "127.0.0.1"  # type: ignore[attr-defined]
    finally:
        await stop(server, 0)


def test_the_failure_limiter_refills_and_forgets_the_oldest_peer() -> None:
    from contextsvc.api.auth_limit import FailedAuthLimiter, peer_address

    assert peer_address("ipv4:10.0.0.7:5123") == "10.0.0.7"
    assert peer_address("ipv6:[::1]:5123") == "::1"
    assert peer_address("ipv6:%5B::1%5D:5123") == "::1"  # as grpc 1.85 writes it
    assert peer_address("ipv6:%5B::ffff:10.0.0.7%5D:5123") == "10.0.0.7"  # dual-stack listener
    assert peer_address("unix:/run/x.sock") == "unix:/run/x.sock"
    now = [0.0]
    limiter = FailedAuthLimiter(per_minute=3, max_peers=2, log_per_minute=10, clock=lambda: now[0])
    for _ in range(3):
        assert limiter.wait("a") == 0.0
        limiter.failed("a")
    assert limiter.wait("a") == pytest.approx(20.0)  # 3 a minute: one every 20 s
    assert limiter.wait("b") == 0.0  # another address is not affected
    now[0] = 10.0
    assert limiter.wait("a") == pytest.approx(10.0)
    now[0] = 20.0
    assert limiter.wait("a") == 0.0
    limiter.failed("b")
    limiter.failed("c")  # past max_peers: the least recently failing ("a") is forgotten
    limiter.failed("a")
    assert limiter.wait("a") == 0.0
