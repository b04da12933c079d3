"""The WebSocket protocol (docs/websocket.md) with a plain WebSocket client against real processes:
``contextsvc serve --gateway`` (bundled) and ``contextsvc gateway --target`` (alone)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from PIL import Image
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
from tests.support.gateway import Process, bundled_gateway, raw_get, recv, recv_type
from tests.support.rawws import RawWebSocket
from tests.support.rpc import all_messages, assistant, user

pytestmark = pytest.mark.e2e

UNKNOWN = "00000000-0000-4000-8000-000000000000"


@pytest.fixture(scope="module")
def bundled() -> Iterator[Process]:
    env = {"CONTEXTSVC_GATEWAY__MAX_IMAGE_BYTES": "200000", "CONTEXTSVC_GATEWAY__HUB_LINGER_SECONDS": "30"}
    with bundled_gateway(env) as proc:
        yield proc


@pytest.fixture(scope="module")
def stub(bundled: Process) -> Iterator[ContextServiceStub]:
    with grpc.insecure_channel(bundled.grpc_address) as channel:
        yield ContextServiceStub(channel)


def new_session(stub: ContextServiceStub, name: str = "gw") -> str:
    return str(stub.CreateSession(pb.CreateSessionRequest(name=name)).id)


async def quiet(ws: ClientConnection, seconds: float = 0.5) -> list[dict[str, Any]]:
    """Every frame that arrives within ``seconds``."""
    out = []
    while True:
        try:
            out.append(await recv(ws, seconds))
        except TimeoutError:
            return out


async def close_code(ws: ClientConnection, wait: float = 10.0) -> int | None:
    with pytest.raises(ConnectionClosed):
        while True:
            await asyncio.wait_for(ws.recv(), wait)
    return ws.close_code


def png(size: int = 8) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


async def test_connect_sends_session_sync_then_message_is_appended_and_announced(
    bundled: Process, stub: ContextServiceStub
) -> None:
    sid = new_session(stub, "hello")
    async with connect(bundled.ws_url(sid)) as ws:
        sync = await recv(ws)
        assert sync["type"] == "session_sync"
        assert sync["session"]["id"] == sid and sync["session"]["name"] == "hello"
        await ws.send(json.dumps({"type": "message", "content": "What is the capital of France?", "id": "m1"}))
        got = {f["type"]: f for f in [await recv(ws), await recv(ws)]}
        ack, event = got["message_ack"], got["messages_appended"]
        assert ack["id"] == "m1" and ack["sequence_numbers"] == [1] and ack["context_tokens"] > 0
        assert event["session_id"] == sid and event["sequence_numbers"] == [1] and event["event_id"] > 0
        assert event["context_tokens"] == ack["context_tokens"]
    stored = all_messages(stub, sid)
    assert [m.content for m in stored] == ["What is the capital of France?"]


async def test_message_with_images_and_files(bundled: Process, stub: ContextServiceStub) -> None:
    sid = new_session(stub)
    image = png()
    async with connect(bundled.ws_url(sid)) as ws:
        await recv(ws)
        frame = {
            "type": "message",
            "content": "look",
            "images": [base64.b64encode(image).decode(), "data:image/png;base64," + base64.b64encode(image).decode()],
            "files": [{"name": "report.pdf", "path": "/srv/up/report.pdf"}],
            "turn_complete": True,
        }
        await ws.send(json.dumps(frame))
        ack = await recv_type(ws, "message_ack")
        assert ack["sequence_numbers"] == [1]
    [stored] = all_messages(stub, sid)
    assert len(stored.images) == 2 and stored.images[0].mime_type == "image/png" and stored.images[0].width == 8
    assert stored.content.startswith("look") and "[Uploaded files on disk: report.pdf (/srv/up/report.pdf)]" in (
        stored.content
    )


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ("not json", "BAD_FRAME"),
        ("[1, 2]", "BAD_FRAME"),
        ('{"type": "shout"}', "UNKNOWN_TYPE"),
        ('{"content": "no type"}', "UNKNOWN_TYPE"),
        ('{"type": "message"}', "INVALID_MESSAGE"),
        ('{"type": "message", "content": "   "}', "INVALID_MESSAGE"),
        ('{"type": "message", "content": "x", "images": "abc"}', "INVALID_MESSAGE"),
        ('{"type": "message", "content": "x", "images": ["%%%not-base64"]}', "INVALID_MESSAGE"),
        ('{"type": "message", "content": "x", "images": ' + json.dumps(["aGk="] * 9) + "}", "TOO_MANY_IMAGES"),
        ('{"type": "message", "content": "x", "files": [{"name": "a"}]}', "INVALID_MESSAGE"),
        ('{"type": "message", "content": "x", "turn_complete": "yes"}', "INVALID_MESSAGE"),
        ('{"type": "compact", "dry_run": "no"}', "INVALID_COMPACT"),
        ('{"type": "search", "query": ""}', "INVALID_SEARCH"),
        ('{"type": "expand", "sequence_number": -1}', "INVALID_EXPAND"),
        ('{"type": "ping", "id": [1]}', "BAD_FRAME"),
        ('{"type": "get_messages", "buffer": "drafts"}', "INVALID_GET_MESSAGES"),
        ('{"type": "get_messages", "buffer": "display", "page_size": 0}', "INVALID_GET_MESSAGES"),
        ('{"type": "get_messages", "buffer": "context", "page_token": 5}', "INVALID_GET_MESSAGES"),
        # Valid JSON that no request may hold: lone surrogates, numbers past 64 bits, deep nesting.
        ('{"type": "message", "content": "hi \\ud800 there"}', "BAD_FRAME"),
        ('{"type": "search", "query": "\\udc80"}', "BAD_FRAME"),
        ('{"type": "expand", "sequence_number": 99999999999999999999999}', "INVALID_EXPAND"),
        ('{"type": "ping", "x": ' + "[" * 40 + "]" * 40 + "}", "BAD_FRAME"),
        ("[" * 100_000 + "]" * 100_000, "BAD_FRAME"),
    ],
)
async def test_bad_frames_get_an_error_frame_and_the_socket_stays(
    bundled: Process, stub: ContextServiceStub, raw: str, code: str
) -> None:
    sid = new_session(stub)
    async with connect(bundled.ws_url(sid)) as ws:
        await recv(ws)
        await ws.send(raw)
        error = await recv(ws)
        assert error["type"] == "error" and error["code"] == code and error["message"]
        await ws.send(json.dumps({"type": "ping", "id": 7}))
        assert await recv(ws) == {"type": "pong", "id": 7}
    assert stub.GetSession(pb.GetSessionRequest(session_id=sid)).display_message_count == 0


async def test_binary_frame_and_oversized_images_are_errors(bundled: Process, stub: ContextServiceStub) -> None:
    sid = new_session(stub)
    async with connect(bundled.ws_url(sid)) as ws:
        await recv(ws)
        await ws.send(b"\x00\x01")
        assert (await recv(ws))["code"] == "BAD_FRAME"
        # This server allows 200,000 image bytes per message (CONTEXTSVC_GATEWAY__MAX_IMAGE_BYTES).
        big = base64.b64encode(b"\x89PNG" + b"\x00" * 120_000).decode()
        await ws.send(json.dumps({"type": "message", "content": "x", "images": [big, big], "id": 3}))
        error = await recv(ws)
        assert error == {"type": "error", "code": "IMAGES_TOO_LARGE", "message": error["message"], "id": 3}
        await ws.send(json.dumps({"type": "ping"}))
        assert (await recv(ws))["type"] == "pong"


async def test_service_errors_become_error_frames(bundled: Process, stub: ContextServiceStub) -> None:
    sid = new_session(stub)
    async with connect(bundled.ws_url(sid)) as ws:
        await recv(ws)
        # Not a summary row: the service says so, the socket stays.
        await ws.send(json.dumps({"type": "expand", "sequence_number": 99, "id": "e"}))
        error = await recv(ws)
        assert error["type"] == "error" and error["id"] == "e" and error["code"] in ("NOT_FOUND", "INVALID_ARGUMENT")
        await ws.send(json.dumps({"type": "compact", "id": "c"}))
        error = await recv(ws)
        # The service's own status and ErrorInfo reason are passed through.
        assert error["type"] == "error" and error["id"] == "c"
        assert error["code"] == "FAILED_PRECONDITION" and error["reason"] == "NOTHING_TO_COMPACT", error


def fill(stub: ContextServiceStub, sid: str, turns: int = 10, chars: int = 600) -> None:
    for n in range(turns):
        stub.AppendMessages(
            pb.AppendMessagesRequest(
                session_id=sid,
                messages=[user(f"question {n} about topic{n} " + "words " * (chars // 6)), assistant(f"answer {n}")],
                turn_complete=True,
            )
        )


async def test_compact_dry_run_then_compact_streams_events_and_one_at_a_time(
    bundled: Process, stub: ContextServiceStub
) -> None:
    sid = new_session(stub)
    fill(stub, sid)
    async with connect(bundled.ws_url(sid)) as ws:
        await recv(ws)
        await ws.send(json.dumps({"type": "compact", "dry_run": True, "id": 1}))
        preview = await recv(ws)
        assert preview["type"] == "compact_preview" and preview["plan"]["would_compress"] is True
        assert preview["plan"]["messages_to_drop"] > 0
        # It says which method the run commits: the one the result then names.
        assert preview["compressed"] is False and preview["method"] in ("summary", "clear_tool_results")
        before = stub.GetSession(pb.GetSessionRequest(session_id=sid)).context_tokens
        # Two at once: the second is refused while the first runs.
        await ws.send(json.dumps({"type": "compact", "id": 2}))
        await ws.send(json.dumps({"type": "compact", "id": 3}))
        # Until all four kinds arrived (a loaded machine may pause longer than any quiet spell
        # between them), then whatever else comes: a second result or event would be a defect.
        by_type: dict[str, list[dict[str, Any]]] = {}
        expected = {"error", "compression_started", "context_compressed", "compact_result"}
        deadline = asyncio.get_running_loop().time() + 30
        while not expected <= by_type.keys():
            f = await recv(ws, max(0.1, deadline - asyncio.get_running_loop().time()))
            by_type.setdefault(f["type"], []).append(f)
        for f in await quiet(ws, 1.0):
            by_type.setdefault(f["type"], []).append(f)
        [refused] = by_type["error"]
        assert refused["id"] == 3 and refused["code"] == "COMPACTION_IN_PROGRESS"
        [started] = by_type["compression_started"]
        [done] = by_type["context_compressed"]
        [result] = by_type["compact_result"]
        # The event prices the view, the session field the stored rows: close, not equal.
        assert started["reason"] == "forced" and 0.5 * before < started["context_tokens"] < 2 * before
        assert done["context_tokens_after"] < done["context_tokens_before"] * 0.9
        assert done["method"] in ("summary", "clear_tool_results", "hard_truncate")
        assert result["id"] == 2 and result["compressed"] is True
        assert result["method"] == done["method"] == preview["method"]
        assert started["event_id"] < done["event_id"]
        await ws.send(json.dumps({"type": "get_view", "id": "v"}))
        view = await recv_type(ws, "view")
        assert any(m["flags"]["is_summary"] for m in view["context"])
        assert view["session"]["context_tokens"] < before
        assert view["view"]["estimate"]["window"] > 0 and view["compression"]["threshold"] == 0.9


async def test_memory_flush_due_reaches_the_socket(bundled: Process, stub: ContextServiceStub) -> None:
    sid = new_session(stub)
    async with connect(bundled.ws_url(sid)) as ws:
        await recv(ws)
        # The default window is 32,768 tokens; the flush warning comes 4,000 tokens (plus the
        # estimate's margin, since the trigger is estimate + margin) before the trigger.
        fill(stub, sid, turns=12, chars=16000)
        flush = await recv_type(ws, "memory_flush_due")
        margin = int(flush["margin"])
        assert 0 < margin < flush["threshold_tokens"] // 2
        assert flush["threshold_tokens"] > flush["context_tokens"] > flush["threshold_tokens"] - 4001 - margin


async def test_view_search_and_expand(bundled: Process, stub: ContextServiceStub) -> None:
    sid = new_session(stub)
    fill(stub, sid)
    stub.Compress(pb.CompressRequest(session_id=sid))
    async with connect(bundled.ws_url(sid)) as ws:
        await recv(ws)
        await ws.send(json.dumps({"type": "get_view"}))
        view = await recv(ws)
        assert view["type"] == "view"
        # Every appended message stays in the display history (plus the service's compression record).
        assert len([m for m in view["display"] if not m["flags"]["is_compression"]]) == 20
        summary = next(m for m in view["context"] if m["flags"]["is_summary"])
        await ws.send(json.dumps({"type": "expand", "sequence_number": summary["sequence_number"]}))
        expanded = await recv(ws)
        assert expanded["type"] == "expanded" and expanded["messages"]
        assert expanded["messages"][0]["content"].startswith("question 0")
        await ws.send(json.dumps({"type": "search", "query": "topic1", "limit": 3}))
        found = await recv(ws)
        assert found["type"] == "search_results" and found["chunks"]
        assert "topic1" in found["chunks"][0]["text"]


async def test_get_messages_pages_both_buffers_to_exactly_the_buffer(
    bundled: Process, stub: ContextServiceStub
) -> None:
    sid = new_session(stub)
    fill(stub, sid, turns=12, chars=300)
    stub.Compress(pb.CompressRequest(session_id=sid))  # a summary row: the context is not in sequence order
    fill(stub, sid, turns=3, chars=300)
    async with connect(bundled.ws_url(sid)) as ws:
        await recv(ws)
        for buffer, enum in (("display", pb.BUFFER_DISPLAY), ("context", pb.BUFFER_CONTEXT)):
            whole = [m.sequence_number for m in all_messages(stub, sid, enum)]
            await ws.send(json.dumps({"type": "get_messages", "buffer": buffer, "page_size": 7, "id": buffer}))
            pages = []
            while True:
                page = await recv_type(ws, "messages_page")
                assert page["buffer"] == buffer and page["id"] == buffer and len(page["messages"]) <= 7
                pages.insert(0, [m["sequence_number"] for m in page["messages"]])
                if not page["next_page_token"]:
                    break
                await ws.send(
                    json.dumps(
                        {
                            "type": "get_messages",
                            "buffer": buffer,
                            "page_size": 7,
                            "page_token": page["next_page_token"],
                            "id": buffer,
                        }
                    )
                )
            assert [seq for p in pages for seq in p] == whole and len(pages) >= 3
        # The view hands out the token of the page before its rows; a foreign token is the service's error.
        await ws.send(json.dumps({"type": "get_view"}))
        view = await recv_type(ws, "view")
        assert view["display_page_token"] == "" and view["display_more"] is False
        await ws.send(json.dumps({"type": "get_messages", "buffer": "context", "page_token": "bm9wZQ", "id": "t"}))
        error = await recv_type(ws, "error")
        assert error["id"] == "t" and error["code"] == "INVALID_ARGUMENT"


async def test_unknown_and_malformed_session_close_4004(bundled: Process) -> None:
    for sid in (UNKNOWN, "not-a-uuid"):
        async with connect(bundled.ws_url(sid)) as ws:
            assert await close_code(ws) == 4004


async def test_query_token_is_accepted_by_default_and_never_logged(bundled: Process, stub: ContextServiceStub) -> None:
    """DESIGN §5.9: cookie, ``?api_token=`` or a first auth frame."""
    sid = new_session(stub)
    async with connect(bundled.ws_url(sid, "api_token=secret-in-url")) as ws:
        assert json.loads(await ws.recv())["type"] == "session_sync"
    assert "secret-in-url" not in bundled.stderr_text


async def test_query_token_is_refused_when_turned_off() -> None:
    proc = Process(
        ["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--gateway", "127.0.0.1:0"],
        env={"CONTEXTSVC_GATEWAY__ALLOW_QUERY_TOKEN": "false"},
    ).start()
    try:
        with grpc.insecure_channel(proc.grpc_address) as channel:
            sid = new_session(ContextServiceStub(channel))
        async with connect(proc.ws_url(sid, "api_token=secret-in-url")) as ws:
            assert await close_code(ws) == 4003
        assert "secret-in-url" not in proc.stderr_text
    finally:
        proc.kill()


async def test_bad_last_event_id_closes_1008(bundled: Process, stub: ContextServiceStub) -> None:
    sid = new_session(stub)
    # "²" passes str.isdigit() but not int(), and int() refuses more than 4,300 digits: both closed
    # the socket 1011 with a logged traceback; "٣" (an Arabic-Indic three) was read as 3.
    for value in ("abc", "%C2%B2", "%D9%A3", "1" * 5000, "-1", "1.5"):
        async with connect(bundled.ws_url(sid, f"last_event_id={value}")) as ws:
            assert await close_code(ws) == 1008, value
    assert "Traceback" not in bundled.stderr_text


async def test_cross_origin_handshake_is_refused(bundled: Process, stub: ContextServiceStub) -> None:
    sid = new_session(stub)
    with pytest.raises(InvalidStatus) as caught:
        async with connect(bundled.ws_url(sid), origin="http://evil.example"):  # type: ignore[arg-type]
            pass
    assert caught.value.response.status_code == 403
    async with connect(bundled.ws_url(sid), origin=f"http://{bundled.gateway_address}") as ws:  # type: ignore[arg-type]
        assert (await recv(ws))["type"] == "session_sync"


async def test_a_loopback_gateway_answers_only_loopback_host_names(bundled: Process, stub: ContextServiceStub) -> None:
    # DNS rebinding: a page of rebind.example whose name later resolves to 127.0.0.1 is same-origin
    # with the gateway for the browser (Origin and Host agree), and the service lets every local
    # caller in. It read every session through /api/sessions and could open their sockets.
    new_session(stub, "private")
    port = bundled.gateway_address.rpartition(":")[2]
    for host, expected in (
        (bundled.gateway_address, 200),
        (f"localhost:{port}", 200),
        (f"[::1]:{port}", 200),
        (f"rebind.example:{port}", 403),
        ("rebind.example", 403),
        (f"127.0.0.1.rebind.example:{port}", 403),
    ):
        headers = [("Host", host), ("Origin", f"http://{host}")]
        status, body = await asyncio.to_thread(raw_get, bundled.gateway_address, "/api/sessions", headers)
        assert status == expected, host
        if status == 403:
            assert "private" not in body and "gateway.allowed_hosts" in body
            socket_path = f"/ws/sessions/{new_session(stub)}"  # refused before any handshake
            assert (await asyncio.to_thread(raw_get, bundled.gateway_address, socket_path, headers))[0] == 403
    with bundled_gateway(env={"CONTEXTSVC_GATEWAY__ALLOWED_HOSTS": '["proxy.example"]'}) as proxied:
        host = f"proxy.example:{proxied.gateway_address.rpartition(':')[2]}"
        status, _ = await asyncio.to_thread(raw_get, proxied.gateway_address, "/api/sessions", [("Host", host)])
        assert status == 200


def append(stub: ContextServiceStub, sid: str, text: str) -> None:
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user(text)]))


async def test_reconnect_replays_exactly_the_missed_events_then_live(
    bundled: Process, stub: ContextServiceStub
) -> None:
    sid = new_session(stub)
    async with connect(bundled.ws_url(sid)) as ws:
        await recv(ws)
        append(stub, sid, "one")
        last = (await recv_type(ws, "messages_appended"))["event_id"]
    for text in ("two", "three", "four"):  # missed while away
        append(stub, sid, text)
    async with connect(bundled.ws_url(sid, f"last_event_id={last}")) as ws:
        assert (await recv(ws))["type"] == "session_sync"
        start = await recv(ws)
        assert start == {"type": "replay_start", "count": 3}
        replayed = [await recv(ws) for _ in range(3)]
        assert (await recv(ws))["type"] == "replay_end"
        assert [f["sequence_numbers"] for f in replayed] == [[2], [3], [4]]
        assert all(f["event_id"] > last for f in replayed)
        append(stub, sid, "five")
        live = await quiet(ws)
        assert [f["sequence_numbers"] for f in live] == [[5]]
        assert live[0]["event_id"] > replayed[-1]["event_id"]
        newest = live[0]["event_id"]
    # Up to date: an empty replay.
    async with connect(bundled.ws_url(sid, f"last_event_id={newest}")) as ws:
        assert [f["type"] for f in await quiet(ws)] == ["session_sync", "replay_start", "replay_end"]


async def test_reconnect_to_a_session_deleted_while_away_replays_up_to_the_deletion_then_closes_4004(
    bundled: Process, stub: ContextServiceStub
) -> None:
    """As StreamEvents does: what the socket missed, ``session_deleted`` last, then the close a
    deletion brings (4004). Once the client has seen the deletion, a resume is a plain 4004."""
    sid = new_session(stub)
    async with connect(bundled.ws_url(sid)) as ws:
        await recv(ws)
        append(stub, sid, "one")
        last = (await recv_type(ws, "messages_appended"))["event_id"]
    append(stub, sid, "missed")
    stub.DeleteSession(pb.DeleteSessionRequest(session_id=sid))
    async with connect(bundled.ws_url(sid, f"last_event_id={last}")) as ws:
        got = [await recv(ws) for _ in range(4)]
        assert [f["type"] for f in got] == ["replay_start", "messages_appended", "session_deleted", "replay_end"]
        assert got[0]["count"] == 2 and got[1]["sequence_numbers"] == [2]
        assert last < got[1]["event_id"] < got[2]["event_id"] and got[2]["session_id"] == sid
        assert await close_code(ws) == 4004
        deletion = got[2]["event_id"]
    for seen in (deletion, 0):
        async with connect(bundled.ws_url(sid, f"last_event_id={seen}")) as ws:
            assert await close_code(ws) == 4004


async def test_a_resume_of_a_session_that_never_existed_is_a_plain_4004(bundled: Process) -> None:
    async with connect(bundled.ws_url(UNKNOWN, "last_event_id=1")) as ws:
        assert await close_code(ws) == 4004


async def test_an_append_right_after_the_handshake_reaches_the_socket(
    bundled: Process, stub: ContextServiceStub
) -> None:
    """A page that opens its socket, then starts a turn, must see the turn's event even when it
    lands while the gateway is still setting the socket up (reading the session, starting its
    event stream): session_sync and the events after it leave no gap."""
    sid = new_session(stub)
    async with connect(bundled.ws_url(sid)) as ws:
        append(stub, sid, "right after open")
        sync = await recv(ws)
        assert sync["type"] == "session_sync"
        event = await recv_type(ws, "messages_appended")
        assert event["sequence_numbers"] == [1]
        append(stub, sid, "later")
        assert (await recv_type(ws, "messages_appended"))["sequence_numbers"] == [2]


async def test_many_sockets_on_one_session_each_get_every_event(bundled: Process, stub: ContextServiceStub) -> None:
    sid = new_session(stub)
    sockets = [await connect(bundled.ws_url(sid)) for _ in range(5)]
    try:
        for ws in sockets:
            await recv(ws)
        for n in range(10):
            append(stub, sid, f"m{n}")
        for ws in sockets:
            got = [await recv_type(ws, "messages_appended") for _ in range(10)]
            assert [f["sequence_numbers"][0] for f in got] == list(range(1, 11))
    finally:
        for ws in sockets:
            await ws.close()


def http_get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


async def test_http_api_sessions_and_pages(bundled: Process, stub: ContextServiceStub) -> None:
    sid = new_session(stub, "findable-zebra")
    status, kind, body = await asyncio.to_thread(http_get, f"{bundled.http_url}/api/sessions?query=findable-zebra")
    assert status == 200 and kind.startswith("application/json")
    listed = json.loads(body)
    assert [s["id"] for s in listed["sessions"]] == [sid]
    for path in ("/", f"/sessions/{sid}"):
        status, kind, body = await asyncio.to_thread(http_get, bundled.http_url + path)
        assert status == 200 and kind.startswith("text/html") and b"inspector" in body.lower()
    status, _, _ = await asyncio.to_thread(http_get, bundled.http_url + "/static/../../etc/passwd")
    assert status == 404
    status, _, _ = await asyncio.to_thread(http_get, bundled.http_url + "/nope")
    assert status == 404


@pytest.fixture
def split(tmp_path: Path) -> Iterator[tuple[Process, Process]]:
    """The service and a separate gateway process calling it over gRPC."""
    service = Process(["serve", "--listen", "127.0.0.1:0", "--store", f"files:{tmp_path / 'data'}"]).start()
    gateway = Process(["gateway", "--listen", "127.0.0.1:0", "--target", service.grpc_address]).start()
    try:
        yield service, gateway
    finally:
        gateway.kill()
        service.kill()


async def test_standalone_gateway_replays_from_the_service_after_a_gateway_restart(
    split: tuple[Process, Process],
) -> None:
    service, gateway = split
    with grpc.insecure_channel(service.grpc_address) as channel:
        stub = ContextServiceStub(channel)
        sid = new_session(stub)
        async with connect(gateway.ws_url(sid)) as ws:
            await recv(ws)
            append(stub, sid, "one")
            last = (await recv_type(ws, "messages_appended"))["event_id"]
        gateway.kill()
        for n in range(12):
            append(stub, sid, f"missed {n}")
        # The new gateway remembers only 10 events per session: the 12 missed ones must come from
        # the service's retained log, joined to what the gateway's own stream delivers.
        fresh = Process(
            ["gateway", "--listen", "127.0.0.1:0", "--target", service.grpc_address],
            env={"CONTEXTSVC_GATEWAY__REPLAY_BUFFER_EVENTS": "10"},
        ).start()
        try:
            async with connect(fresh.ws_url(sid)) as watcher:
                await recv(watcher)
                async with connect(fresh.ws_url(sid, f"last_event_id={last}")) as ws:
                    frames = [await recv(ws) for _ in range(15)]
                    assert [f["type"] for f in frames[:2]] == ["session_sync", "replay_start"]
                    assert frames[1]["count"] == 12 and frames[-1]["type"] == "replay_end"
                    assert [f["sequence_numbers"] for f in frames[2:14]] == [[n] for n in range(2, 14)]
                    append(stub, sid, "live")
                    assert [f["sequence_numbers"] for f in await quiet(ws)] == [[14]]
                    assert [f["sequence_numbers"] for f in await quiet(watcher)] == [[14]]
        finally:
            fresh.kill()


@pytest.mark.parametrize(
    "bound",
    [
        {"CONTEXTSVC_GATEWAY__SEND_QUEUE_FRAMES": "8"},
        # 40 frames are far from the default 1,024, but ~50 MB: the byte bound closes it.
        {"CONTEXTSVC_GATEWAY__SEND_QUEUE_BYTES": str(4 * 1024 * 1024)},
    ],
    ids=["frames", "bytes"],
)
async def test_slow_browser_is_closed_4008(bound: dict[str, str]) -> None:
    proc = Process(
        ["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--gateway", "127.0.0.1:0"],
        env={
            **bound,
            # Long enough for this client to read its backlog and see the close code.
            "CONTEXTSVC_GATEWAY__CLOSE_TIMEOUT_SECONDS": "60",
        },
    ).start()
    try:
        with grpc.insecure_channel(proc.grpc_address) as channel:
            stub = ContextServiceStub(channel)
            sid = new_session(stub)
            fill(stub, sid, turns=10, chars=100_000)  # ~1.3 MB per view frame
            host, port = proc.gateway_address.rsplit(":", 1)
            ws = await asyncio.to_thread(RawWebSocket, host, int(port), f"/ws/sessions/{sid}?api_token=tok-abc")
            try:
                _, payload = await asyncio.to_thread(ws.recv_frame)
                assert json.loads(payload)["type"] == "session_sync"
                # Ask for big views and read none of them: the gateway must not buffer without bound.
                for n in range(40):
                    await asyncio.to_thread(ws.send_text, json.dumps({"type": "get_view", "id": n}))
                await asyncio.sleep(8)
                assert await asyncio.to_thread(ws.read_until_close) == 4008
            finally:
                ws.close()
        assert "tok-abc" not in proc.stderr_text
    finally:
        proc.kill()
