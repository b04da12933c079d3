"""OpenTelemetry end to end: a real server exports over OTLP/gRPC to a receiver this test runs.

The receiver implements the OTLP collector services from ``opentelemetry-proto``; the server is told
where it is only through the standard ``OTEL_*`` variables. A client ``traceparent`` must become the
parent of the server's spans; one forced compaction with an HTTP summarizer must produce the
compaction span, a GenAI client span, store spans and the compaction metrics; message content must
appear in no span; and with no exporter configured nothing is sent at all.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from contextsvc import telemetry
from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.fake_llm import FakeLLM
from tests.support.rpc import assistant, tool, user
from tests.support.server import ServerProcess

pytestmark = pytest.mark.e2e

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
METHOD_BUILD = "/contextsvc.v1.ContextService/BuildContext"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
SECRET_CONTENT = "the-vault-passphrase-is-zebra-42"
WINDOW = 4096


class Receiver(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """A minimal OTLP collector: keeps every span and metric it is sent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[Any] = []
        self.metrics: list[Any] = []
        self.requests = 0

    def Export(self, request: Any, context: Any) -> Any:  # one name for both services
        with self.lock:
            self.requests += 1
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        self.spans.extend(scope_spans.spans)
                return trace_service_pb2.ExportTraceServiceResponse()
            for resource_metrics in request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    self.metrics.extend(scope_metrics.metrics)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    def wait_for(self, predicate: Any, timeout: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate(self):
                    return True
            time.sleep(0.1)
        return False


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    found = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(found, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(found, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield found, port
    finally:
        server.stop(0)


def _otel_env(port: int) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_SERVICE_NAME": "contextsvc-e2e",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "300",
    }


def _clean_env() -> dict[str, str]:
    """The test runner's environment without any OTEL_* variable a developer may have set."""
    return {k: ("" if k.startswith("OTEL_") else v) for k, v in os.environ.items()}


def _attrs(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None
    return out


def _store_calls(span: Any) -> dict[str, int]:
    """operation -> calls, from a span's ``contextsvc.store.<op>.calls`` attributes."""
    prefix, suffix = "contextsvc.store.", ".calls"
    return {
        key[len(prefix) : -len(suffix)]: value
        for key, value in _attrs(span).items()
        if key.startswith(prefix) and key.endswith(suffix)
    }


def _profile() -> r.Profile:
    return r.Profile(
        model="m-telemetry",
        context_window=WINDOW,
        system_prompt="You are terse.",
        compression=r.CompressionSettings(summarizer="openai", strategies=["summarize"]),
    )


def _fill(stub: Any, sid: str, turns: int) -> None:
    batch: list[r.Message] = []
    for t in range(turns):
        batch += [
            user(f"turn {t}: {SECRET_CONTENT} check module_{t}.py"),
            assistant("", [(f"c{t}", "read_file")]),
            tool(f"c{t}", f"def handler_{t}():\n    return {t}\n" * 20),
            assistant(f"module_{t}.py defines handler_{t}"),
        ]
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=batch))


def test_spans_continue_the_client_trace_and_describe_one_compaction(
    tmp_path: Path, receiver: tuple[Receiver, int], llm: FakeLLM
) -> None:
    found, port = receiver
    llm.reset()
    env = {
        **_clean_env(),
        **_otel_env(port),
        "CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL": llm.base_url,
        "CONTEXTSVC_SUMMARIZER__OPENAI__MODEL": "fake-summarizer",
    }
    proc = ServerProcess(f"files:{tmp_path / 'data'}", env=env).start()
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
    try:
        with proc.channel() as ch:
            stub = proc.stub(ch)
            meta = (("traceparent", traceparent),)
            sid = stub.CreateSession(pb.CreateSessionRequest(name="otel"), metadata=meta).id
            _fill(stub, sid, 12)
            done = stub.Compress(pb.CompressRequest(session_id=sid, profile=_profile()), metadata=meta)
            assert done.compressed
            view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=_profile()), metadata=meta)
            assert view.messages
            with pytest.raises(grpc.RpcError):
                stub.GetSession(pb.GetSessionRequest(session_id="00000000-0000-4000-8000-000000000000"))

        def compaction_seen(rcv: Receiver) -> bool:
            names = {s.name for s in rcv.spans}
            metric_names = {m.name for m in rcv.metrics}
            return (
                "contextsvc.compaction" in names
                and "contextsvc.build_view" in names
                and "/contextsvc.v1.ContextService/GetSession" in names
                and "contextsvc.compressions" in metric_names
                and "gen_ai.client.operation.duration" in metric_names
            )

        assert found.wait_for(compaction_seen), sorted({s.name for s in found.spans})
    finally:
        proc.terminate()

    spans = list(found.spans)
    by_id = {s.span_id: s for s in spans}
    trace_id = bytes.fromhex(TRACE_ID)

    compress_rpc = [s for s in spans if s.name == "/contextsvc.v1.ContextService/Compress"]
    assert len(compress_rpc) == 1
    rpc_span = compress_rpc[0]
    # The client's traceparent is honoured: same trace, the client's span as parent.
    assert rpc_span.trace_id == trace_id
    assert rpc_span.parent_span_id == bytes.fromhex(CLIENT_SPAN_ID)

    (compaction,) = [s for s in spans if s.name == "contextsvc.compaction"]
    assert compaction.trace_id == trace_id
    assert compaction.parent_span_id == rpc_span.span_id
    attrs = _attrs(compaction)
    assert attrs["contextsvc.session_id"] == sid
    assert attrs["contextsvc.compaction.reason"] == "forced"
    assert attrs["contextsvc.compaction.method"] == "summary"
    assert attrs["contextsvc.compaction.messages_before"] == 48
    assert attrs["contextsvc.compaction.messages_after"] < 48
    assert attrs["contextsvc.compaction.tokens_after"] < attrs["contextsvc.compaction.tokens_before"]

    # The summarizer call is a GenAI client span under the compaction.
    (chat,) = [s for s in spans if s.name == "chat fake-summarizer"]
    chat_attrs = _attrs(chat)
    assert chat.kind == chat.SPAN_KIND_CLIENT
    assert chat_attrs["gen_ai.operation.name"] == "chat"
    assert chat_attrs["gen_ai.provider.name"] == "openai"
    assert chat_attrs["gen_ai.request.model"] == "fake-summarizer"
    assert chat_attrs["gen_ai.conversation.id"] == sid
    assert chat_attrs["gen_ai.usage.input_tokens"] >= 1
    assert chat_attrs["gen_ai.usage.output_tokens"] >= 1
    ancestor = chat
    while ancestor.parent_span_id and ancestor.parent_span_id in by_id and ancestor is not compaction:
        ancestor = by_id[ancestor.parent_span_id]
    assert ancestor is compaction

    # The HTTP call to the summarizer (httpx instrumentation) sits under the GenAI span.
    assert any(s.parent_span_id == chat.span_id and s.kind == s.SPAN_KIND_CLIENT for s in spans)
    # Store calls are counted and timed per operation on the span they ran under (a span or an
    # event each cost more than the call); only a failed or slow call gets an event of its own.
    assert not [s.name for s in spans if s.name.startswith("store.")]
    compress_calls = {k for s in (rpc_span, compaction) for k in _store_calls(s)}
    assert compress_calls, "the Compress trace records its store calls"

    (build,) = [s for s in spans if s.name == "contextsvc.build_view"]
    build_attrs = _attrs(build)
    assert build_attrs["gen_ai.request.model"] == "m-telemetry"
    assert build_attrs["contextsvc.view.tokens"] == view.estimate.total
    calls = _store_calls(build)
    # This build remembers its profile and compacts: both read the context and session again
    # (under the compaction lock), beside the build's own read, and the state is written.
    assert calls.get("context_and_session", 0) >= 2, build_attrs
    assert {"update_state"} <= set(calls), build_attrs
    for op in calls:
        assert build_attrs[f"contextsvc.store.{op}.duration_ms"] >= 0
    # Only a failed call or one slower than telemetry_slow_store_ms (10 ms) has an event of its own.
    for event in [e for e in build.events if e.name.startswith("store.")]:
        event_attrs = _attrs(event)
        assert "error.type" in event_attrs or event_attrs["contextsvc.store.duration_ms"] >= 10, event_attrs
    assert _attrs(build)["contextsvc.session_id"] == sid

    # The server span: rpc.* attributes and the status code; a client's mistake is not an error.
    (build_rpc,) = [s for s in spans if s.name == "/contextsvc.v1.ContextService/BuildContext"]
    assert build.parent_span_id == build_rpc.span_id
    assert build_rpc.kind == build_rpc.SPAN_KIND_SERVER
    rpc_attrs = _attrs(build_rpc)
    assert rpc_attrs["rpc.system"] == "grpc"
    assert rpc_attrs["rpc.service"] == "contextsvc.v1.ContextService"
    assert rpc_attrs["rpc.method"] == "BuildContext"
    assert rpc_attrs["rpc.grpc.status_code"] == 0
    (missing,) = [s for s in spans if s.name == "/contextsvc.v1.ContextService/GetSession"]
    assert _attrs(missing)["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert missing.status.code == missing.status.STATUS_CODE_UNSET

    # Content never goes into spans.
    for span in spans:
        for value in _attrs(span).values():
            assert SECRET_CONTENT not in str(value), span.name


def test_a_trace_the_sampler_drops_exports_nothing_below_it(receiver: tuple[Receiver, int]) -> None:
    """Root traces sampled at ratio 0: only a caller's sampled traceparent makes spans; the metrics
    still count every call."""
    found, port = receiver
    env = {
        **_clean_env(),
        **_otel_env(port),
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
        # every store call counts as slow here: each also gets an event of its own
        "CONTEXTSVC_TELEMETRY_SLOW_STORE_MS": "0",
    }
    proc = ServerProcess("memory", env=env).start()
    sampled = ("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01")
    dropped = ("traceparent", f"00-{'1' * 32}-{CLIENT_SPAN_ID}-00")
    try:
        with proc.channel() as ch:
            stub = proc.stub(ch)
            sid = stub.CreateSession(pb.CreateSessionRequest()).id
            _fill(stub, sid, 3)
            for _ in range(3):
                stub.BuildContext(pb.BuildContextRequest(session_id=sid))
                stub.BuildContext(pb.BuildContextRequest(session_id=sid), metadata=(dropped,))
            stub.BuildContext(pb.BuildContextRequest(session_id=sid), metadata=(sampled,))

        def counted(rcv: Receiver) -> bool:
            points = _points(rcv.metrics, "rpc.server.call.duration")
            builds = [p for p in points if _attrs(p)["rpc.method"] == "BuildContext"]
            names = {s.name for s in rcv.spans}
            return bool(builds) and builds[-1].count == 7 and {METHOD_BUILD, "contextsvc.build_view"} <= names

        assert found.wait_for(counted), sorted({m.name for m in found.metrics})
        time.sleep(0.5)  # a late export of a dropped trace would show up here
    finally:
        proc.terminate()
    spans = list(found.spans)
    assert {s.trace_id for s in spans} == {bytes.fromhex(TRACE_ID)}
    assert sorted(s.name for s in spans) == [METHOD_BUILD, "contextsvc.build_view"]
    (build,) = [s for s in spans if s.name == "contextsvc.build_view"]
    calls = _store_calls(build)
    # A build reads its session and context in one store call.
    assert calls["context_and_session"] == 1 and "get_session" not in calls
    events = [e for e in build.events if e.name.startswith("store.")]
    assert len(events) == sum(calls.values())
    for event in events:
        assert _attrs(event)["contextsvc.store.duration_ms"] >= 0
        assert build.start_time_unix_nano <= event.time_unix_nano <= build.end_time_unix_nano


def test_a_watcher_stream_is_one_server_span_ended_when_the_watcher_leaves(receiver: tuple[Receiver, int]) -> None:
    """StreamEvents: the span stays current across the stream's yields and ends CANCELLED when the
    client hangs up; the watchers gauge goes up and back down; nothing is logged about contexts."""
    found, port = receiver
    proc = ServerProcess("memory", env={**_clean_env(), **_otel_env(port)}).start()
    try:
        with proc.channel() as ch:
            stub = proc.stub(ch)
            sid = stub.CreateSession(pb.CreateSessionRequest()).id
            stream = stub.StreamEvents(pb.StreamEventsRequest(session_id=sid))
            first: queue.Queue[Any] = queue.Queue()

            def watch() -> None:
                with contextlib.suppress(grpc.RpcError):  # cancelled below
                    first.put(next(iter(stream)))

            threading.Thread(target=watch, daemon=True).start()
            # The server may take an append before the stream has subscribed (a live-only stream
            # misses it): append again until the watcher sees one, a bounded number of times.
            event = None
            for _ in range(50):
                _fill(stub, sid, 1)
                with contextlib.suppress(queue.Empty):
                    event = first.get(timeout=0.2)
                    break
            assert event is not None and event.WhichOneof("payload")
            stream.cancel()

        def ended(rcv: Receiver) -> bool:
            watchers = _points(rcv.metrics, "contextsvc.watchers")
            streamed = any(s.name.endswith("/StreamEvents") for s in rcv.spans)
            return streamed and bool(watchers) and watchers[-1].as_int == 0

        # The span ends when the server sees the hang-up; a later export shows the watcher gone.
        assert found.wait_for(ended), sorted({s.name for s in found.spans})
    finally:
        proc.terminate()
    (span,) = [s for s in found.spans if s.name == "/contextsvc.v1.ContextService/StreamEvents"]
    assert _attrs(span)["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert span.status.code == span.status.STATUS_CODE_UNSET
    assert "detach" not in proc.stderr_text.lower(), proc.stderr_text[-2000:]


def _points(metrics: list[Any], name: str) -> list[Any]:
    out: list[Any] = []
    for metric in metrics:
        if metric.name != name:
            continue
        data = metric.WhichOneof("data")
        out.extend(getattr(metric, data).data_points)
    return out


def test_metrics_count_rpcs_compressions_and_baselines(
    tmp_path: Path, receiver: tuple[Receiver, int], llm: FakeLLM
) -> None:
    found, port = receiver
    env = {**_clean_env(), **_otel_env(port), "CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL": llm.base_url}
    proc = ServerProcess("memory", env=env).start()
    try:
        with proc.channel() as ch:
            stub = proc.stub(ch)
            sid = stub.CreateSession(pb.CreateSessionRequest()).id
            _fill(stub, sid, 12)
            stub.Compress(pb.CompressRequest(session_id=sid, profile=_profile()))
            view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=_profile()))
            stub.RecordBaseline(
                pb.RecordBaselineRequest(
                    session_id=sid, view_id=view.view_id, prompt_tokens=max(1, view.estimate.total)
                )
            )
            with pytest.raises(grpc.RpcError):
                stub.GetSession(pb.GetSessionRequest(session_id="00000000-0000-4000-8000-000000000000"))

        def all_there(rcv: Receiver) -> bool:
            names = {m.name for m in rcv.metrics}
            return {
                "rpc.server.call.duration",
                "contextsvc.compressions",
                "contextsvc.estimate.ratio",
                "contextsvc.context.fill",
                "contextsvc.sessions.created",
            } <= names

        assert found.wait_for(all_there), sorted({m.name for m in found.metrics})
    finally:
        proc.terminate()

    metrics = list(found.metrics)
    compressions = _points(metrics, "contextsvc.compressions")
    forced = [p for p in compressions if _attrs(p).get("contextsvc.compaction.reason") == "forced"]
    assert forced and forced[-1].as_int == 1
    assert _attrs(forced[-1])["contextsvc.compaction.method"] == "summary"

    durations = _points(metrics, "rpc.server.call.duration")
    codes = {(_attrs(p)["rpc.method"], _attrs(p)["rpc.grpc.status_code"]) for p in durations}
    assert ("BuildContext", 0) in codes
    assert ("GetSession", grpc.StatusCode.NOT_FOUND.value[0]) in codes
    # Aggregated by the interceptor (telemetry_metrics), exported as the SDK's histogram would be.
    (duration_metric,) = {m.name: m for m in metrics if m.name == "rpc.server.call.duration"}.values()
    assert duration_metric.unit == "s"
    for point in durations:
        assert sum(point.bucket_counts) == point.count >= 1
        assert list(point.explicit_bounds) == [float(b) for b in telemetry._DURATION_BUCKETS]
        mean = point.sum / point.count
        assert 0 < point.min <= point.max and point.min * (1 - 1e-9) <= mean <= point.max * (1 + 1e-9)

    ratios = _points(metrics, "contextsvc.estimate.ratio")
    assert ratios and _attrs(ratios[-1])["gen_ai.request.model"] == "m-telemetry"
    assert ratios[-1].count >= 1


