"""``compression_refused`` end to end: a browser-protocol client sends ``compact`` through the bundled
gateway and the real service refuses to commit the compaction.

The service refuses a started compaction (DESIGN §5.4, issue #8) when no stage can shrink the
context (``no_progress``), when another compaction committed first (``conflict``), when it stops on
an error (``failed``), and an automatic one inside the hysteresis band (``loop_guard``; a forced
``compact`` is exempt). Here: a profile that may only summarize, with a summarizer that cannot be
reached and no hard-truncation fallback, so a forced compaction has nothing it may commit."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
from tests.support.gateway import Process
from tests.support.rpc import all_messages, assistant, user

pytestmark = pytest.mark.e2e


def closed_port() -> int:
    """A loopback port nothing listens on: connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def refusing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    config = tmp_path_factory.mktemp("cfg") / "contextsvc.toml"
    config.write_text(
        f"""
[profiles.summary-only]
context_window = 8192
[profiles.summary-only.compression]
summarizer = "openai"
strategies = ["summarize"]
hard_truncate_fallback = false

[summarizer.openai]
base_url = "http://127.0.0.1:{closed_port()}"
timeout_seconds = 1
connect_timeout_seconds = 1
total_timeout_seconds = 3
max_retries = 0
"""
    )
    proc = Process(
        [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            "memory",
            "--gateway",
            "127.0.0.1:0",
            "--config",
            str(config),
        ]
    ).start()
    try:
        yield proc
    finally:
        proc.kill()


async def frames_until(ws: ClientConnection, *kinds: str, wait: float = 20.0) -> list[dict[str, Any]]:
    """Every frame until one of each of ``kinds`` arrived (the reply to a frame and the events the
    call published travel separately, so their order is not fixed)."""
    out: list[dict[str, Any]] = []
    while not set(kinds) <= {f["type"] for f in out}:
        out.append(json.loads(await asyncio.wait_for(ws.recv(), wait)))
    return out


async def test_compact_that_the_service_refuses_reaches_the_browser_as_compression_refused(
    refusing: Process,
) -> None:
    with grpc.insecure_channel(refusing.grpc_address) as channel:
        stub = ContextServiceStub(channel)
        sid = stub.CreateSession(pb.CreateSessionRequest(profile_id="summary-only", name="refuser")).id
        for n in range(10):
            stub.AppendMessages(
                pb.AppendMessagesRequest(
                    session_id=sid,
                    messages=[user(f"question {n} " + "words " * 80), assistant(f"answer {n}")],
                    turn_complete=True,
                )
            )
        before = stub.GetSession(pb.GetSessionRequest(session_id=sid))
        context_before = [m.sequence_number for m in all_messages(stub, sid, pb.BUFFER_CONTEXT)]
        async with connect(refusing.ws_url(sid)) as ws:
            assert json.loads(await ws.recv())["type"] == "session_sync"
            # The preview says there is something to drop: the refusal is about committing it.
            await ws.send(json.dumps({"type": "compact", "dry_run": True, "id": "p"}))
            preview = (await frames_until(ws, "compact_preview"))[-1]
            assert preview["plan"]["would_compress"] is True and preview["id"] == "p"

            await ws.send(json.dumps({"type": "compact", "id": "c"}))
            got = await frames_until(ws, "compact_result", "compression_refused")
            by_type = {f["type"]: f for f in got}
            started, refused, result = (
                by_type["compression_started"],
                by_type["compression_refused"],
                by_type["compact_result"],
            )
            assert sorted(f["type"] for f in got) == ["compact_result", "compression_refused", "compression_started"]
            assert started["reason"] == "forced" and started["session_id"] == sid
            assert refused["reason"] == "no_progress" and refused["trigger"] == "forced"
            assert refused["detail"] and refused["event_id"] > started["event_id"]
            assert result["id"] == "c" and result["compressed"] is False
            # The socket stays usable, and a second refusal is a second pair of events.
            await ws.send(json.dumps({"type": "compact", "id": "again"}))
            again = await frames_until(ws, "compact_result", "compression_refused")
            assert sorted(f["type"] for f in again) == ["compact_result", "compression_refused", "compression_started"]
        # Nothing was committed.
        after = stub.GetSession(pb.GetSessionRequest(session_id=sid))
        assert after.context_tokens == before.context_tokens
        assert [m.sequence_number for m in all_messages(stub, sid, pb.BUFFER_CONTEXT)] == context_before
        # A reconnecting browser replays the refusal like any other event.
        async with connect(refusing.ws_url(sid, f"last_event_id={started['event_id'] - 1}")) as ws:
            replay = await frames_until(ws, "replay_end")
            kinds = [f["type"] for f in replay]
            assert kinds[:2] == ["session_sync", "replay_start"] and kinds.count("compression_refused") == 2


async def test_sockets_closed_for_an_unreachable_service_are_logged_within_the_refusal_budget() -> None:
    """Each browser (re)connect while the service was away wrote its own "service unreachable"
    warning: a page retrying every second, or many browsers, filled the log. At most
    ``refusal_log_per_minute`` lines a minute now, the next one saying how many were left out."""
    proc = Process(
        ["gateway", "--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{closed_port()}"],
        env={"CONTEXTSVC_REFUSAL_LOG_PER_MINUTE": "2", "CONTEXTSVC_GATEWAY__UPSTREAM_MAX_ATTEMPTS": "1"},
    ).start()
    try:
        codes = []
        for _ in range(6):
            async with connect(proc.ws_url("0b6f1d2e-3c4a-4b5c-8d6e-7f8091a2b3c4")) as ws:
                try:
                    while True:
                        await asyncio.wait_for(ws.recv(), 10)
                except ConnectionClosed:
                    codes.append(ws.close_code)
        assert codes == [1013] * 6
        assert proc.terminate() == 0
    finally:
        proc.kill()
    lines = [json.loads(line) for line in proc.stderr_text.splitlines() if "service unreachable" in line]
    assert len(lines) == 2, proc.stderr_text
