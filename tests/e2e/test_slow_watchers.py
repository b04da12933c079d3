"""A ``StreamEvents`` watcher that stops reading while agents keep appending (its process
stopped dead): when it reads again it gets every event it missed, in order, or, when those left
the retained log meanwhile, an explicit ``EVENTS_EXPIRED`` — never a silent gap (the client's
reconnect on ``UNAVAILABLE`` used to jump over what a lagging watcher had been cut off from)."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import context_service_pb2_grpc
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.server import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


def _reference(address: str, stop: threading.Event, ids: list[int]) -> threading.Thread:
    """A watcher of every session that keeps up: what the stalled one should get."""
    ready = threading.Event()

    def run() -> None:
        with grpc.insecure_channel(address) as ch:
            call = context_service_pb2_grpc.ContextServiceStub(ch).StreamEvents(pb.StreamEventsRequest())
            ready.set()
            stopper = threading.Thread(target=lambda: (stop.wait(), call.cancel()), daemon=True)
            stopper.start()
            try:
                for event in call:
                    ids.append(event.event_id)
            except grpc.RpcError:
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)
    return thread


async def _append(address: str, session_ids: list[str], calls: int) -> None:
    """``calls`` appends (one event each) spread over the sessions, 8 at a time."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = context_service_pb2_grpc.ContextServiceStub(ch)
        left = [calls]

        async def agent(n: int) -> None:
            while left[0] > 0:
                left[0] -= 1
                sid = session_ids[n % len(session_ids)]
                await stub.AppendMessages(
                    pb.AppendMessagesRequest(session_id=sid, messages=[r.Message(role=r.ROLE_USER, content="hi")])
                )

        await asyncio.gather(*(agent(n) for n in range(8)))


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[ServerProcess, list[str]]]:
    server = ServerProcess("memory", env={"CONTEXTSVC_EVENT_RETENTION": "1000"}).start()
    try:
        with server.channel() as ch:
            stub = server.stub(ch)
            sids = [stub.CreateSession(pb.CreateSessionRequest(name=f"s{i}")).id for i in range(4)]
        yield server, sids
    finally:
        server.kill()


def _stalled_watcher(server: ServerProcess, tmp_path: Path, appends: int, sids: list[str]) -> tuple[dict, list[int]]:
    """Start the watcher of every session, stop it dead, make ``appends`` events, let it go on."""
    out = tmp_path / "watched.json"
    stop = threading.Event()
    reference: list[int] = []
    ref_thread = _reference(server.address, stop, reference)
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.stalled_watcher", server.address, "", str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        # Events until it has one: its stream is open (its start takes a while).
        deadline = time.monotonic() + 30
        while not select.select([child.stdout], [], [], 0.2)[0]:
            assert time.monotonic() < deadline and child.poll() is None, "the watcher did not start"
            asyncio.run(_append(server.address, sids[:1], 1))
        line = child.stdout.readline()
        assert line.startswith("FIRST "), line
        os.kill(child.pid, signal.SIGSTOP)
        asyncio.run(_append(server.address, sids, appends))
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.wait(120) == 0
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait(10)
        stop.set()
        ref_thread.join(10)
    return json.loads(out.read_text()), reference


def test_a_watcher_stalled_within_retention_catches_up_with_every_event(
    watched: tuple[ServerProcess, list[str]], tmp_path: Path
) -> None:
    server, sids = watched
    got, reference = _stalled_watcher(server, tmp_path, 800, sids)
    ids = got["ids"]
    assert got["error"] == ""
    assert ids == reference[reference.index(ids[0]) :] and len(ids) == 801


def test_a_watcher_stalled_past_retention_is_told_never_skipped(
    watched: tuple[ServerProcess, list[str]], tmp_path: Path
) -> None:
    server, sids = watched
    # More than the bus once queued per watcher (10,000) plus what sockets buffer, and more than
    # the retained log (1,000) after that: the old cut-off's resume point was long gone.
    got, reference = _stalled_watcher(server, tmp_path, 13_000, sids)
    ids = got["ids"]
    reference = reference[reference.index(ids[0]) :]
    assert len(reference) == 13_001
    # What it got is the reference's beginning, without a hole ...
    assert ids == reference[: len(ids)], f"a gap after {len(ids)} events"
    # ... and it learnt that the rest is gone, rather than jumping to what is still kept.
    assert got["error"] == "EVENTS_EXPIRED", f"{len(ids)} of {len(reference)} events"
    assert len(ids) < len(reference)