def test_nothing_is_exported_without_otel_variables(tmp_path: Path, receiver: tuple[Receiver, int]) -> None:
    found, _port = receiver
    proc = ServerProcess("memory", env=_clean_env()).start()
    try:
        with proc.channel() as ch:
            stub = proc.stub(ch)
            sid = stub.CreateSession(pb.CreateSessionRequest()).id
            _fill(stub, sid, 3)
            stub.BuildContext(pb.BuildContextRequest(session_id=sid))
        time.sleep(1.0)  # longer than the export intervals the other tests use
    finally:
        proc.terminate()
    assert found.requests == 0
    assert "telemetry on" not in proc.stderr_text


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_prometheus_scrape_endpoint_serves_the_metrics(tmp_path: Path) -> None:
    import httpx

    port = _free_port()
    env = {
        **_clean_env(),
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
    }
    proc = ServerProcess("memory", env=env).start()
    try:
        with proc.channel() as ch:
            stub = proc.stub(ch)
            sid = stub.CreateSession(pb.CreateSessionRequest()).id
            _fill(stub, sid, 2)
            stub.BuildContext(pb.BuildContextRequest(session_id=sid))
        body = ""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            if "contextsvc_context_fill" in body:
                break
            time.sleep(0.2)
    finally:
        proc.terminate()
    assert "rpc_server_call_duration" in body
    assert 'rpc_method="BuildContext"' in body
    assert "contextsvc_context_fill" in body
    assert "contextsvc_sessions_created" in body


