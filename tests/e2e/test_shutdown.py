"""SIGTERM under load drains (issue 13, item 6): every call is OK or UNAVAILABLE, a call in flight
finishes, a watcher is told where to resume, and nothing acknowledged is lost after a restart."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import context_service_pb2_grpc as pb_grpc
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.fake_llm import FakeLLM
from tests.support.rpc import all_messages, error_details
from tests.support.server import ServerProcess, closed_port

WRITERS = 16


async def test_sigterm_under_load_drains_and_loses_nothing(tmp_path: Path, llm: FakeLLM) -> None:
    env = {
        "CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL": llm.base_url,
        "CONTEXTSVC_SUMMARIZER__OPENAI__TIMEOUT_SECONDS": "10",
        "CONTEXTSVC_SUMMARIZER__OPENAI__MAX_RETRIES": "0",
        "CONTEXTSVC_SHUTDOWN_GRACE_SECONDS": "8",
    }
    server = ServerProcess(f"files:{tmp_path / 'data'}", env=env).start()
    acked: dict[str, list[tuple[int, str]]] = {}
    outcomes: list[grpc.StatusCode] = []
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.ContextServiceStub(channel)
            sessions = [(await stub.CreateSession(pb.CreateSessionRequest(name=f"w{i}"))).id for i in range(4)]
            slow = (await stub.CreateSession(pb.CreateSessionRequest(name="slow"))).id
            await _long_turns(stub, slow)
            for sid in sessions:
                acked[sid] = []
            sigterm_sent = asyncio.Event()
            watched: list[int] = []
            watcher_end: dict[str, Any] = {}
            health_seen: list[int] = []

            async def writer(k: int) -> None:
                sid = sessions[k % len(sessions)]
                i = 0
                while True:
                    content = f"writer {k} message {i}"
                    try:
                        got = await stub.AppendMessages(
                            pb.AppendMessagesRequest(
                                session_id=sid,
                                messages=[r.Message(role=r.ROLE_USER, content=content)],
                                request_id=f"w{k}-{i}",
                            ),
                            timeout=20,
                        )
                        acked[sid].append((got.sequence_numbers[0], content))
                        outcomes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as err:
                        outcomes.append(err.code())
                        if sigterm_sent.is_set():
                            return
                        await asyncio.sleep(0.01)
                    i += 1

            async def watcher() -> None:
                try:
                    async for event in stub.StreamEvents(pb.StreamEventsRequest()):
                        watched.append(event.event_id)
                except grpc.aio.AioRpcError as err:
                    watcher_end.update(error_details(err))  # type: ignore[arg-type]

            async def health_watch() -> None:
                health = health_pb2_grpc.HealthStub(channel)
                try:
                    async for status in health.Watch(health_pb2.HealthCheckRequest(service="")):
                        health_seen.append(status.status)
                except grpc.aio.AioRpcError:
                    pass

            async def slow_compress() -> grpc.StatusCode:
                llm.control(mode="hang", hang_seconds=2.0)
                try:
                    reply = await stub.Compress(
                        pb.CompressRequest(
                            session_id=slow, profile=r.Profile(compression=r.CompressionSettings(summarizer="openai"))
                        ),
                        timeout=30,
                    )
                    assert reply.compressed
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as err:
                    return err.code()

            tasks = [asyncio.create_task(writer(k)) for k in range(WRITERS)]
            stream = asyncio.create_task(watcher())
            health_task = asyncio.create_task(health_watch())
            await asyncio.sleep(1.0)
            compress = asyncio.create_task(slow_compress())
            await asyncio.sleep(0.5)  # the summarizer call is now hanging: Compress is in flight
            assert server.proc is not None
            server.proc.send_signal(15)
            sigterm_sent.set()
            sent_at = time.monotonic()
            compress_code = await compress
            await asyncio.wait_for(asyncio.gather(*tasks, stream, health_task), timeout=30)
            exit_code = server.proc.wait(20)
            drained_in = time.monotonic() - sent_at
    finally:
        llm.reset()
        server.kill()

    assert exit_code == 0
    assert drained_in < 8 + 5
    counts = {code: outcomes.count(code) for code in set(outcomes)}
    assert set(counts) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, counts
    assert counts.get(grpc.StatusCode.OK, 0) > 50 and counts.get(grpc.StatusCode.UNAVAILABLE, 0) >= WRITERS
    # The call in flight when SIGTERM came finished normally inside the grace period.
    assert compress_code == grpc.StatusCode.OK
    # The watcher was told where to resume: the id of the last event it received.
    assert watcher_end["code"] == grpc.StatusCode.UNAVAILABLE
    assert watcher_end["reason"] == "SHUTTING_DOWN"
    assert watched and watcher_end["metadata"]["after_event_id"] == str(watched[-1])
    assert health_seen[0] == health_pb2.HealthCheckResponse.SERVING
    assert health_pb2.HealthCheckResponse.NOT_SERVING in health_seen
    log = server.stderr_text
    assert '"event": "stopping"' in log and '"event": "stopped"' in log and "Traceback" not in log

    # Restart on the same files: every acknowledged append is there, at the number it was given.
    again = ServerProcess(f"files:{tmp_path / 'data'}").start()
    try:
        with again.channel() as ch:
            stub2 = again.stub(ch)
            for sid, appended in acked.items():
                stored = {m.sequence_number: m.content for m in all_messages(stub2, sid)}
                assert appended, sid
                for seq, content in appended:
                    assert stored.get(seq) == content, (sid, seq, content)
    finally:
        assert again.terminate() == 0


@pytest.mark.parametrize(
    ("protocol", "collector"),
    [("grpc", "refusing"), ("http/protobuf", "refusing"), ("grpc", "silent")],
)
def test_sigterm_with_an_unreachable_collector_exits_within_the_grace(
    tmp_path: Path, protocol: str, collector: str
) -> None:
    """The exporters retry an unreachable collector with backoff for tens of seconds; the flush at
    exit is cut short at the grace (one warning line), or the orchestrator's SIGKILL would come first."""
    grace = 1.0
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1] if collector == "silent" else closed_port()
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "CONTEXTSVC_SHUTDOWN_GRACE_SECONDS": str(grace),
        }
        with ServerProcess(f"files:{tmp_path / 'data'}", env=env).start() as server:
            with server.channel() as channel:
                stub = server.stub(channel)
                sid = stub.CreateSession(pb.CreateSessionRequest(name="traced")).id
                for i in range(20):  # spans and metrics waiting to be exported
                    stub.AppendMessages(
                        pb.AppendMessagesRequest(
                            session_id=sid, messages=[r.Message(role=r.ROLE_USER, content=f"m{i}")]
                        )
                    )
            started = time.monotonic()
            assert server.terminate(timeout=60) == 0
            took = time.monotonic() - started
            log = server.stderr_text
    assert took < grace + 2.0, took
    assert "telemetry not flushed in time" in log


