"""The files store's start-up index, background log compaction and maintenance under kill -9,
through real server processes (issue #9 item 3)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.rpc import all_messages, user
from tests.support.server import ServerProcess

pytestmark = pytest.mark.e2e

INTEGRITY = "contextsvc.store.integrity"


def _sessions(stub: Any) -> dict[str, bytes]:
    """Every session as listed (counters, preview, times), by id."""
    out: dict[str, bytes] = {}
    token = ""
    for _ in range(1000):  # bounded
        page = stub.ListSessions(pb.ListSessionsRequest(page_size=100, page_token=token))
        for s in page.sessions:
            out[s.id] = s.SerializeToString(deterministic=True)
        token = page.next_page_token
        if not token:
            break
    return out


def _integrity(channel: grpc.Channel) -> int:
    return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=INTEGRITY)).status)


def _contents(stub: Any, sid: str) -> list[tuple[int, str]]:
    return [(m.sequence_number, m.content) for m in all_messages(stub, sid)]


def _append(stub: Any, sid: str, *texts: str) -> list[int]:
    got = stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user(t) for t in texts]))
    return list(got.sequence_numbers)


def _update(stub: Any, session: r.Session, *fields: str) -> None:
    mask = field_mask_pb2.FieldMask(paths=list(fields))
    stub.UpdateSession(pb.UpdateSessionRequest(session=session, update_mask=mask))


def _appender(stub: Any, sid: str, label: str, acked: dict[int, str], stop: threading.Event) -> None:
    k = 0
    while not stop.is_set():
        text = f"{label} append {k}"
        try:
            (seq,) = _append(stub, sid, text)
        except grpc.RpcError:
            return  # the server was killed
        acked[seq] = text
        k += 1


def _renamer(stub: Any, sid: str, label: str, stop: threading.Event) -> None:
    k = 0
    while not stop.is_set():
        try:
            _update(stub, r.Session(id=sid, name=f"{label} name {k}"), "name")
        except grpc.RpcError:
            return
        k += 1


def _churner(stub: Any, keeper: str, label: str, acked: dict[str, dict[int, str]], stop: threading.Event) -> None:
    """New sessions with three appends each (maintenance removes the oldest), and the pinned keeper."""
    k = 0
    while not stop.is_set():
        try:
            sid = stub.CreateSession(pb.CreateSessionRequest(name=f"{label}.{k}")).id
            acked[sid] = {}
            for j in range(3):
                text = f"{sid[:8]} {j}"
                (seq,) = _append(stub, sid, text)
                acked[sid][seq] = text
            (seq,) = _append(stub, keeper, f"{label} k{k}")
            acked[keeper][seq] = f"{label} k{k}"
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                continue  # maintenance removed it between two appends: allowed
            return  # killed
        k += 1


# -- the start-up index -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["stale", "missing", "corrupt"])
def test_a_restart_with_a_stale_missing_or_corrupt_index_rebuilds_it(tmp_path: Path, case: str) -> None:
    data = tmp_path / "data"
    index = data / "index.jsonl"
    first = ServerProcess(f"files:{data}").start()
    try:
        with first.channel() as ch:
            stub = first.stub(ch)
            sids = [stub.CreateSession(pb.CreateSessionRequest(name=f"s{i}")).id for i in range(6)]
            for i, sid in enumerate(sids):
                _append(stub, sid, *(f"m{i}.{j}" for j in range(3)))
    finally:
        assert first.terminate() == 0
    old_index = index.read_bytes()  # written at the clean stop
    assert all(sid.encode() in old_index for sid in sids)

    second = ServerProcess(f"files:{data}").start()
    try:
        with second.channel() as ch:
            stub = second.stub(ch)
            _append(stub, sids[1], "later")
            stub.DeleteSession(pb.DeleteSessionRequest(session_id=sids[2]))
            sids.append(stub.CreateSession(pb.CreateSessionRequest(name="newer")).id)
            expected = _sessions(stub)
    finally:
        second.kill()  # no clean stop: the index on disk is older than the logs
    assert sids[2] not in expected and len(expected) == 6

    if case == "stale":
        index.write_bytes(old_index)
    elif case == "missing":
        index.unlink(missing_ok=True)
    else:
        raw = bytearray(index.read_bytes())
        for at in range(40, len(raw), 97):  # bytes flipped all over it
            raw[at] ^= 0x5A
        index.write_bytes(bytes(raw))
    damaged_index = index.read_bytes() if index.exists() else b""

    third = ServerProcess(f"files:{data}").start()
    try:
        with third.channel() as ch:
            stub = third.stub(ch)
            assert _sessions(stub) == expected  # the logs' truth, not the index's
            assert _contents(stub, sids[1])[-1] == (4, "later")
            assert _append(stub, sids[1], "x") == [5]
            assert _integrity(ch) == health_pb2.HealthCheckResponse.SERVING
        # Rebuilt at start: a usable index for the next one, whatever the damage was.
        assert index.exists() and index.read_bytes() != damaged_index
        assert sids[2].encode() not in index.read_bytes() and sids[-1].encode() in index.read_bytes()
    finally:
        assert third.terminate() == 0
    if case == "corrupt":
        assert "start-up index" in third.stderr_text


# -- kill -9 during a background compaction of a log ------------------------------------------------


def _rewrite_in_flight(sessions_dir: Path, sid: str) -> bool:
    """A compaction's temp file exists only between its creation and the rename."""
    return any(sessions_dir.glob(f".{sid}.jsonl.*.tmp"))


