"""The public async Python client (contextsvc.client) against a real ``contextsvc serve``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from contextsvc import errors
from contextsvc.client import ContextClient, RetryPolicy, TLSOptions, from_plain, to_plain
from contextsvc.v1 import context_service_pb2, events_pb2, resources_pb2
from tests.support.server import ServerProcess
from tests.support.tcp_proxy import TcpProxy

FAST = RetryPolicy(max_attempts=8, initial_backoff=0.05, max_backoff=0.5, max_reconnects=20)
# gRPC's own reconnect backoff starts at 1 s; tests shorten it so a retry reaches a restored port.
CHANNEL = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
)
PNG_1X1 = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360f8cfc0000003010100c9fe92ef0000000049454e44ae426082"
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("memory").start() as proc:
        yield proc


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[ContextClient]:
    async with ContextClient(server.address, timeout=10, retry=FAST) as c:
        yield c


@pytest.fixture
async def proxy(server: ServerProcess) -> AsyncIterator[TcpProxy]:
    p = await TcpProxy(server.address).start()
    try:
        yield p
    finally:
        await p.close()


async def test_every_rpc_in_plain_shapes(client: ContextClient) -> None:
    s = await client.create_session(name="demo", metadata={"team": "core", "n": 2})
    assert s["name"] == "demo" and s["metadata"] == {"team": "core", "n": 2.0}
    assert isinstance(s["create_time"], datetime) and s["create_time"].tzinfo is not None
    sid = s["id"]
    appended = await client.append_messages(
        sid,
        [
            {"role": "user", "content": "read main.py", "images": [PNG_1X1]},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "read", "arguments_json": "{}"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "print('hi')", "metadata": {"source": "fs"}},
        ],
        turn_complete=True,
    )
    assert appended["sequence_numbers"] == [1, 2, 3] and isinstance(appended["context_tokens"], int)
    page = await client.list_messages(sid, buffer="context")
    roles = [m["role"] for m in page["messages"]]
    assert roles == ["user", "assistant", "tool"]
    image = page["messages"][0]["images"][0]
    assert image["mime_type"] == "image/png" and image["width"] == 1
    assert page["messages"][2]["flags"]["is_context"] is True
    view = await client.build_context(sid, profile={"model": "m", "system_prompt": "be brief"}, phase="pre_turn")
    assert view["messages"][0]["content"] == "be brief" and view["estimate"]["method"] is not None
    assert view["compression"] is None
    recorded = await client.record_baseline(sid, view["view_id"], view["estimate"]["total"])
    assert recorded["recorded"] is True and recorded["calibration"]["model"] == "m"
    est = await client.estimate_tokens(messages=[{"role": "user", "content": "x" * 100}], model="m")
    assert est["estimate"]["total"] > 0
    renamed = await client.update_session(sid, name="renamed", pinned=True)
    assert renamed["name"] == "renamed" and renamed["pinned"] is True and renamed["metadata"] == s["metadata"]
    listed = await client.list_sessions(query="renamed")
    assert [x["id"] for x in listed["sessions"]] == [sid]
    fork = await client.fork_session(sid, at_sequence=2)
    assert fork["display_message_count"] == 2
    assert (await client.search_history(sid, "main"))["chunks"] == []
    await client.delete_session(fork["id"])
    with pytest.raises(errors.NotFound) as err:
        await client.get_session(fork["id"])
    assert err.value.code.name == "NOT_FOUND"  # type: ignore[attr-defined]


async def test_typed_errors_carry_the_error_info_reason(client: ContextClient) -> None:
    sid = (await client.create_session())["id"]
    with pytest.raises(errors.NothingToCompact) as nothing:
        await client.compress(sid)
    assert nothing.value.reason == "NOTHING_TO_COMPACT" and isinstance(nothing.value, errors.FailedPrecondition)
    assert nothing.value.domain == "contextsvc.dev"  # type: ignore[attr-defined]
    with pytest.raises(errors.InvalidArgument) as bad:
        await client.append_messages(sid, [{"role": "user", "content": "x"}, {"content": "no role"}])
    assert bad.value.violations and bad.value.violations[0].field.startswith("messages[1]")
    with pytest.raises(errors.NotFound) as missing:
        await client.expand_summary(sid, 999)
    assert missing.value.reason  # MESSAGE_NOT_FOUND or NOT_FOUND: a reason always arrives
    with pytest.raises(ValueError, match=r"unknown value .robot."):
        await client.append_messages(sid, [{"role": "robot", "content": "x"}])


async def test_request_id_reuse_and_quotas_arrive_as_their_own_errors(client: ContextClient, tmp_path: Path) -> None:
    """Errors whose classes the server builds from what it knew (a request id, a limit) are made
    from the status alone here: a reused request id, a quota with its subject and its delay."""
    sid = (await client.create_session())["id"]
    await client.append_messages(sid, [{"role": "user", "content": "a"}], request_id="rid-1")
    with pytest.raises(errors.RequestIdReused) as reused:
        await client.append_messages(sid, [{"role": "user", "content": "b"}], request_id="rid-1")
    assert reused.value.reason == "REQUEST_ID_REUSED" and isinstance(reused.value, errors.InvalidArgument)
    assert [v.field for v in reused.value.violations] == ["request_id"]
    assert reused.value.metadata["request_id"] == "rid-1"
    env = {"CONTEXTSVC_QUOTAS__STREAMS_PER_USER": "1"}
    with ServerProcess(f"files:{tmp_path / 'data'}", env=env).start() as limited:
        async with ContextClient(limited.address, timeout=10, retry=RetryPolicy(max_attempts=1)) as c:
            other = (await c.create_session())["id"]
            first = c.events(other)
            opened = asyncio.create_task(first.__anext__())
            await asyncio.sleep(0.3)  # the first stream is open and counted
            with pytest.raises(errors.ResourceExhausted) as quota:
                await c.events(other).__anext__()
            opened.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await opened
            await first.aclose()
    assert quota.value.reason == "QUOTA_EXCEEDED" and quota.value.limit == "streams_per_user"
    assert quota.value.subject == "user:anonymous"
    assert quota.value.retry_after_seconds > 0
    assert quota.value.retry_delay == quota.value.retry_after_seconds  # type: ignore[attr-defined]


async def test_deadline_is_enforced() -> None:
    # A listener that accepts TCP but never speaks HTTP/2: the call can only end by its deadline
    # (a 1 µs deadline against a real server sometimes lost the race to a fast loopback answer).
    with socket.create_server(("127.0.0.1", 0)) as mute:
        port = mute.getsockname()[1]
        async with ContextClient(f"127.0.0.1:{port}", retry=RetryPolicy(max_attempts=1)) as c:
            started = asyncio.get_running_loop().time()
            with pytest.raises(errors.Unavailable) as err:
                await c.list_sessions(timeout=0.3)
            waited = asyncio.get_running_loop().time() - started
    assert err.value.code.name == "DEADLINE_EXCEEDED"  # type: ignore[attr-defined]
    assert err.value.reason == "DEADLINE_EXCEEDED"  # no ErrorInfo: the code's name, as in Go and TypeScript
    assert waited < 10  # ended by the 0.3 s deadline, not by a hang


async def test_bearer_token_is_sent(server: ServerProcess) -> None:
    """The server ignores tokens until authentication lands; the header must still be well formed."""
    async with ContextClient(server.address, token="t0ken") as c:
        assert c._metadata == (("authorization", "Bearer t0ken"),)
        assert (await c.create_session())["id"]


async def test_a_token_read_with_its_line_end_is_sent_without_it(server: ServerProcess) -> None:
    # A token read from a file (a mounted secret) ends with a newline: gRPC refused the header with
    # a bare ExecuteBatchError, not a typed error. Node's Headers trim it; so does every client now.
    async with ContextClient(server.address, token="t0ken\n", timeout=10) as c:
        assert c._metadata == (("authorization", "Bearer t0ken"),)
        assert (await c.create_session())["id"]
        assert (await c.with_token(" t0ken\r\n").create_session())["id"]


@pytest.mark.parametrize("token", ["t\u00f6ken", "tok\x00en", "tok\ten"])
async def test_a_token_no_header_can_carry_is_unauthenticated_token_invalid(server: ServerProcess, token: str) -> None:
    # gRPC refused such a header with its untyped ExecuteBatchError; the service and the gateway
    # call such a token TOKEN_INVALID, and so does the client, for calls and event streams alike.
    async with ContextClient(server.address, timeout=10) as c:
        sid = (await c.create_session())["id"]
        for client in (ContextClient(server.address, token=token, timeout=10), c.with_token(token)):
            async with client:
                with pytest.raises(errors.Unauthenticated) as refused:
                    await client.get_session(sid)
                assert refused.value.reason == "TOKEN_INVALID"
                assert refused.value.code.name == "UNAUTHENTICATED"  # type: ignore[attr-defined]
                with pytest.raises(errors.Unauthenticated):
                    await anext(client.events(sid))
        assert (await c.get_session(sid))["id"] == sid  # the channel is fine


async def test_unavailable_is_retried_until_the_server_is_reachable(proxy: TcpProxy) -> None:
    async with ContextClient(proxy.address, timeout=10, retry=FAST, channel_options=CHANNEL) as c:
        sid = (await c.create_session())["id"]
        await proxy.stop_listening()
        restore = asyncio.get_running_loop().call_later(0.4, lambda: asyncio.ensure_future(proxy.start()))
        appended = await c.append_messages(sid, [{"role": "user", "content": "after the outage"}])
        restore.cancel()
        assert appended["sequence_numbers"] == [1]
        # Without retries the same outage is a typed Unavailable.
        await proxy.stop_listening()
        async with ContextClient(
            proxy.address, timeout=5, retry=RetryPolicy(max_attempts=1), channel_options=CHANNEL
        ) as once:
            with pytest.raises(errors.Unavailable):
                await once.get_session(sid)


async def test_calls_reach_a_server_soon_after_it_is_back_with_the_default_channel(proxy: TcpProxy) -> None:
    """A restart of a few seconds: with gRPC's own reconnect backoff (1 s, growing 1.6x toward
    120 s) the channel went on failing calls for seconds after the server was back. The client's
    defaults cap it (``RetryPolicy.max_reconnect_backoff``), with no channel options given."""
    async with ContextClient(proxy.address, timeout=5, retry=RetryPolicy(max_attempts=1)) as c:
        sid = (await c.create_session())["id"]
        await proxy.stop_listening()
        loop = asyncio.get_running_loop()
        down_until = loop.time() + 6.0
        while loop.time() < down_until:  # calls fail meanwhile, as an agent's would
            with contextlib.suppress(errors.Unavailable):
                await c.get_session(sid)
            await asyncio.sleep(0.2)
        await proxy.start()
        back = loop.time()
        while True:
            try:
                await c.get_session(sid)
                break
            except errors.Unavailable:
                assert loop.time() - back < 8.0, "never reconnected"
                await asyncio.sleep(0.05)
        assert loop.time() - back < 2.0


def test_a_client_made_before_the_event_loop_runs_works_in_it(server: ServerProcess) -> None:
    # The README makes its client at module level, then runs `asyncio.run(main())`: grpc.aio binds a
    # channel to the loop current when it is made, and that call failed "attached to a different loop".
    client = ContextClient(server.address, timeout=10)

    async def main() -> str:
        async with client:
            session = await client.create_session(name="made early")
            return str((await client.get_session(session["id"]))["name"])

    assert asyncio.run(main()) == "made early"


async def test_a_closed_client_refuses_calls_and_opens_no_channel(server: ServerProcess) -> None:
    # Closed before its first call, a client opened a channel on the next one that nothing closed;
    # closed after one, its calls failed with grpc's untyped UsageError.
    for used_first in (False, True):
        client = ContextClient(server.address, timeout=10)
        if used_first:
            await client.list_sessions()
        await client.close()
        with pytest.raises(RuntimeError, match="closed"):
            await client.list_sessions()
        assert client._conn._channel is None or used_first


async def test_calls_and_streams_cut_off_by_close_raise_runtime_error_not_cancelled_error(
    server: ServerProcess,
) -> None:
    # grpc.aio cancels the calls of a channel it closes: they raised asyncio.CancelledError in tasks
    # nobody cancelled (which then ended as cancelled, past every ``except Exception``). A task that
    # is itself cancelled still gets its CancelledError.
    client = ContextClient(server.address, timeout=10)
    sid = (await client.create_session())["id"]
    await client.append_messages(sid, [{"role": "user", "content": "one"}])
    events = client.events(sid, after_event_id=1)
    assert (await anext(events))["payload"] == "messages_appended"  # the stream is open
    waiting = asyncio.create_task(anext(events))
    held: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda r, w: held.append(w), "127.0.0.1", 0)  # accepts, never answers
    port = silent.sockets[0].getsockname()[1]
    stuck = ContextClient(f"127.0.0.1:{port}", timeout=30)
    calls = [asyncio.create_task(stuck.list_sessions()) for _ in range(2)]
    try:
        await asyncio.sleep(0.3)  # every call is in flight
        assert not waiting.done() and not any(c.done() for c in calls)
        calls[1].cancel()
        await asyncio.gather(client.close(), stuck.close())
        for task in (waiting, calls[0]):
            with pytest.raises(RuntimeError, match="closed"):
                await asyncio.wait_for(task, 10)
        with pytest.raises(asyncio.CancelledError):
            await calls[1]
    finally:
        for writer in held:
            writer.close()
        silent.close()


async def test_request_ids_make_appends_idempotent(client: ContextClient) -> None:
    sid = (await client.create_session())["id"]
    events = asyncio.create_task(_collect(client.events(sid), 2))
    await asyncio.sleep(0.3)  # the stream is live before the appends
    first = await client.append_messages(sid, [{"role": "user", "content": "a"}], request_id="r-1")
    again = await client.append_messages(sid, [{"role": "user", "content": "a"}], request_id="r-1")
    assert first["sequence_numbers"] == again["sequence_numbers"] == [1]
    await client.append_messages(sid, [{"role": "user", "content": "b"}])
    ids = [e["messages_appended"]["request_id"] for e in await asyncio.wait_for(events, 10)]
    assert ids[0] == "r-1" and len(ids[1]) == 36 and ids[1] != ids[0]  # generated uuid


async def test_events_resume_after_a_dropped_stream(client: ContextClient, proxy: TcpProxy) -> None:
    sid = (await client.create_session())["id"]
    seen: list[dict[str, Any]] = []
    async with ContextClient(proxy.address, timeout=10, retry=FAST, channel_options=CHANNEL) as watcher:

        async def watch() -> None:
            async for event in watcher.events(sid):
                seen.append(event)
                if event["payload"] == "session_deleted":
                    return

        task = asyncio.create_task(watch())
        await asyncio.sleep(0.3)
        for i in range(3):
            await client.append_messages(sid, [{"role": "user", "content": f"m{i}"}])
        await _until(lambda: len(seen) == 3)
        await proxy.drop()  # the stream dies mid-flight
        for i in range(3, 6):
            await client.append_messages(sid, [{"role": "user", "content": f"m{i}"}])
        await proxy.drop()  # and again, while the events are being delivered
        await _until(lambda: len(seen) == 6)
        await client.delete_session(sid)
        await asyncio.wait_for(task, 15)
    kinds = [e["payload"] for e in seen]
    assert kinds == ["messages_appended"] * 6 + ["session_deleted"]
    seqs = [e["messages_appended"]["sequence_numbers"][0] for e in seen[:6]]
    assert seqs == [1, 2, 3, 4, 5, 6]  # no gap, no duplicate
    ids = [e["event_id"] for e in seen]
    assert ids == sorted(set(ids))


async def test_events_give_up_after_the_reconnect_cap(server: ServerProcess, proxy: TcpProxy) -> None:
    policy = RetryPolicy(initial_backoff=0.01, max_backoff=0.02, max_reconnects=3)
    async with ContextClient(proxy.address, retry=policy, channel_options=CHANNEL) as c:
        await proxy.stop_listening()
        with pytest.raises(errors.Unavailable):
            async for _ in c.events():
                pass


async def test_what_the_server_accepts_can_be_read_back(client: ContextClient) -> None:
    """A message at the content limit (4 Mi characters) and a view carrying a 5 MB image are over
    gRPC's default 4 MiB receive limit: the client reads what the server sends (up to its 64 MiB)."""
    sid = (await client.create_session(name="big"))["id"]
    content = "a" * (4 * 1024 * 1024)
    await client.append_messages(sid, [{"role": "user", "content": content}])
    page = await client.list_messages(sid, page_size=1)
    assert page["messages"][0]["content"] == content
    shot = PNG_1X1 + bytes(5 * 1024 * 1024)  # a readable header; the bytes after it are not looked at
    sid = (await client.create_session(name="screenshot"))["id"]
    await client.append_messages(sid, [{"role": "user", "content": "what is on screen?", "images": [shot]}])
    view = await client.build_context(sid, profile={"vision": True})
    assert [len(i["data"]) for m in view["messages"] for i in m["images"]] == [len(shot)]


