"""One scripted agent loop, three languages: the transcripts of the Python, TypeScript and Go
clients against one real server must match field for field (after masking ids and clocks).

Run by scripts/test-clients.sh after the TypeScript client is built (dist/examples/scenario.js)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from contextsvc.client import ContextClient
from tests.support.server import ServerProcess

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
from compare import differences, normalize  # noqa: E402

RUN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("memory").start()
    try:
        yield proc
    finally:
        proc.kill()


def _run(cmd: list[str], cwd: Path) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_three_clients_produce_the_same_transcript(server: ServerProcess, tmp_path: Path) -> None:
    async def warm() -> None:  # an event before the scenario's, so after_event_id=1 replays all of them
        async with ContextClient(server.address) as c:
            sid = (await c.create_session())["id"]
            await c.append_messages(sid, [{"role": "user", "content": "warm up"}])

    asyncio.run(warm())
    outputs = {name: tmp_path / f"{name}.json" for name in ("python", "typescript", "go")}
    _run([sys.executable, str(HERE / "run_python.py"), server.address, str(outputs["python"])], ROOT)
    _run(["node", "dist/examples/scenario.js", server.address, str(outputs["typescript"])], ROOT / "clients/typescript")
    _run(["go", "run", "./cmd/scenario", server.address, str(outputs["go"])], ROOT / "clients/go")

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