def test_the_standalone_gateway_traces_its_calls_and_the_service_continues_them(
    tmp_path: Path, receiver: tuple[Receiver, int]
) -> None:
    """``contextsvc gateway`` reads the same OTEL_* variables: a client span per call to the
    service, whose server span is its child in the same trace (one trace from browser to store)."""
    import urllib.request

    from tests.support.gateway import Process

    rcv, port = receiver
    env = {**_clean_env(), **_otel_env(port)}
    service = Process(["serve", "--listen", "127.0.0.1:0", "--store", f"files:{tmp_path / 'data'}"], env=env)
    service.start()
    gateway = Process(
        ["gateway", "--listen", "127.0.0.1:0", "--target", service.grpc_address],
        env={**env, "OTEL_SERVICE_NAME": "contextsvc-gateway-e2e"},
    ).start()
    try:
        with urllib.request.urlopen(f"{gateway.http_url}/api/sessions", timeout=10) as reply:
            assert reply.status == 200
        list_rpc = "/contextsvc.v1.ContextService/ListSessions"

        def both(r: Receiver) -> bool:
            names = {s.name for s in r.spans}
            return "contextsvc.gateway/ListSessions" in names and list_rpc in names

        assert rcv.wait_for(both), sorted({s.name for s in rcv.spans})
        with rcv.lock:
            (client,) = [s for s in rcv.spans if s.name == "contextsvc.gateway/ListSessions"]
            servers = [s for s in rcv.spans if s.name == list_rpc]
        assert any(s.trace_id == client.trace_id and s.parent_span_id == client.span_id for s in servers)
    finally:
        assert gateway.terminate() == 0
        service.kill()
    assert "Traceback" not in gateway.stderr_text


