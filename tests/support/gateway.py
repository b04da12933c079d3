"""Start a real ``contextsvc serve --gateway`` (or ``contextsvc gateway``) process on free loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import IO, Any

from websockets.asyncio.client import ClientConnection

_GRPC = re.compile(r"contextsvc listening on (\S+):(\d+)")
_GATEWAY = re.compile(r"contextsvc gateway listening on (https?)://(\S+):(\d+)/")
START_TIMEOUT_S = 20.0


class Process:
    """``python -m contextsvc ARGS``; waits for the listening lines it prints; stopped by its own pid."""

    def __init__(self, args: Sequence[str], *, env: dict[str, str] | None = None):
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.grpc_address = ""
        self.gateway_address = ""
        #: "https" when the gateway serves TLS (its announce line says so).
        self.gateway_scheme = "http"
        self._stderr: IO[str] | None = None

    def start(self) -> Process:
        want_grpc = self.args[0] == "serve"
        want_gateway = self.args[0] == "gateway" or "--gateway" in self.args
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "contextsvc", *self.args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=self.env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        # Read the pipe's bytes as they come, not with readline: the two lines may arrive in one
        # read, and a line left in the file object's buffer is one select() never reports again.
        fd = self.proc.stdout.fileno()
        pending = b""
        while time.monotonic() < deadline and (
            (want_grpc and not self.grpc_address) or (want_gateway and not self.gateway_address)
        ):
            ready, _, _ = select.select([fd], [], [], 0.2)
            chunk = os.read(fd, 65536) if ready else b""
            if chunk:
                pending += chunk
                *lines, rest = pending.split(b"\n")
                pending = rest
                for line in (raw.decode(errors="replace") for raw in lines):
                    if m := _GRPC.search(line):
                        self.grpc_address = f"{m.group(1)}:{m.group(2)}"
                    if m := _GATEWAY.search(line):
                        self.gateway_scheme = m.group(1)
                        self.gateway_address = f"{m.group(2)}:{m.group(3)}"
            elif self.proc.poll() is not None:
                break
        if (want_grpc and not self.grpc_address) or (want_gateway and not self.gateway_address):
            self.kill()
            raise RuntimeError(f"process did not start: {self.stderr_text[-3000:]}")
        return self

    @property
    def stderr_text(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()

    def ws_url(self, session_id: str, query: str = "") -> str:
        scheme = "wss" if self.gateway_scheme == "https" else "ws"
        return f"{scheme}://{self.gateway_address}/ws/sessions/{session_id}" + (f"?{query}" if query else "")

    @property
    def http_url(self) -> str:
        return f"{self.gateway_scheme}://{self.gateway_address}"

    def terminate(self, timeout: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


async def recv(ws: ClientConnection, wait: float = 10.0) -> dict[str, Any]:
    """The next frame of a browser-protocol socket, decoded."""
    frame = json.loads(await asyncio.wait_for(ws.recv(), wait))
    assert isinstance(frame, dict)
    return frame


async def recv_type(ws: ClientConnection, kind: str, wait: float = 10.0) -> dict[str, Any]:
    """Frames up to the first of ``kind`` (others are dropped)."""
    while True:
        frame = await recv(ws, wait)
        if frame["type"] == kind:
            return frame


@contextlib.contextmanager
def bundled_gateway(env: dict[str, str] | None = None) -> Iterator[Process]:
    """``serve`` on the memory store with its bundled gateway, both on free ports; killed after."""
    proc = Process(
        ["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--gateway", "127.0.0.1:0"], env=env
    ).start()
    try:
        yield proc
    finally:
        proc.kill()


def raw_get(address: str, path: str, headers: list[tuple[str, str]]) -> tuple[int, str]:
    """A GET with exactly these headers, repeated ones included (urllib merges them)."""
    conn = http.client.HTTPConnection(address, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()
