"""Start a real ``contextsvc serve`` process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import grpc

from contextsvc._gen.v1 import context_service_pb2_grpc

_LISTENING = re.compile(r"contextsvc listening on (\S+):(\d+)")
START_TIMEOUT_S = 20.0


def closed_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One server process. ``start()`` returns once it prints its address; stopped by its own pid."""

    def __init__(self, store: str, *, extra_args: Sequence[str] = (), env: dict[str, str] | None = None):
        self.store = store
        self.extra_args = list(extra_args)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self._stderr_file: IO[str] | None = None

    def start(self, listen: str = "127.0.0.1:0") -> ServerProcess:
        cmd = [sys.executable, "-m", "contextsvc", "serve", "--listen", listen, "--store", self.store, *self.extra_args]
        # stderr goes to a file: a pipe nobody reads would block a chatty server.
        self._stderr_file = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._stderr_file, text=True, env=self.env, start_new_session=True
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                match = _LISTENING.search(line)
                if match:
                    self.address = f"{match.group(1)}:{match.group(2)}"
                    return self
            if self.proc.poll() is not None:
                break
        self.kill()
        raise RuntimeError(f"server did not start: {self.stderr_text[-3000:]}")

    @property
    def stderr_text(self) -> str:
        """Everything the process wrote to stderr so far (its JSON log lines)."""
        if self._stderr_file is None:
            return ""
        self._stderr_file.seek(0)
        return self._stderr_file.read()

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stub(self, channel: grpc.Channel) -> context_service_pb2_grpc.ContextServiceStub:
        return context_service_pb2_grpc.ContextServiceStub(channel)

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait: the graceful path. Returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the crash path."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        """``with ServerProcess(...).start() as proc:``: killed when the block ends."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class StoreServer:
    """One ``contextsvc serve`` on a named store kind, for benchmarks: ``memory``, ``files`` (a
    folder under ``workdir``) or ``postgres`` (a private throwaway cluster, removed by ``stop``),
    with ``config`` written as its TOML settings file."""

    def __init__(self, store: str, workdir: Path, config: str, extra_args: Sequence[str] = ()) -> None:
        from tests.support.postgres import PgCluster

        self.cluster: PgCluster | None = None
        url = store
        if store == "files":
            url = f"files:{workdir / 'files'}"
        elif store == "postgres":
            self.cluster = PgCluster.create()
            url = self.cluster.start()
        path = workdir / "settings.toml"
        path.write_text(config)
        self.proc = ServerProcess(url, extra_args=["--config", str(path), *extra_args]).start()
        self.address = self.proc.address
        assert self.proc.proc is not None
        self.pid = self.proc.proc.pid

    def stop(self) -> None:
        try:
            self.proc.terminate()
        except Exception:  # a stuck server is killed instead
            self.proc.kill()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster.remove()
