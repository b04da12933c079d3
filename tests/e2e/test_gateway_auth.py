"""The gateway with API tokens on (`serve --auth tokens`): the browser's token is forwarded as bearer
metadata and the service decides; cookie, first-frame auth, and the close codes of docs/websocket.md."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
from tests.support.gateway import Process, raw_get
from tests.support.rpc import user

pytestmark = pytest.mark.e2e


def create_token(store: str, name: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "contextsvc", "tokens", "create", "--user", name, "--store", store],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    store = f"files:{tmp_path_factory.mktemp('auth') / 'data'}"
    alice, bob = create_token(store, "alice"), create_token(store, "bob")
    proc = Process(
        ["serve", "--listen", "127.0.0.1:0", "--store", store, "--auth", "tokens", "--gateway", "127.0.0.1:0"],
        env={"CONTEXTSVC_GATEWAY__AUTH_TIMEOUT_SECONDS": "1"},
    ).start()
    try:
        with grpc.insecure_channel(proc.grpc_address) as channel:
            stub = ContextServiceStub(channel)
            meta = (("authorization", f"Bearer {alice}"),)
            sid = stub.CreateSession(pb.CreateSessionRequest(name="alice's"), metadata=meta).id
            yield {"proc": proc, "alice": alice, "bob": bob, "sid": sid, "stub": stub, "meta": meta}
    finally:
        proc.kill()


async def recv(ws: ClientConnection) -> dict[str, Any]:
    frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert isinstance(frame, dict)
    return frame


async def closed_with(ws: ClientConnection) -> int | None:
    with pytest.raises(ConnectionClosed):
        while True:
            await asyncio.wait_for(ws.recv(), 10)
    return ws.close_code


def cookie(token: str) -> dict[str, str]:
    return {"Cookie": f"contextsvc_token={token}"}


async def test_cookie_token_is_forwarded(world: dict[str, Any]) -> None:
    proc, sid = world["proc"], world["sid"]
    async with connect(proc.ws_url(sid), additional_headers=cookie(world["alice"])) as ws:
        assert (await recv(ws))["type"] == "session_sync"
        await ws.send(json.dumps({"type": "message", "content": "hi", "id": 1}))
        ack = await recv(ws)
        while ack["type"] != "message_ack":
            ack = await recv(ws)
        assert ack["id"] == 1


async def test_query_token_is_forwarded_and_checked(world: dict[str, Any]) -> None:
    """``?api_token=`` (DESIGN §5.9) authenticates like the cookie: the owner gets in, a wrong
    token or another user's is refused, and no token reaches the log."""
    proc, sid = world["proc"], world["sid"]
    async with connect(proc.ws_url(sid, f"api_token={world['alice']}")) as ws:
        assert (await recv(ws))["type"] == "session_sync"
    async with connect(proc.ws_url(sid, "api_token=not-a-token")) as ws:
        assert await closed_with(ws) == 4003
    async with connect(proc.ws_url(sid, f"api_token={world['bob']}")) as ws:
        assert await closed_with(ws) in (4003, 4004)
    assert world["alice"] not in proc.stderr_text and world["bob"] not in proc.stderr_text


async def test_wrong_cookie_token_closes_4003(world: dict[str, Any]) -> None:
    async with connect(world["proc"].ws_url(world["sid"]), additional_headers=cookie("not-a-token")) as ws:
        assert await closed_with(ws) == 4003


async def test_another_users_token_is_denied(world: dict[str, Any]) -> None:
    async with connect(world["proc"].ws_url(world["sid"]), additional_headers=cookie(world["bob"])) as ws:
        # The service decides: another user's session is either denied or not found for bob.
        assert await closed_with(ws) in (4003, 4004)


async def test_auth_frame_then_pipelined_frames(world: dict[str, Any]) -> None:
    async with connect(world["proc"].ws_url(world["sid"])) as ws:
        assert (await recv(ws))["type"] == "auth_required"
        # Frames right after the auth frame wait until the token is accepted, then are served.
        await ws.send(json.dumps({"type": "auth", "api_token": world["alice"]}))
        await ws.send(json.dumps({"type": "ping", "id": "p"}))
        assert [(await recv(ws))["type"] for _ in range(3)] == ["auth_ok", "session_sync", "pong"]