def test_calls_arriving_during_the_drain_are_refused_not_cancelled(tmp_path: Path) -> None:
    """Writers that call again as soon as a call ends, each on its own connection: a call the
    transport accepted as the drain finished must reach the gate and be refused (UNAVAILABLE,
    SHUTTING_DOWN, which clients retry), not be cancelled by the transport's close (CANCELLED)."""
    writers = 20
    server = ServerProcess(f"files:{tmp_path / 'data'}").start()
    sigterm_sent = threading.Event()
    outcomes: list[tuple[grpc.StatusCode, str]] = []

    def writer(k: int) -> None:
        with server.channel() as channel:
            stub = server.stub(channel)
            sid = stub.CreateSession(pb.CreateSessionRequest(name=f"w{k}")).id
            for i in range(100_000):  # bounded; ends at its first refusal after SIGTERM
                try:
                    stub.AppendMessages(
                        pb.AppendMessagesRequest(
                            session_id=sid, messages=[r.Message(role=r.ROLE_USER, content=f"{i}")]
                        ),
                        timeout=20,
                    )
                    outcomes.append((grpc.StatusCode.OK, ""))
                except grpc.RpcError as err:
                    outcomes.append((err.code(), error_details(err)["reason"]))
                    if sigterm_sent.is_set():
                        return

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(writers)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        assert server.proc is not None
        server.proc.send_signal(15)
        sigterm_sent.set()
        for thread in threads:
            thread.join(30)
        exit_code = server.proc.wait(20)
    finally:
        server.kill()
    assert exit_code == 0
    codes = {code for code, _ in outcomes}
    assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, sorted(outcomes, key=str)[:5]
    refused = [reason for code, reason in outcomes if code == grpc.StatusCode.UNAVAILABLE]
    assert refused.count("SHUTTING_DOWN") >= writers // 2, refused