def test_kill_9_during_background_log_compaction_loses_nothing_acknowledged(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {
        # Compact after every few header records, whatever the log's length: rewrites back to back.
        "CONTEXTSVC_FILES__COMPACT_MIN_RECORDS": "3",
        "CONTEXTSVC_FILES__COMPACT_RECORDS_PER_ROW": "0",
    }
    acked: dict[int, str] = {}
    sid = ""
    hits = 0
    rng = random.Random(9)
    for round_ in range(8):  # bounded: until kills have landed inside a rewrite twice
        server = ServerProcess(f"files:{data}", env=env).start()
        stop = threading.Event()
        with server.channel() as ch:
            stub = server.stub(ch)
            if not sid:
                sid = stub.CreateSession(pb.CreateSessionRequest(name="big")).id
                filler = "y" * 1500
                for i in range(0, 3000, 250):  # a 5 MB log: each rewrite takes a while
                    texts = [f"seed {i + j} {filler}" for j in range(250)]
                    acked.update(zip(_append(stub, sid, *texts), texts, strict=True))
            label = f"round {round_}"
            threads = [
                threading.Thread(target=_appender, args=(stub, sid, label, acked, stop)),
                threading.Thread(target=_renamer, args=(stub, sid, label, stop)),
                threading.Thread(target=_renamer, args=(stub, sid, label + "b", stop)),
            ]
            for t in threads:
                t.start()
            try:
                deadline = time.monotonic() + 6 + rng.random()
                while time.monotonic() < deadline:
                    if _rewrite_in_flight(data / "sessions", sid) and rng.random() < 0.5:
                        break
                    time.sleep(0.002)
                server.kill()
                hits += _rewrite_in_flight(data / "sessions", sid)
            finally:
                stop.set()
                for t in threads:
                    t.join(30)
        check = ServerProcess(f"files:{data}").start()
        try:
            with check.channel() as ch:
                stub = check.stub(ch)
                rows = dict(_contents(stub, sid))
                assert {n: rows.get(n) for n in acked} == acked  # every acknowledged message, unchanged
                assert sorted(rows) == list(range(1, len(rows) + 1))  # numbers gap-free
                assert _integrity(ch) == health_pb2.HealthCheckResponse.SERVING  # nothing damaged
                assert _append(stub, sid, "after") == [len(rows) + 1]
                acked[len(rows) + 1] = "after"
            assert not list((data / "sessions").glob("*.tmp"))  # the half-written rewrite was cleared
        finally:
            assert check.terminate() == 0
        if hits >= 2:
            break
    assert hits >= 2, "no kill landed inside a log rewrite"


# -- kill -9 during maintenance ----------------------------------------------------------------------


def test_kill_9_during_maintenance_loses_nothing_acknowledged(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {
        "CONTEXTSVC_MAINTENANCE__MODE": "enforce",
        "CONTEXTSVC_MAINTENANCE__MAX_SESSIONS": "4",
        "CONTEXTSVC_MAINTENANCE__INTERVAL_SECONDS": "0.05",
    }
    acked: dict[str, dict[int, str]] = {}
    keeper = ""
    rng = random.Random(5)
    removed_seen = 0
    for round_ in range(3):
        server = ServerProcess(f"files:{data}", env=env).start()
        stop = threading.Event()
        with server.channel() as ch:
            stub = server.stub(ch)
            if not keeper:
                keeper = stub.CreateSession(pb.CreateSessionRequest(name="keeper")).id
                _update(stub, r.Session(id=keeper, pinned=True), "pinned")
                acked[keeper] = {}
            thread = threading.Thread(target=_churner, args=(stub, keeper, f"r{round_}", acked, stop))
            thread.start()
            time.sleep(1.5 + rng.random())
            server.kill()
            stop.set()
            thread.join(30)
        removed_seen += server.stderr_text.count("maintenance removed a session")
        check = ServerProcess(f"files:{data}").start()  # maintenance in warn mode: nothing removed now
        try:
            with check.channel() as ch:
                stub = check.stub(ch)
                listed = _sessions(stub)
                assert keeper in listed
                for sid, rows in acked.items():
                    if sid not in listed:
                        continue  # removed by maintenance, all of it
                    got = dict(_contents(stub, sid))
                    assert {n: got.get(n) for n in rows} == rows, sid  # a session kept is whole
                assert _integrity(ch) == health_pb2.HealthCheckResponse.SERVING  # no half-removed session
        finally:
            assert check.terminate() == 0
        assert not list((data / "sessions").glob("*.tmp"))
        assert not list((data / "sessions").glob("*.corrupt-*"))
    assert removed_seen >= 3  # maintenance was removing sessions while the kills came
