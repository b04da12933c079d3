"""The README example agent loops of the three clients run against a real server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import ServerProcess

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("memory").start() as proc:
        yield proc


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    """A server serving TLS with token authentication, and the environment the examples read."""
    from tests.e2e.test_tls import _token
    from tests.support.certs import Authority

    tmp = tmp_path_factory.mktemp("tls")
    ca = Authority("server CA")
    cert, key = ca.server().write(tmp / "pki", "server")
    (tmp / "ca.pem").write_bytes(ca.pem)
    env = {"CONTEXTSVC_TOKEN": _token(tmp / "data"), "CONTEXTSVC_CA_FILE": str(tmp / "ca.pem")}
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--auth", "tokens"]
    proc = ServerProcess(f"files:{tmp / 'data'}", extra_args=args).start()
    try:
        yield proc, env
    finally:
        proc.kill()


EXAMPLES = [
    ([sys.executable, "clients/python/agent_loop.py"], "."),
    (["node", "dist/examples/agent_loop.js"], "clients/typescript"),
    (["go", "run", "./examples/agentloop"], "clients/go"),
]


@pytest.mark.parametrize(("cmd", "cwd"), EXAMPLES, ids=["python", "typescript", "go"])
def test_example_agent_loop(server: ServerProcess, cmd: list[str], cwd: str) -> None:
    _check_loop(cmd, cwd, server.address, {})


@pytest.mark.parametrize(("cmd", "cwd"), EXAMPLES, ids=["python", "typescript", "go"])
def test_example_agent_loop_over_tls_with_a_token(
    tls_server: tuple[ServerProcess, dict[str, str]], cmd: list[str], cwd: str
) -> None:
    proc, env = tls_server
    _check_loop(cmd, cwd, proc.address, env)
    unauthenticated = {"CONTEXTSVC_CA_FILE": env["CONTEXTSVC_CA_FILE"]}
    done = _loop(cmd, cwd, proc.address, unauthenticated)
    assert done.returncode != 0 and "UNAUTHENTICATED" in (done.stderr + done.stdout).upper()


def _loop(cmd: list[str], cwd: str, address: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH: the Python example imports this checkout's contextsvc, whatever is installed.
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([*cmd, address], cwd=ROOT / cwd, capture_output=True, text=True, timeout=180, env=full_env)


def _check_loop(cmd: list[str], cwd: str, address: str, env: dict[str, str]) -> None:
    done = _loop(cmd, cwd, address, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "answer: main.py has 15 characters." in done.stdout
    # user, assistant tool call, tool result, final answer
    assert "done: 4 messages in the display history" in done.stdout