def _slow_summarizer_env(llm: FakeLLM, **extra: str) -> dict[str, str]:
    """A server whose ``openai`` summarizer is ``llm``, one attempt, and a grace a hang fits in."""
    return {
        "CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL": llm.base_url,
        "CONTEXTSVC_SUMMARIZER__OPENAI__TIMEOUT_SECONDS": "10",
        "CONTEXTSVC_SUMMARIZER__OPENAI__MAX_RETRIES": "0",
        "CONTEXTSVC_SHUTDOWN_GRACE_SECONDS": "8",
        **extra,
    }


class _Watcher:
    """StreamEvents of one session read in a task: the kinds and ids it delivered, and how it ended."""

    def __init__(self, stub: Any, sid: str) -> None:
        self.kinds: list[str] = []
        self.ids: list[int] = []
        self.end: dict[str, Any] = {}
        self.started = asyncio.Event()  # a compression_started arrived
        self.task = asyncio.create_task(self._read(stub, sid))

    async def _read(self, stub: Any, sid: str) -> None:
        try:
            async for event in stub.StreamEvents(pb.StreamEventsRequest(session_id=sid)):
                self.kinds.append(event.WhichOneof("payload"))
                self.ids.append(event.event_id)
                if self.kinds[-1] == "compression_started":
                    self.started.set()
        except grpc.aio.AioRpcError as err:
            self.end.update(error_details(err))  # type: ignore[arg-type]

    def check_closed_before_the_end(self) -> None:
        """The compaction's closing event came before the stream ended, which names it to resume from."""
        assert self.kinds[self.kinds.index("compression_started") + 1 :] == ["context_compressed"], self.kinds
        assert self.end["code"] == grpc.StatusCode.UNAVAILABLE and self.end["reason"] == "SHUTTING_DOWN"
        assert self.end["metadata"]["after_event_id"] == str(self.ids[-1])


@pytest.mark.parametrize("store", ["files", "memory"])
async def test_a_watcher_gets_the_events_of_calls_finishing_during_the_drain(
    tmp_path: Path, llm: FakeLLM, store: str
) -> None:
    """A Compress in flight when SIGTERM comes finishes within the grace; a watcher of its session
    receives its closing event before being told where to resume, so no event falls between the
    stream's end and a resume elsewhere."""
    data = "memory" if store == "memory" else f"files:{tmp_path / 'data'}"
    server = ServerProcess(data, env=_slow_summarizer_env(llm)).start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.ContextServiceStub(channel)
            sid = (await stub.CreateSession(pb.CreateSessionRequest(name="slow"))).id
            await _long_turns(stub, sid)
            watch = _Watcher(stub, sid)
            await asyncio.sleep(0.3)  # the stream is open
            llm.control(mode="hang", hang_seconds=2.0)
            compress = stub.Compress(
                pb.CompressRequest(
                    session_id=sid, profile=r.Profile(compression=r.CompressionSettings(summarizer="openai"))
                ),
                timeout=30,
            )
            await asyncio.wait_for(watch.started.wait(), timeout=10)
            assert server.proc is not None
            server.proc.send_signal(15)
            reply = await compress
            await asyncio.wait_for(watch.task, timeout=30)
            exit_code = server.proc.wait(20)
    finally:
        llm.reset()
        server.kill()
    assert exit_code == 0 and reply.compressed
    watch.check_closed_before_the_end()


