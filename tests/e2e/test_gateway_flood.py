"""A WebSocket client that sends frames far faster than they are answered, and never reads: the
gateway serves at most ``gateway.frames_in_flight`` of a socket's frames at once and stops reading
it meanwhile, so the process's memory does not grow with the frames sent (it used to start a
call, and hold its answer, for every frame read: ~100 KB a ``get_view`` of a 500-row session)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
from tests.support.gateway import Process
from tests.support.rawws import RawWebSocket
from tests.support.rpc import user

pytestmark = pytest.mark.e2e

FRAMES = 3000


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def gateway() -> Iterator[tuple[Process, str]]:
    proc = Process(["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--gateway", "127.0.0.1:0"]).start()
    try:
        with grpc.insecure_channel(proc.grpc_address) as channel:
            stub = ContextServiceStub(channel)
            sid = stub.CreateSession(pb.CreateSessionRequest(name="big")).id
            stub.AppendMessages(
                pb.AppendMessagesRequest(session_id=sid, messages=[user(f"row {i} " + "w " * 400) for i in range(500)])
            )
        yield proc, sid
    finally:
        proc.kill()


def test_a_client_flooding_frames_it_never_reads_answers_of_does_not_grow_the_gateway(
    gateway: tuple[Process, str],
) -> None:
    proc, sid = gateway
    assert proc.proc is not None
    host, _, port = proc.gateway_address.rpartition(":")
    before = _rss_mb(proc.proc.pid)
    flooder = RawWebSocket(host, int(port), f"/ws/sessions/{sid}", rcvbuf=4096, timeout=5)
    sent = [0]

    def flood() -> None:
        try:
            for _ in range(FRAMES):
                flooder.send_text('{"type":"get_view"}')
                sent[0] += 1
        except OSError:
            pass  # the gateway stopped reading (the send timed out) or closed it: both fine

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    peak = before
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        peak = max(peak, _rss_mb(proc.proc.pid))
        time.sleep(0.1)
    flooder.close()
    thread.join(10)
    assert sent[0] > 100  # the frames did go out
    assert peak - before < 200, f"the gateway grew {peak - before:.0f} MB for {sent[0]} frames"