async def test_a_first_message_too_big_for_an_auth_frame_closes_1009_at_once(world: dict[str, Any]) -> None:
    # Before its token is known a socket may only send an auth frame: a megabyte first message is
    # refused on its header (it held max_frame_bytes, 80 MB, for the auth timeout before).
    async with connect(world["proc"].ws_url(world["sid"]), max_size=None) as ws:
        assert (await recv(ws))["type"] == "auth_required"
        await ws.send(json.dumps({"type": "auth", "api_token": world["alice"], "pad": "x" * 1_000_000}))
        assert await closed_with(ws) == 1009


async def test_a_big_message_pipelined_right_after_the_auth_frame_is_served(world: dict[str, Any]) -> None:
    # The small limit holds for the first message only: the next frame, already on its way, gets
    # max_frame_bytes again.
    content = "word " * 120_000  # 600 KB, over gateway.auth_frame_bytes
    async with connect(world["proc"].ws_url(world["sid"])) as ws:
        assert (await recv(ws))["type"] == "auth_required"
        await ws.send(json.dumps({"type": "auth", "api_token": world["alice"]}))
        await ws.send(json.dumps({"type": "message", "content": content, "id": "big"}))
        seen = []
        while not seen or seen[-1]["type"] != "message_ack":
            seen.append(await recv(ws))
            assert seen[-1]["type"] != "error", seen[-1]
        assert [f["type"] for f in seen[:2]] == ["auth_ok", "session_sync"]
    stub: ContextServiceStub = world["stub"]
    page = stub.ListMessages(pb.ListMessagesRequest(session_id=world["sid"], page_size=1), metadata=world["meta"])
    assert page.messages[0].content == content


@pytest.mark.parametrize(
    "first",
    [
        {"type": "auth", "api_token": "wrong-token"},
        {"type": "ping"},
        {"type": "auth"},
        "not json",
        # Tokens no header can carry, and frames no parser should recurse into: a wrong token.
        {"type": "auth", "api_token": "ctx_\u00e9"},
        {"type": "auth", "api_token": "ctx_a\nb"},
        '{"type": "auth", "api_token": "\\ud800"}',
        "[" * 100_000 + "]" * 100_000,
    ],
)
async def test_bad_first_frame_closes_4003(world: dict[str, Any], first: Any) -> None:
    async with connect(world["proc"].ws_url(world["sid"])) as ws:
        assert (await recv(ws))["type"] == "auth_required"
        await ws.send(first if isinstance(first, str) else json.dumps(first))
        assert await closed_with(ws) == 4003


async def test_no_auth_frame_in_time_closes_4003(world: dict[str, Any]) -> None:
    async with connect(world["proc"].ws_url(world["sid"])) as ws:
        assert (await recv(ws))["type"] == "auth_required"
        assert await closed_with(ws) == 4003  # CONTEXTSVC_GATEWAY__AUTH_TIMEOUT_SECONDS=1


async def test_unknown_session_with_a_good_token_closes_4004(world: dict[str, Any]) -> None:
    url = world["proc"].ws_url("00000000-0000-4000-8000-000000000000")
    async with connect(url, additional_headers=cookie(world["alice"])) as ws:
        assert await closed_with(ws) == 4004


def get(url: str, headers: dict[str, str]) -> tuple[int, Any]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_an_auth_frame_resume_of_a_session_deleted_meanwhile_is_answered_auth_ok_then_replayed(
    world: dict[str, Any],
) -> None:
    """The auth frame's answer comes before the replay of a deletion, as before any replay; another
    user's token gets the plain 4004 (the service does not replay another user's session)."""
    proc, stub, meta = world["proc"], world["stub"], world["meta"]
    sid = stub.CreateSession(pb.CreateSessionRequest(name="to delete"), metadata=meta).id
    async with connect(proc.ws_url(sid), additional_headers=cookie(world["alice"])) as ws:
        assert (await recv(ws))["type"] == "session_sync"
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("seen")]), metadata=meta)
        last = (await recv(ws))["event_id"]
    stub.DeleteSession(pb.DeleteSessionRequest(session_id=sid), metadata=meta)
    async with connect(proc.ws_url(sid, f"last_event_id={last}")) as ws:
        assert (await recv(ws))["type"] == "auth_required"
        await ws.send(json.dumps({"type": "auth", "api_token": world["alice"]}))
        kinds = [(await recv(ws))["type"] for _ in range(4)]
        assert kinds == ["auth_ok", "replay_start", "session_deleted", "replay_end"]
        assert await closed_with(ws) == 4004
    async with connect(proc.ws_url(sid, f"last_event_id={last}"), additional_headers=cookie(world["bob"])) as ws:
        assert await closed_with(ws) == 4004