async def test_a_watcher_gets_the_events_of_a_compaction_a_build_left_running(tmp_path: Path, llm: FakeLLM) -> None:
    """A build that stopped waiting for its compaction (``hot_path.build_wait_seconds``) left it
    running: at SIGTERM it finishes within the grace, and a watcher receives its closing event
    before its stream ends (it was cancelled after the streams had ended)."""
    env = _slow_summarizer_env(llm, CONTEXTSVC_HOT_PATH__BUILD_WAIT_SECONDS="0.3")
    server = ServerProcess(f"files:{tmp_path / 'data'}", env=env).start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.ContextServiceStub(channel)
            sid = (await stub.CreateSession(pb.CreateSessionRequest(name="slow"))).id
            await _long_turns(stub, sid)
            await _long_turns(stub, sid)  # over the small window below
            watch = _Watcher(stub, sid)
            await asyncio.sleep(0.3)  # the stream is open
            llm.control(mode="hang", hang_seconds=2.0)
            small = r.Profile(context_window=3000, compression=r.CompressionSettings(summarizer="openai"))
            view = await stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=small), timeout=30)
            assert any("still running" in n for n in view.notices), list(view.notices)
            assert server.proc is not None
            server.proc.send_signal(15)
            await asyncio.wait_for(watch.task, timeout=30)
            exit_code = server.proc.wait(20)
    finally:
        llm.reset()
        server.kill()
    assert exit_code == 0
    watch.check_closed_before_the_end()


async def _long_turns(stub: Any, sid: str) -> None:
    """Ten long turns: enough for a compaction to summarize some."""
    for turn in range(10):
        await stub.AppendMessages(
            pb.AppendMessagesRequest(
                session_id=sid,
                messages=[
                    r.Message(role=r.ROLE_USER, content=f"question {turn} " + "words " * 80),
                    r.Message(role=r.ROLE_ASSISTANT, content=f"answer {turn} " + "more " * 80),
                ],
            )
        )


def test_with_a_bundled_gateway_health_turns_not_serving_at_once_and_the_exit_is_0() -> None:
    """SIGTERM drains the server while the bundled gateway closes its sockets, not after: a browser
    that never answers the close (the gateway waits ``gateway.close_timeout_seconds`` for it) kept
    health SERVING and the server taking calls for those seconds."""
    from tests.support.gateway import Process
    from tests.support.rawws import RawWebSocket

    server = Process(
        ["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--gateway", f"127.0.0.1:{closed_port()}"],
        env={"CONTEXTSVC_GATEWAY__CLOSE_TIMEOUT_SECONDS": "3"},
    ).start()
    assert server.proc is not None
    try:
        with grpc.insecure_channel(server.grpc_address) as channel:
            sid = pb_grpc.ContextServiceStub(channel).CreateSession(pb.CreateSessionRequest(name="watched")).id
            host, _, port = server.gateway_address.rpartition(":")
            silent = RawWebSocket(host, int(port), f"/ws/sessions/{sid}")  # never reads again
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="contextsvc.v1.ContextService")
            assert health.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            status: Any = None
            while time.monotonic() - started < 1.0:
                try:
                    status = health.Check(request, timeout=0.5).status
                except grpc.RpcError as exc:
                    status = exc.code()  # the transport already closed: no longer SERVING either
                if status != health_pb2.HealthCheckResponse.SERVING:
                    break
                time.sleep(0.02)
            assert status != health_pb2.HealthCheckResponse.SERVING, "still SERVING 1 s after SIGTERM"
        assert server.proc.wait(15) == 0
        silent.sock.close()
    finally:
        server.kill()
    assert "Traceback" not in server.stderr_text


def test_a_grace_of_0_does_not_report_calls_cancelled_when_none_ran(tmp_path: Path) -> None:
    with ServerProcess("memory", env={"CONTEXTSVC_SHUTDOWN_GRACE_SECONDS": "0"}).start() as server:
        assert server.terminate() == 0
        log = server.stderr_text
    assert '"event": "stopped"' in log
    assert "grace period over" not in log, log


@pytest.mark.parametrize("command", ["serve", "serve --gateway", "gateway"])
def test_sigterm_right_after_the_listening_line_drains_and_exits_0(command: str) -> None:
    """Scripts and tests stop a server as soon as it printed where it listens: the signal handlers
    are in place by then (a SIGTERM in between killed the process, exit -15)."""
    from tests.support.gateway import Process

    args = {
        "serve": ["serve", "--listen", "127.0.0.1:0", "--store", "memory"],
        "serve --gateway": ["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--gateway", "127.0.0.1:0"],
        "gateway": ["gateway", "--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{closed_port()}"],
    }[command]
    for _ in range(3):
        process = Process(args).start()
        try:
            assert process.terminate() == 0, process.stderr_text[-2000:]
        finally:
            process.kill()