def test_plain_round_trip_of_a_message() -> None:
    plain = {
        "role": "assistant",
        "content": "hi",
        "flags": {"is_context": False, "is_pinned": True},
        "metadata": {"source": "x"},
        "tool_calls": [{"id": "1", "name": "n", "arguments_json": "{}"}],
    }
    msg = from_plain(resources_pb2.Message, plain)
    assert msg.role == resources_pb2.ROLE_ASSISTANT and msg.flags.HasField("is_context")
    back = to_plain(msg)
    assert back["role"] == "assistant" and back["flags"]["is_context"] is False
    assert back["flags"]["is_display"] is None  # unset proto3 optional stays distinguishable
    assert back["create_time"] is None and back["replaces"] is None
    req = from_plain(context_service_pb2.BuildContextRequest, {"session_id": "s", "phase": "mid_turn"})
    assert req.phase == context_service_pb2.PHASE_MID_TURN and not req.HasField("auto_compress")


def test_plain_round_trip_of_an_event() -> None:
    """``to_plain`` names a oneof's set member under the oneof's name; ``from_plain`` takes it back."""
    event = events_pb2.Event(event_id=7, session_id="s")
    event.messages_appended.sequence_numbers.extend([3, 4])
    plain = to_plain(event)
    assert plain["payload"] == "messages_appended"
    assert from_plain(events_pb2.Event, plain) == event
    deleted = events_pb2.Event(event_id=8)
    deleted.session_deleted.SetInParent()
    assert from_plain(events_pb2.Event, {"event_id": 8, "payload": "session_deleted"}) == deleted
    with pytest.raises(TypeError, match="payload"):
        from_plain(events_pb2.Event, {"payload": "no_such_event"})


