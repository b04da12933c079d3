"""One writer per data directory and one server per port, through real ``serve`` processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from contextsvc._gen.v1 import context_service_pb2 as pb
from tests.support.rpc import all_messages, user
from tests.support.server import ServerProcess

pytestmark = pytest.mark.e2e


def _serve(store: str, listen: str = "127.0.0.1:0") -> subprocess.CompletedProcess[str]:
    """A second server, expected to refuse at once (bounded by the timeout)."""
    cmd = [sys.executable, "-m", "contextsvc", "serve", "--listen", listen, "--store", store]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)


def test_a_second_serve_on_the_same_directory_refuses_and_nothing_is_lost(tmp_path: Path) -> None:
    store = f"files:{tmp_path / 'data'}"
    first = ServerProcess(store).start()
    try:
        with first.channel() as ch:
            stub = first.stub(ch)
            sid = stub.CreateSession(pb.CreateSessionRequest(name="owned")).id
            resp = stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("a")]))
            acked = list(resp.sequence_numbers)

            second = _serve(store)
            assert second.returncode != 0
            lines = second.stderr.strip().splitlines()
            assert len(lines) == 1, second.stderr
            assert f"in use by pid {first.proc.pid if first.proc else 0} " in lines[0]
            assert "contextsvc listening" not in second.stdout

            # The first server goes on: numbers continue, nothing is handed out twice.
            for i in range(5):
                resp = stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user(f"m{i}")]))
                acked.extend(resp.sequence_numbers)
    finally:
        assert first.terminate() == 0
    assert acked == list(range(1, 7))

    again = ServerProcess(store).start()  # the lock went with the first process
    try:
        with again.channel() as ch:
            stored = [m.sequence_number for m in all_messages(again.stub(ch), sid)]
    finally:
        again.terminate()
    assert stored == acked


def test_a_port_in_use_is_refused(tmp_path: Path) -> None:
    first = ServerProcess(f"files:{tmp_path / 'one'}").start()
    try:
        second = _serve(f"files:{tmp_path / 'two'}", listen=first.address)
        assert second.returncode != 0
        assert f"cannot listen on {first.address}" in second.stderr
        assert "contextsvc listening" not in second.stdout
        with first.channel() as ch:  # the first one still answers alone
            assert first.stub(ch).CreateSession(pb.CreateSessionRequest()).id
    finally:
        first.terminate()
