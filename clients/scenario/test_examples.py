"""The README example agent loops of the three clients run against a real server."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import ServerProcess

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("memory").start()
    try:
        yield proc
    finally:
        proc.kill()


@pytest.mark.parametrize(
    ("cmd", "cwd"),
    [
        ([sys.executable, "clients/python/agent_loop.py"], "."),
        (["node", "dist/examples/agent_loop.js"], "clients/typescript"),
        (["go", "run", "./examples/agentloop"], "clients/go"),
    ],
    ids=["python", "typescript", "go"],
)
def test_example_agent_loop(server: ServerProcess, cmd: list[str], cwd: str) -> None:
    done = subprocess.run([*cmd, server.address], cwd=ROOT / cwd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "answer: main.py has 15 characters." in done.stdout
    # user, assistant tool call, tool result, final answer
    assert "done: 4 messages in the display history" in done.stdout