async def test_http_session_list_needs_a_token_and_shows_only_ones_own(world: dict[str, Any]) -> None:
    url = f"{world['proc'].http_url}/api/sessions"
    status, body = await asyncio.to_thread(get, url, {})
    assert status == 401 and body["code"] == "UNAUTHENTICATED"
    status, body = await asyncio.to_thread(get, url, {"Authorization": f"Bearer {world['alice']}"})
    assert status == 200 and [s["id"] for s in body["sessions"]] == [world["sid"]]
    status, body = await asyncio.to_thread(get, url, cookie(world["bob"]))
    assert status == 200 and body["sessions"] == []
    status, body = await asyncio.to_thread(get, url, {"Authorization": "Bearer ctx_\u00e9"})
    assert status == 401 and body["reason"] == "TOKEN_INVALID"


async def test_repeated_headers_are_a_clear_refusal_not_a_gateway_failure(world: dict[str, Any]) -> None:
    # Two Authorization (or Origin) headers made the gateway fail with 500 and a logged traceback.
    proc, alice, bob = world["proc"], world["alice"], world["bob"]
    host = ("Host", proc.gateway_address)
    two_tokens = [host, ("Authorization", f"Bearer {alice}"), ("Authorization", f"Bearer {bob}")]
    status, body = await asyncio.to_thread(raw_get, proc.gateway_address, "/api/sessions", two_tokens)
    assert status == 401 and json.loads(body)["reason"] == "TOKEN_INVALID"
    assert alice not in body and bob not in body
    two_origins = [host, ("Origin", f"http://{proc.gateway_address}"), ("Origin", "http://evil.example")]
    status, _ = await asyncio.to_thread(raw_get, proc.gateway_address, "/api/sessions", two_origins)
    assert status == 403
    assert "Traceback" not in proc.stderr_text


async def test_a_foreign_or_unreadable_origin_is_refused_403(world: dict[str, Any]) -> None:
    # An Origin urlsplit cannot read ("http://[::1") failed the gateway with 500 and a traceback.
    proc, alice = world["proc"], world["alice"]
    base = [("Host", proc.gateway_address), ("Authorization", f"Bearer {alice}")]
    for origin, expected in (
        (f"http://{proc.gateway_address}", 200),
        ("http://evil.example", 403),
        ("http://[::1", 403),
        ("http://[not-an-address]:80", 403),
    ):
        status, _ = await asyncio.to_thread(raw_get, proc.gateway_address, "/api/sessions", [*base, ("Origin", origin)])
        assert status == expected, origin
    assert "Traceback" not in proc.stderr_text


async def test_a_request_target_that_does_not_parse_is_400(world: dict[str, Any]) -> None:
    # urlsplit raised on these ("Invalid IPv6 URL"): 500 and a logged traceback.
    proc = world["proc"]
    for target in ("//[::1/api/sessions", "http://[::1/api/sessions"):
        status, _ = await asyncio.to_thread(raw_get, proc.gateway_address, target, [("Host", proc.gateway_address)])
        assert status == 400, target
    assert "Traceback" not in proc.stderr_text


async def test_a_later_auth_frame_with_a_token_no_header_can_carry_closes_4003(world: dict[str, Any]) -> None:
    async with connect(world["proc"].ws_url(world["sid"]), additional_headers=cookie(world["alice"])) as ws:
        assert (await recv(ws))["type"] == "session_sync"
        await ws.send(json.dumps({"type": "auth", "api_token": "ctx_\u00e9"}))
        assert await closed_with(ws) == 4003


