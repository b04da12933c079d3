"""The files store under damage, through real ``serve`` processes (issue #9).

Each case ends in a stated outcome, no acknowledged message disappears without a trace, and no
sequence number a client saw is ever handed out again:

| damage                  | outcome on restart                                                     |
|-------------------------|------------------------------------------------------------------------|
| flipped byte mid-log    | record set aside, neighbours load, a stand-in holds its number; read-only |
| line cut mid-log        | same as a flipped byte                                                 |
| garbage tail            | dropped (an interrupted write); nothing lost; writable                 |
| deleted header          | rebuilt from the sequence mark (owner kept); read-only                 |
| file truncated          | the tail's numbers kept as stand-ins (from the mark); read-only         |
| read-only directory     | starts, serves reads; writes UNAVAILABLE; health NOT_SERVING until rw   |
| full disk               | writes UNAVAILABLE; health NOT_SERVING until space returns; nothing lost |

Damaged sessions say ``FAILED_PRECONDITION`` / ``SESSION_DAMAGED`` on writes, health reports
``contextsvc.store.integrity`` NOT_SERVING, and ``contextsvc fsck --repair`` makes them writable
with every acknowledged number still taken.

The read-only directory is a read-only bind mount and the full disk a 1 MiB tmpfs, both mounted
by the test: we run as root, for whom permission bits do not stop a write, so only a mount
really fails as a read-only or full disk does.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contextsvc._gen.v1 import context_service_pb2 as pb
from tests.support.rpc import all_messages, error_details, user
from tests.support.server import ServerProcess

pytestmark = pytest.mark.e2e

SERVICE = "contextsvc.v1.ContextService"
INTEGRITY = "contextsvc.store.integrity"
N = 8  # messages per session, one append each
FAST_HEALTH = {"CONTEXTSVC_STORE_HEALTH_INTERVAL_SECONDS": "0.2"}


def _health(server: ServerProcess, service: str) -> int:
    with server.channel() as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _wait_health(server: ServerProcess, service: str, status: int) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if _health(server, service) == status:
            return
        time.sleep(0.1)
    raise AssertionError(f"{service} never became {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")


def _fill(stub: Any, name: str) -> tuple[str, list[int]]:
    sid = stub.CreateSession(pb.CreateSessionRequest(name=name)).id
    acked: list[int] = []
    for i in range(N):
        resp = stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user(f"{name} {i + 1}")]))
        acked.extend(resp.sequence_numbers)
    return sid, acked


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")


def _append_fails(stub: Any, sid: str) -> dict[str, Any]:
    with pytest.raises(grpc.RpcError) as raised:
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("refused")]), timeout=10)
    return error_details(raised.value)


def _fsck(store: str, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "contextsvc", "fsck", "--store", store, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def test_corruption_matrix_every_case_ends_in_a_stated_outcome(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = f"files:{data}"
    first = ServerProcess(store).start()
    try:
        with first.channel() as ch:
            stub = first.stub(ch)
            cases = {name: _fill(stub, name) for name in ("flip", "cut", "garbage", "header", "truncated", "intact")}
    finally:
        assert first.terminate() == 0
    log = {name: data / "sessions" / f"{sid}.jsonl" for name, (sid, _) in cases.items()}
    # Line 0 is the header, line k holds message k.
    lines = _lines(log["flip"])
    lines[4] = lines[4].replace(b"flip 4", b"flip 5")  # one byte of message 4 changed
    log["flip"].write_bytes(b"\n".join(lines))
    lines = _lines(log["cut"])
    lines[3] = lines[3][: len(lines[3]) // 2]  # message 3's record cut in half, the rest intact
    log["cut"].write_bytes(b"\n".join(lines))
    with log["garbage"].open("ab") as fh:
        fh.write(b"\x00\x00\x00\x17garbage after a crash")
    log["header"].write_bytes(b"\n".join(_lines(log["header"])[1:]))
    raw = log["truncated"].read_bytes()
    log["truncated"].write_bytes(raw[: len(raw) // 2])

    second = ServerProcess(store, env=FAST_HEALTH).start()
    try:
        with second.channel() as ch:
            stub = second.stub(ch)
            for name, (sid, acked) in cases.items():
                rows = all_messages(stub, sid)
                # Every acknowledged number is still there, once, in order.
                assert [m.sequence_number for m in rows] == acked, name
                lost = [m.sequence_number for m in rows if "was lost" in m.content]
                kept = {m.sequence_number: m.content for m in rows if "was lost" not in m.content}
                assert all(kept[s] == f"{name} {s}" for s in kept), name  # nothing changed silently
                if name in ("flip", "cut"):
                    assert lost == [4 if name == "flip" else 3]
                elif name == "truncated":
                    assert lost and lost == list(range(lost[0], N + 1))
                else:
                    assert lost == [], name
                if name in ("garbage", "intact"):
                    resp = stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("next")]))
                    assert list(resp.sequence_numbers) == [N + 1], name
                else:
                    err = _append_fails(stub, sid)
                    assert (err["code"], err["reason"]) == (grpc.StatusCode.FAILED_PRECONDITION, "SESSION_DAMAGED"), (
                        name
                    )
                    # Reads and views still work on a damaged session.
                    view = stub.BuildContext(pb.BuildContextRequest(session_id=sid))
                    assert all("was lost" not in m.content for m in view.messages)
            header = stub.GetSession(pb.GetSessionRequest(session_id=cases["header"][0]))
            assert header.name == "" and header.display_message_count == N  # rebuilt: the owner came from the mark
        assert _health(second, SERVICE) == health_pb2.HealthCheckResponse.SERVING
        assert _health(second, INTEGRITY) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        assert second.terminate() == 0

    report = _fsck(store)
    assert report.returncode == 1
    damaged = {name for name, (sid, _) in cases.items() if f"{sid}  damaged" in report.stdout}
    assert damaged == {"flip", "cut", "header", "truncated"}, report.stdout
    assert _fsck(store, "--repair").returncode == 0
    assert "6 ok" in _fsck(store).stdout

    third = ServerProcess(store).start()
    try:
        with third.channel() as ch:
            stub = third.stub(ch)
            for name, (sid, _) in cases.items():
                resp = stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("after repair")]))
                expected = N + 2 if name in ("garbage", "intact") else N + 1
                assert list(resp.sequence_numbers) == [expected], name  # never a number handed out before
        assert _health(third, INTEGRITY) == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert third.terminate() == 0


@contextlib.contextmanager
def _mounted(args: list[str], target: Path) -> Iterator[None]:
    subprocess.run(["mount", *args, str(target)], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)


def test_a_read_only_directory_serves_reads_and_reports_not_serving(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = f"files:{data}"
    first = ServerProcess(store).start()
    try:
        with first.channel() as ch:
            sid, acked = _fill(first.stub(ch), "ro")
    finally:
        assert first.terminate() == 0

    with _mounted(["--bind", str(data)], data):
        subprocess.run(["mount", "-o", "remount,ro,bind", str(data)], check=True, capture_output=True)
        server = ServerProcess(store, env=FAST_HEALTH).start()
        try:
            assert _health(server, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert _health(server, "") == health_pb2.HealthCheckResponse.NOT_SERVING
            with server.channel() as ch:
                stub = server.stub(ch)
                assert [m.sequence_number for m in all_messages(stub, sid)] == acked
                assert _append_fails(stub, sid)["code"] == grpc.StatusCode.UNAVAILABLE
                subprocess.run(["mount", "-o", "remount,rw,bind", str(data)], check=True, capture_output=True)
                _wait_health(server, SERVICE, health_pb2.HealthCheckResponse.SERVING)
                resp = stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("rw again")]))
                assert list(resp.sequence_numbers) == [N + 1]
        finally:
            assert server.terminate() == 0


def test_a_full_disk_reports_not_serving_and_loses_nothing(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    with _mounted(["-t", "tmpfs", "-o", "size=1m", "tmpfs"], disk):
        store = f"files:{disk / 'data'}"
        server = ServerProcess(store, env={**FAST_HEALTH, "CONTEXTSVC_FILES__ERROR_LOG_PER_MINUTE": "3"}).start()
        try:
            with server.channel() as ch:
                stub = server.stub(ch)
                sid, acked = _fill(stub, "full")
                filler = disk / "filler"
                fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
                try:
                    for _ in range(2048):  # bounded: 1 MiB in 1 KiB writes fills the tmpfs
                        os.write(fd, b"x" * 1024)
                except OSError:
                    pass  # full
                finally:
                    os.close(fd)
                err = None
                for i in range(200):  # bounded: the last free bytes of a page may take a few records
                    try:
                        resp = stub.AppendMessages(
                            pb.AppendMessagesRequest(session_id=sid, messages=[user("y" * 2000 + str(i))]), timeout=10
                        )
                        acked.extend(resp.sequence_numbers)
                    except grpc.RpcError as exc:
                        err = error_details(exc)
                        break
                assert err is not None and err["code"] == grpc.StatusCode.UNAVAILABLE
                refused = 0
                for i in range(20):  # every append this size fails alike; the log says so 3 times a minute
                    big = pb.AppendMessagesRequest(session_id=sid, messages=[user("z" * 4000 + str(i))])
                    with pytest.raises(grpc.RpcError) as again:
                        stub.AppendMessages(big, timeout=10)
                    refused += again.value.code() == grpc.StatusCode.UNAVAILABLE
                assert refused == 20
                assert server.stderr_text.count("cannot append to the log of a session") == 3
                _wait_health(server, SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
                filler.unlink()
                _wait_health(server, SERVICE, health_pb2.HealthCheckResponse.SERVING)
                resp = stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("room again")]))
                assert list(resp.sequence_numbers) == [acked[-1] + 1]
                acked.extend(resp.sequence_numbers)
        finally:
            assert server.terminate() == 0
        again = ServerProcess(store).start()
        try:
            with again.channel() as ch:
                assert [m.sequence_number for m in all_messages(again.stub(ch), sid)] == acked
        finally:
            again.terminate()


def test_fsck_reports_a_log_it_cannot_read_and_checks_the_others(tmp_path: Path) -> None:
    """A directory where a session's log should be stopped the whole run with
    ``contextsvc fsck: [Errno 21] Is a directory: '…'``, the other sessions unchecked."""
    data = tmp_path / "data"
    store = f"files:{data}"
    server = ServerProcess(store).start()
    try:
        with server.channel() as ch:
            sid, _ = _fill(server.stub(ch), "fine")
    finally:
        assert server.terminate() == 0
    blocked = "0b6f1d2e-3c4a-4b5c-8d6e-7f8091a2b3c4"
    (data / "sessions" / f"{blocked}.jsonl").mkdir()
    for extra in ((), ("--repair",)):
        done = _fsck(store, *extra)
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr and done.stderr == "", done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].endswith(f"(2 sessions{', repair' if extra else ''})"), done.stdout
        (entry,) = [line for line in lines if line.startswith(blocked)]
        assert "unreadable" in entry and f"{blocked}.jsonl is a directory where a file is expected" in entry
        assert lines[-1] == "1 ok, 0 torn, 0 recovered, 0 damaged, 1 unreadable", done.stdout
        assert not any(line.startswith(sid) for line in lines)  # checked, and fine
    assert (data / "sessions" / f"{blocked}.jsonl").is_dir()  # left where it was


def test_fsck_repair_of_a_session_left_with_only_an_unusable_mark_file(tmp_path: Path) -> None:
    """No log and a mark file holding nothing (a crash between creating the two, a log removed by
    hand): ``--repair`` tried to set the missing log aside and stopped the whole run with
    ``[Errno 2] No such file or directory``, printing no report."""
    data = tmp_path / "data"
    store = f"files:{data}"
    server = ServerProcess(store).start()
    try:
        with server.channel() as ch:
            _fill(server.stub(ch), "fine")
    finally:
        assert server.terminate() == 0
    orphan = "3b6f1d2e-3c4a-4b5c-8d6e-7f8091a2b3c4"
    (data / "sessions" / f"{orphan}.jsonl.mark").write_bytes(b"")
    done = _fsck(store, "--repair")
    assert done.stderr == "", done.stderr
    assert done.returncode == 0, done.stdout
    assert "mark moved aside to" in done.stdout and done.stdout.splitlines()[-1].startswith("1 ok, ")
    assert not (data / "sessions" / f"{orphan}.jsonl.mark").exists()
    again = _fsck(store)
    assert (
        again.returncode == 0 and again.stdout.splitlines()[-1] == "1 ok, 0 torn, 0 recovered, 0 damaged, 0 unreadable"
    )
