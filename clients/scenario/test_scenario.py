"""One scripted agent loop, three languages: the transcripts of the Python, TypeScript and Go
clients, each against a real server, must match field for field (after masking ids and clocks).

Run by scripts/test-clients.sh after the TypeScript client is built (dist/examples/scenario.js)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from contextsvc.client import ContextClient
from tests.support.server import ServerProcess

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
from compare import differences, normalize  # noqa: E402

RUN_TIMEOUT_S = 180


@contextmanager
def _server() -> Iterator[ServerProcess]:
    with ServerProcess("memory").start() as proc:
        yield proc


def _run(cmd: list[str], cwd: Path) -> None:
    # PYTHONPATH: the Python runner imports this checkout's contextsvc, whatever is installed.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_three_clients_produce_the_same_transcript(tmp_path: Path) -> None:
    """Each client runs against a fresh server of its own: calibration is learned per model across
    sessions, so runs sharing one server would see each other's baselines."""

    async def warm(address: str) -> None:  # an event before the scenario's, so after_event_id=1 replays them all
        async with ContextClient(address) as c:
            sid = (await c.create_session())["id"]
            await c.append_messages(sid, [{"role": "user", "content": "warm up"}])

    outputs = {name: tmp_path / f"{name}.json" for name in ("python", "typescript", "go")}
    commands = {
        "python": ([sys.executable, str(HERE / "run_python.py")], ROOT),
        "typescript": (["node", "dist/examples/scenario.js"], ROOT / "clients/typescript"),
        "go": (["go", "run", "./cmd/scenario"], ROOT / "clients/go"),
    }
    for name, (cmd, cwd) in commands.items():
        with _server() as server:
            asyncio.run(warm(server.address))
            _run([*cmd, server.address, str(outputs[name])], cwd)

    transcripts = {name: json.loads(path.read_text()) for name, path in outputs.items()}
    steps = json.loads((HERE / "scenario.json").read_text())["steps"]
    for name, transcript in transcripts.items():
        assert [s["op"] for s in transcript] == [s["op"] for s in steps], name
    # The scenario did what it says: a summary compaction, its events, a hit in the history, a fork.
    py = transcripts["python"]
    by_op = {s["op"]: s["result"] for s in py}
    assert by_op["compress"]["compressed"] and by_op["compress"]["method"] == "summary"
    assert py[7]["result"][-1]["payload"] == "context_compressed"
    assert "KX-4417" in by_op["search_history"]["chunks"][0]["text"]
    assert by_op["expand_summary"]["messages"][0]["sequence_number"] == 1
    assert by_op["fork_session"]["display_message_count"] == 6

    reference = normalize(transcripts["python"])
    for name in ("typescript", "go"):
        diff = differences(reference, normalize(transcripts[name]))
        assert not diff, f"{name} transcript differs from python's:\n" + "\n".join(diff[:30])