@pytest.mark.parametrize("where", ["compress_call", "left_by_a_build"])
async def test_a_compaction_outliving_the_grace_closes_before_the_streams_end(
    tmp_path: Path, llm: FakeLLM, where: str
) -> None:
    """A summarizer slower than the grace: the compaction (a Compress call's, or one a build stopped
    waiting for) is cancelled, and a watcher receives its compression_refused (failed) before its
    stream ends naming that event, so a "compressing…" indicator ends. It was cancelled by the
    transport's stop after the streams had ended, and on the files store, whose events do not
    survive a restart, the start stayed open for good."""
    env = _slow_summarizer_env(
        llm, CONTEXTSVC_SHUTDOWN_GRACE_SECONDS="1", CONTEXTSVC_HOT_PATH__BUILD_WAIT_SECONDS="0.3"
    )
    server = ServerProcess(f"files:{tmp_path / 'data'}", env=env).start()
    failure: grpc.aio.AioRpcError | None = None
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.ContextServiceStub(channel)
            sid = (await stub.CreateSession(pb.CreateSessionRequest(name="slower than the grace"))).id
            await _long_turns(stub, sid)
            await _long_turns(stub, sid)
            watch = _Watcher(stub, sid)
            await asyncio.sleep(0.3)  # the stream is open
            llm.control(mode="hang", hang_seconds=8.0)
            summarize = r.CompressionSettings(summarizer="openai", strategies=["summarize"])
            compress = None
            if where == "compress_call":
                compress = stub.Compress(
                    pb.CompressRequest(session_id=sid, profile=r.Profile(compression=summarize)), timeout=30
                )
            else:
                small = r.Profile(context_window=3000, compression=summarize)
                view = await stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=small), timeout=30)
                assert any("still running" in n for n in view.notices), list(view.notices)
            await asyncio.wait_for(watch.started.wait(), timeout=10)
            assert server.proc is not None
            server.proc.send_signal(15)
            if compress is not None:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await compress
                failure = caught.value
            await asyncio.wait_for(watch.task, timeout=30)
            exit_code = server.proc.wait(20)
    finally:
        llm.reset()
        server.kill()
    assert exit_code == 0
    assert failure is None or failure.code() == grpc.StatusCode.UNAVAILABLE
    assert watch.kinds[watch.kinds.index("compression_started") + 1 :] == ["compression_refused"], watch.kinds
    assert watch.end["code"] == grpc.StatusCode.UNAVAILABLE and watch.end["reason"] == "SHUTTING_DOWN"
    assert watch.end["metadata"]["after_event_id"] == str(watch.ids[-1])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_server_starts_stops_it_and_exits_0(tmp_path: Path, sig: signal.Signals) -> None:
    """A SIGTERM while the store opened (a pod deleted as it starts) killed the process by the
    signal's default action; a Ctrl-C cancelled the start half-way and ended with tracebacks. The
    handlers are in place before the start: it completes, stops, and exits 0 without saying it
    listens."""
    script = (
        "import os, sys\n"
        "from contextsvc import server\n"
        "real = server.start\n"
        "async def start(settings, **kw):\n"
        f"    os.kill(os.getpid(), {int(sig)})  # as the store opens\n"
        "    return await real(settings, **kw)\n"
        "server.start = start\n"
        "from contextsvc.cli import main\n"
        f"sys.exit(main(['serve', '--listen', '127.0.0.1:0', '--store', 'files:{tmp_path / 'data'}']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "listening on" not in done.stdout
    assert '"event": "stopped"' in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_gateway_starts_stops_it_and_exits_0(sig: signal.Signals) -> None:
    """The standalone gateway took its signal handlers only once it listened: a SIGTERM while it
    bound killed it by the signal's default action (-15). Now it closes once up, exit 0, without
    saying it listens (no service needed: the gateway calls it only for sockets)."""
    script = (
        "import os, sys\n"
        "from contextsvc.gateway import server\n"
        "real = server.start_gateway\n"
        "async def start_gateway(*args, **kw):\n"
        f"    os.kill(os.getpid(), {int(sig)})  # as it binds\n"
        "    return await real(*args, **kw)\n"
        "server.start_gateway = start_gateway\n"
        "from contextsvc.cli import main\n"
        "sys.exit(main(['gateway', '--listen', '127.0.0.1:0', '--target', '127.0.0.1:9']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "listening on" not in done.stdout and "Traceback" not in done.stderr, done.stderr[-2000:]