async def _collect(it: AsyncIterator[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async for item in it:
        out.append(item)
        if len(out) == n:
            break
    return out


async def _until(cond: Any, limit: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.02)


def test_tls_mutual_tls_and_tokens(tmp_path: Path) -> None:
    """The client's TLS options and bearer token against a server serving TLS with token auth."""
    from tests.e2e.test_tls import _token
    from tests.support.certs import Authority

    folder = tmp_path / "pki"
    server_ca, client_ca = Authority("server CA"), Authority("client CA")
    cert, key = server_ca.server().write(folder, "server")
    (folder / "clients.pem").write_bytes(client_ca.pem)
    alice = client_ca.client("alice-laptop")
    token = _token(tmp_path / "data")
    tls = TLSOptions(root_certificates=server_ca.pem)
    mtls = TLSOptions(root_certificates=server_ca.pem, certificate_chain=alice.cert, private_key=alice.key)

    async def calls(address: str) -> None:
        async with ContextClient(address, tls=tls, token=token, timeout=10) as c:
            assert (await c.create_session(name="over tls"))["user_id"] == "alice"
        async with ContextClient(address, tls=tls, timeout=10) as anonymous:
            with pytest.raises(errors.Unauthenticated):
                await anonymous.list_sessions()
            # A per-call token on the same channel: the server sees alice, then nobody again.
            alice = anonymous.with_token(token)
            assert [s["name"] for s in (await alice.list_sessions())["sessions"]] == ["over tls"]
            assert (await alice.call("ListSessions", context_service_pb2.ListSessionsRequest())).sessions
            with pytest.raises(errors.Unauthenticated):
                await anonymous.list_sessions()
        async with ContextClient(address, timeout=5, retry=RetryPolicy(max_attempts=1)) as plaintext:
            with pytest.raises(errors.Unavailable):
                await plaintext.list_sessions()

    async def mutual(address: str) -> None:
        async with ContextClient(address, tls=mtls, timeout=10) as c:
            assert (await c.create_session())["id"]

    args = ["--tls-cert", str(cert), "--tls-key", str(key)]
    proc = ServerProcess(f"files:{tmp_path / 'data'}", extra_args=[*args, "--auth", "tokens"]).start()
    try:
        asyncio.run(calls(proc.address))
    finally:
        proc.kill()
    proc = ServerProcess(
        f"files:{tmp_path / 'data2'}", extra_args=[*args, "--tls-client-ca", str(folder / "clients.pem")]
    )
    try:
        asyncio.run(mutual(proc.start().address))
    finally:
        proc.kill()
