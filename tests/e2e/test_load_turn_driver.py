"""The load suite's Go turn-loop driver (bench/load/turndriver): it sends exactly the messages of
``workload.turn_messages`` and, run for a second against a real server, reports what the Python
driver (``drivers.py turns``) reports, in the same JSON shape."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import context_service_pb2_grpc as pb_grpc
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.server import ServerProcess

LOAD = Path(__file__).resolve().parents[2] / "bench" / "load"
sys.path.insert(0, str(LOAD))
from workload import provider_tokens, turn_messages  # noqa: E402 - bench/load is not a package

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("turndriver") / "turndriver"
    env = {**os.environ, "GOFLAGS": "-mod=mod"}
    subprocess.run(["go", "build", "-o", str(out), "."], cwd=LOAD / "turndriver", env=env, check=True, timeout=600)
    return str(out)


@pytest.fixture
def memory_server() -> Iterator[ServerProcess]:
    with ServerProcess("memory").start() as proc:
        yield proc


@pytest.mark.parametrize(("agent", "turn"), [(0, 1), (7, 3), (49, 1), (49, 4999), (3, 99_999), (0, 0)])
def test_turn_messages_are_the_python_workloads(driver: str, agent: int, turn: int) -> None:
    done = subprocess.run([driver, "--dump", f"{agent},{turn}"], capture_output=True, text=True, check=True)
    got = json.loads(done.stdout)
    want = turn_messages(agent * 100_000 + turn)
    assert [(m["role"], m["content"]) for m in got] == [(r.Role.Name(m.role), m.content) for m in want]
    assert len(got) == 2 and got[0]["role"] == "ROLE_USER" and len(got[0]["content"].split()) == 30


def _shape(value: object) -> object:
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items() if k != "errors"}
    return type(value).__name__ if not isinstance(value, int | float) else "number"


def test_go_driver_runs_the_loop_like_the_python_one(driver: str, memory_server: ServerProcess) -> None:
    with memory_server.channel() as channel:
        stub = pb_grpc.ContextServiceStub(channel)
        sessions = [stub.CreateSession(pb.CreateSessionRequest(name=f"agent {k}")).id for k in range(3)]
        flags = ["--address", memory_server.address, "--sessions", ",".join(sessions), "--seconds", "1"]
        go = json.loads(subprocess.run([driver, *flags], capture_output=True, text=True, check=True).stdout)
        assert go["client"] == "go"
        assert go["count"] > 0 and go["errors"] == {}
        assert go["rps"] > 0 and 0.9 <= go["seconds"] < 30
        for name in ("AppendMessages", "BuildContext", "RecordBaseline"):
            lat = go["latency"][name]
            assert 0 < lat["p50_ms"] <= lat["p99_ms"]

        # Every counted turn appended its two messages, with the Python workload's text. A fast
        # machine fills a session far enough to compress it: the notice (and any summary) a
        # compression writes into the history is no turn's message.
        def sent_to(session_id: str) -> list[tuple[int, str]]:
            page = stub.ListMessages(pb.ListMessagesRequest(session_id=session_id, page_size=1000))
            return [(m.role, m.content) for m in page.messages if not (m.flags.is_compression or m.flags.is_summary)]

        assert sum(len(sent_to(s)) for s in sessions) == 2 * go["count"]
        sent = sent_to(sessions[1])
        assert sent[:2] == [(m.role, m.content) for m in turn_messages(1 * 100_000 + 1)]
        assert sent[2:4] == [(m.role, m.content) for m in turn_messages(1 * 100_000 + 2)]
        # The Python driver on the same sessions: the same JSON object, field for field.
        cmd = [sys.executable, str(LOAD / "drivers.py"), "turns", *flags]
        py = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        assert py["client"] == "python" and py["count"] > 0 and py["errors"] == {}
        assert _shape(py) == _shape(go)


@pytest.mark.parametrize("client", ["go", "python"])
def test_each_baseline_is_the_providers_count_of_its_view(
    driver: str, memory_server: ServerProcess, client: str
) -> None:
    """A fixed function of the view's text, never the service's own estimate scaled (that
    compounds through baseline + delta until the session compacts mid-run), from either driver.
    Few turns: no session comes near compaction, so each session's anchor is its last view's count."""
    with memory_server.channel() as channel:
        stub = pb_grpc.ContextServiceStub(channel)
        sessions = [stub.CreateSession(pb.CreateSessionRequest(name=f"agent {k}")).id for k in range(3)]
        flags = ["--address", memory_server.address, "--sessions", ",".join(sessions), "--seconds", "30"]
        command = [driver] if client == "go" else [sys.executable, str(LOAD / "drivers.py"), "turns"]
        run = json.loads(
            subprocess.run([*command, *flags, "--max-count", "30"], capture_output=True, text=True, check=True).stdout
        )
        assert run["client"] == client and run["count"] >= 30 and run["errors"] == {}
        for sid in sessions:
            view = stub.BuildContext(pb.BuildContextRequest(session_id=sid))
            assert len(view.messages) >= 2
            held = stub.GetSession(pb.GetSessionRequest(session_id=sid)).context_tokens
            assert held == provider_tokens(view.messages) == view.estimate.total


@pytest.mark.parametrize("client", ["go", "python"])
def test_with_incoming_the_user_message_goes_with_the_build_and_both_are_stored_after(
    driver: str, memory_server: ServerProcess, client: str
) -> None:
    """``--incoming``: each build's view ends with the turn's user message, not yet stored, and
    every counted turn stored its two messages after its baseline."""
    with memory_server.channel() as channel:
        stub = pb_grpc.ContextServiceStub(channel)
        sessions = [stub.CreateSession(pb.CreateSessionRequest(name=f"agent {k}")).id for k in range(2)]
        # What the session's events say happened first: its first baseline, before any append.
        events = stub.StreamEvents(pb.StreamEventsRequest(session_id=sessions[1]), timeout=60)
        order: list[str] = []

        def watch() -> None:
            with contextlib.suppress(grpc.RpcError):
                for event in events:
                    kind = event.WhichOneof("payload")
                    if kind in ("baseline_recorded", "messages_appended"):
                        order.append(kind)

        watcher = threading.Thread(target=watch)
        watcher.start()
        time.sleep(0.5)  # the stream is live before the first call
        flags = ["--address", memory_server.address, "--sessions", ",".join(sessions), "--seconds", "30"]
        command = [driver] if client == "go" else [sys.executable, str(LOAD / "drivers.py"), "turns"]
        done = subprocess.run([*command, *flags, "--max-count", "10", "--incoming"], capture_output=True, text=True)
        time.sleep(0.5)
        events.cancel()
        watcher.join(10)
        assert order[:2] == ["baseline_recorded", "messages_appended"], order[:4]
        run = json.loads(done.stdout)
        assert run["count"] >= 10 and run["errors"] == {}
        assert all(run["latency"][name]["p50_ms"] > 0 for name in ("AppendMessages", "BuildContext", "RecordBaseline"))
        page = stub.ListMessages(pb.ListMessagesRequest(session_id=sessions[1], page_size=1000))
        stored = [(m.role, m.content) for m in page.messages]
        turns = len(stored) // 2
        assert turns >= 1 and len(stored) == 2 * turns
        want = [(m.role, m.content) for t in range(1, turns + 1) for m in turn_messages(1 * 100_000 + t)]
        assert stored == want
        # The next turn's build, as the driver sends it: the stored rows, then the user message.
        nxt = turn_messages(1 * 100_000 + turns + 1)
        view = stub.BuildContext(pb.BuildContextRequest(session_id=sessions[1], incoming=nxt[0]))
        assert [(m.role, m.content) for m in view.messages] == [*want, (nxt[0].role, nxt[0].content)]
        assert view.estimate.segments.incoming > 0