def test_with_tracing_on_a_gateway_refusal_closes_with_its_code_not_1011(
    tmp_path: Path, receiver: tuple[Receiver, int]
) -> None:
    """A call the service refuses raises through the gateway's client span: with tracing on that
    was a TypeError (the error could not take its traceback), every such socket closed 1011 and
    the gateway logged a traceback. A wrong token closes 4003, an unknown session 4004."""
    import asyncio
    import subprocess
    import sys

    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
    from tests.support.gateway import Process

    _, port = receiver
    store = f"files:{tmp_path / 'data'}"
    token = subprocess.run(
        [sys.executable, "-m", "contextsvc", "tokens", "create", "--user", "alice", "--store", store],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    env = {**_clean_env(), **_otel_env(port)}
    service = Process(["serve", "--listen", "127.0.0.1:0", "--store", store, "--auth", "tokens"], env=env).start()
    gateway = Process(["gateway", "--listen", "127.0.0.1:0", "--target", service.grpc_address], env=env).start()

    async def close_code(url: str) -> int | None:
        async with connect(url) as ws:
            with pytest.raises(ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
            return ws.close_code

    try:
        with grpc.insecure_channel(service.grpc_address) as ch:
            meta = (("authorization", f"Bearer {token}"),)
            sid = ContextServiceStub(ch).CreateSession(pb.CreateSessionRequest(name="g"), metadata=meta).id
        assert asyncio.run(close_code(gateway.ws_url(sid, f"api_token={token}x"))) == 4003
        missing = "00000000-0000-4000-8000-000000000000"
        assert asyncio.run(close_code(gateway.ws_url(missing, f"api_token={token}"))) == 4004
    finally:
        assert gateway.terminate() == 0
        service.kill()
    assert "Traceback" not in gateway.stderr_text, gateway.stderr_text[-2000:]
