"""``serve`` trims its C heap while it serves, and stops cleanly with the trim running (round 19)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import grpc

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.server import ServerProcess


def test_serve_trims_its_heap_under_load_and_stops_cleanly(tmp_path: Path) -> None:
    env = {"CONTEXTSVC_HOT_PATH__HEAP_TRIM_INTERVAL_SECONDS": "0.05"}
    server = ServerProcess(f"files:{tmp_path / 'data'}", extra_args=["--log-level", "DEBUG"], env=env).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = server.stub(channel)
            sid = stub.CreateSession(pb.CreateSessionRequest(name="trimmed")).id
            deadline = time.monotonic() + 1.0
            sent = 0
            while time.monotonic() < deadline:  # calls keep coming while the trims run
                stub.AppendMessages(
                    pb.AppendMessagesRequest(
                        session_id=sid, messages=[r.Message(role=r.ROLE_USER, content=f"turn {sent} " + "x" * 2000)]
                    )
                )
                view = stub.BuildContext(pb.BuildContextRequest(session_id=sid)).messages
                assert view[-1].content.startswith(f"turn {sent} ")
                sent += 1
    finally:
        code = server.terminate()
    assert code == 0
    lines = [json.loads(line) for line in server.stderr_text.splitlines() if line.startswith("{")]
    trims = [line for line in lines if line.get("event") == "free heap memory given back to the system"]
    if platform.libc_ver()[0] == "glibc":
        assert len(trims) >= 5 and sent > 10
    else:
        assert trims == []
    assert not [line for line in lines if line.get("level") in ("error", "critical")]