async def test_events_reach_only_the_owner_socket(world: dict[str, Any], tmp_path: Path) -> None:
    stub, meta, sid = world["stub"], world["meta"], world["sid"]
    async with connect(world["proc"].ws_url(sid), additional_headers=cookie(world["alice"])) as ws:
        assert (await recv(ws))["type"] == "session_sync"
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("owned")]), metadata=meta)
        frame = await recv(ws)
        assert frame["type"] == "messages_appended" and frame["session_id"] == sid
    assert world["alice"] not in world["proc"].stderr_text and world["bob"] not in world["proc"].stderr_text


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "contextsvc", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_gateway_beyond_loopback_refuses_an_open_service(tmp_path: Path) -> None:
    # Refused before anything binds: the tests never open a socket beyond loopback.
    bundled = run_cli("serve", "--listen", "127.0.0.1:0", "--store", "memory", "--gateway", "0.0.0.0:0")
    # A configuration the settings do not allow: exit 2, as the server's own refusal beyond loopback.
    assert bundled.returncode == 2 and "refusing to serve the gateway on 0.0.0.0:0" in bundled.stderr
    assert "lets anonymous callers in" in bundled.stderr
    service = Process(["serve", "--listen", "127.0.0.1:0", "--store", "memory"]).start()
    try:
        alone = run_cli("gateway", "--listen", "0.0.0.0:0", "--target", service.grpc_address)
        assert alone.returncode == 2 and "lets anonymous callers in" in alone.stderr
    finally:
        service.kill()
    unreachable = run_cli("gateway", "--listen", "0.0.0.0:0", "--target", "127.0.0.1:1")
    assert unreachable.returncode == 1 and "cannot check that the service" in unreachable.stderr


def test_gateway_beyond_loopback_in_front_of_tokens_needs_tls(world: dict[str, Any]) -> None:
    # The service wants tokens, so the gateway may face the network, but only over TLS: browsers
    # send it their tokens. Refused before anything binds (no socket beyond loopback in tests).
    alone = run_cli("gateway", "--listen", "0.0.0.0:0", "--target", world["proc"].grpc_address)
    assert alone.returncode == 2, alone.stderr
    assert "refusing to serve the gateway on 0.0.0.0:0 without TLS" in alone.stderr
    assert "--insecure" in alone.stderr


def test_failed_authentications_limited_are_429_and_close_1013_without_a_log_line_each(tmp_path: Path) -> None:
    """Unknown tokens sent through the gateway count against the gateway's address; once the
    service refuses them RESOURCE_EXHAUSTED (``auth.failures_per_peer_per_minute``) the inspector's
    session list answered 502 Bad Gateway, as if the gateway were broken. A token the service
    accepted before still lists its sessions."""
    import secrets

    store = f"files:{tmp_path / 'data'}"
    alice = create_token(store, "alice")
    proc = Process(
        ["serve", "--listen", "127.0.0.1:0", "--store", store, "--auth", "tokens", "--gateway", "127.0.0.1:0"],
        env={"CONTEXTSVC_AUTH__FAILURES_PER_PEER_PER_MINUTE": "2"},
    ).start()
    try:
        address = proc.http_url.removeprefix("http://").rstrip("/")
        assert raw_get(address, "/api/sessions", [("Host", address), ("Authorization", f"Bearer {alice}")])[0] == 200
        statuses = [
            raw_get(
                address,
                "/api/sessions",
                [("Host", address), ("Authorization", "Bearer ctx_" + secrets.token_urlsafe(32))],
            )[0]
            for _ in range(4)
        ]
        assert statuses == [401, 401, 429, 429]
        assert raw_get(address, "/api/sessions", [("Host", address), ("Authorization", f"Bearer {alice}")])[0] == 200

        # A socket with an unknown token meanwhile: "try again later", not "service unreachable"
        # and a warning line per browser attempt.
        async def socket_close() -> int | None:
            bad = cookie("ctx_" + secrets.token_urlsafe(32))
            async with connect(proc.ws_url("0b6f1d2e-3c4a-4b5c-8d6e-7f8091a2b3c4"), additional_headers=bad) as ws:
                return await closed_with(ws)

        assert [asyncio.run(socket_close()) for _ in range(3)] == [1013] * 3
        assert "service unreachable" not in proc.stderr_text
    finally:
        proc.kill()
