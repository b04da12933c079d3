"""The files store through a real server: restarts, SIGKILL under load, torn logs."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc

from contextsvc._gen.v1 import context_service_pb2 as pb
from tests.support.rpc import all_messages, assistant, tool, user
from tests.support.server import ServerProcess


def _agent_history(n: int) -> list[Any]:
    """``n`` messages of realistic turns: a question, a tool-call group, an answer."""
    out: list[Any] = []
    turn = 0
    while len(out) < n:
        turn += 1
        out.append(user(f"question {turn}: what is in dir{turn}?"))
        out.append(assistant("", [(f"t{turn}a", "ls"), (f"t{turn}b", "cat")]))
        out.append(tool(f"t{turn}a", f"file_{turn}.txt\n" * 3))
        out.append(tool(f"t{turn}b", f"contents of file {turn}"))
        out.append(assistant(f"dir{turn} holds file_{turn}.txt"))
    return out[:n]


def _snapshot(stub: Any, sid: str) -> tuple[list[bytes], list[bytes], Any]:
    display = [m.SerializeToString(deterministic=True) for m in all_messages(stub, sid, pb.BUFFER_DISPLAY)]
    context = [m.SerializeToString(deterministic=True) for m in all_messages(stub, sid, pb.BUFFER_CONTEXT)]
    session = stub.GetSession(pb.GetSessionRequest(session_id=sid))
    return display, context, (session.display_message_count, session.context_message_count, session.context_tokens)


def test_200_messages_with_tool_groups_survive_a_restart(tmp_path: Path) -> None:
    store = f"files:{tmp_path / 'data'}"
    first = ServerProcess(store).start()
    try:
        with first.channel() as ch:
            stub = first.stub(ch)
            sid = stub.CreateSession(pb.CreateSessionRequest(name="long")).id
            history = _agent_history(200)
            for i in range(0, 200, 25):
                stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=history[i : i + 25]))
            before = _snapshot(stub, sid)
    finally:
        assert first.terminate() == 0
    assert len(before[0]) == 200 and len(before[1]) == 200

    second = ServerProcess(store).start()
    try:
        with second.channel() as ch:
            after = _snapshot(second.stub(ch), sid)
    finally:
        second.terminate()
    assert after == before


def test_sigkill_while_appending_loses_no_acknowledged_message(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = f"files:{data}"
    proc = ServerProcess(store, extra_args=["--durability", "fsync"]).start()
    acknowledged: dict[str, list[int]] = {}
    lock = threading.Lock()
    stop = threading.Event()
    with proc.channel() as ch:
        stub = proc.stub(ch)
        sids = [stub.CreateSession(pb.CreateSessionRequest()).id for _ in range(3)]

        def client(k: int) -> None:
            sid = sids[k % len(sids)]
            for i in range(10_000):  # bounded; the kill below ends it far sooner
                if stop.is_set():
                    return
                try:
                    resp = stub.AppendMessages(
                        pb.AppendMessagesRequest(session_id=sid, messages=[user(f"client {k} message {i}")]),
                        timeout=5,
                    )
                except grpc.RpcError:
                    return
                with lock:
                    acknowledged.setdefault(sid, []).extend(resp.sequence_numbers)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        # Kill once a good number of appends were acknowledged.
        for _ in range(200):
            with lock:
                if sum(len(v) for v in acknowledged.values()) >= 150:
                    break
            stop.wait(0.05)
        proc.kill()
        stop.set()
        for t in threads:
            t.join(10)

    # Tear the last line of one log, as a crash in the middle of a write would.
    logs = sorted((data / "sessions").glob("*.jsonl"))
    assert logs
    with logs[0].open("ab") as fh:
        fh.write(b'{"type": "append", "messages": [{"seq": 99999, "ro')

    again = ServerProcess(store).start()
    try:
        with again.channel() as ch:
            stub = again.stub(ch)
            for sid, seqs in acknowledged.items():
                stored = {m.sequence_number for m in all_messages(stub, sid)}
                missing = set(seqs) - stored
                assert not missing, f"acknowledged but lost: {sorted(missing)[:10]}"
                # Still gap-free, and appends continue from the right number.
                assert stored == set(range(1, max(stored) + 1))
                nxt = stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("after")]))
                assert list(nxt.sequence_numbers) == [max(stored) + 1]
    finally:
        again.terminate()
    assert list((data / "sessions").glob("*.torn*")), "the torn original is kept aside"
    assert "torn" in again.stderr_text.lower()
