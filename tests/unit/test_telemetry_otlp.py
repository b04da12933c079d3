"""Our OTLP span encoder against the SDK's: the same ExportTraceServiceRequest, field for field."""

from __future__ import annotations

import http.server
import threading
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)
from opentelemetry.trace.span import TraceState

from contextsvc import telemetry_otlp


def _same(spans: list[ReadableSpan]) -> None:
    ours = ExportTraceServiceRequest.FromString(telemetry_otlp.encode_spans(spans))
    theirs = sdk_encode_spans(spans)
    assert ours == theirs
    # The bytes are what goes on the wire: parsing them back loses nothing.
    assert ExportTraceServiceRequest.FromString(theirs.SerializeToString()) == ours


def _recorder(resource: Resource | None = None) -> tuple[TracerProvider, InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    provider = TracerProvider(resource=resource or Resource.create({"service.name": "t", "n": 3}))
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return provider, spans


def test_the_spans_of_a_call_encode_as_the_sdk_encodes_them() -> None:
    provider, spans = _recorder()
    tracer = provider.get_tracer("contextsvc", "1.2", schema_url="https://example.invalid/s")
    other = provider.get_tracer("asyncpg")
    remote = SpanContext(
        0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, True, TraceFlags(1), TraceState([("k", "v")])
    )
    parent = set_span_in_context(NonRecordingSpan(remote))
    server = tracer.start_span(
        "/svc/Method", context=parent, kind=SpanKind.SERVER, attributes={"rpc.system": "grpc", "code": 0}
    )
    child = tracer.start_span(
        "build", context=set_span_in_context(server), attributes={"ok": True, "ratio": 0.25, "big": -(2**40)}
    )
    child.add_event("store.get_session", {"contextsvc.store.duration_ms": 1.5, "error.type": "LookupError"}, 123)
    child.add_event("empty")
    child.set_attributes({"tags": ("a", "b"), "ints": [1, 2], "flags": [True], "floats": (0.5,), "e": ""})
    child.set_status(Status(StatusCode.ERROR, "broken"))
    child.end()
    linked = other.start_span(
        "SELECT", kind=SpanKind.CLIENT, links=[Link(remote, {"why": "batch"}), Link(server.get_span_context())]
    )
    linked.set_status(Status(StatusCode.OK))
    linked.end()
    server.record_exception(ValueError("bad"))
    server.end()
    for kind in (SpanKind.PRODUCER, SpanKind.CONSUMER, SpanKind.INTERNAL):
        tracer.start_span(f"k{kind.value}", kind=kind).end()
    _same(list(spans.get_finished_spans()))


def test_spans_of_several_resources_and_scopes_are_grouped_as_the_sdk_groups_them() -> None:
    found: list[ReadableSpan] = []
    for resource in (Resource.create({"service.name": "a"}), Resource.create({"service.name": "b"})):
        provider, spans = _recorder(resource)
        for name in ("one", "two", "one"):
            provider.get_tracer(name).start_span(f"span of {name}").end()
        found.extend(spans.get_finished_spans())
    # A resource equal to the first but another object joins the first's group.
    provider, spans = _recorder(Resource.create({"service.name": "a"}))
    provider.get_tracer("one").start_span("late").end()
    found.extend(spans.get_finished_spans())
    _same(found)


def test_an_empty_batch_and_repeated_batches_encode_alike() -> None:
    assert telemetry_otlp.encode_spans([]) == b""
    provider, spans = _recorder()
    tracer = provider.get_tracer("contextsvc")
    for _ in range(3):  # the caches of keys, pairs and names are reused from batch to batch
        spans.clear()
        for i in range(5):
            tracer.start_span("view", attributes={"contextsvc.session_id": f"s{i % 2}", "n": i}).end()
        _same(list(spans.get_finished_spans()))


def test_a_value_out_of_range_is_left_out_as_the_sdk_leaves_it_out() -> None:
    provider, spans = _recorder()
    provider.get_tracer("t").start_span("s", attributes={"huge": 2**70, "fine": 1}).end()
    (span,) = spans.get_finished_spans()
    ours = ExportTraceServiceRequest.FromString(telemetry_otlp.encode_spans([span]))
    (encoded,) = ours.resource_spans[0].scope_spans[0].spans
    assert [kv.key for kv in encoded.attributes] == ["fine"]


_values: Any = st.one_of(
    st.text(max_size=80),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.lists(st.text(max_size=5), max_size=3),
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=3),
)


@settings(max_examples=60, deadline=None)
@given(
    attributes=st.dictionaries(st.text(min_size=1, max_size=20), _values, max_size=6),
    event_attributes=st.dictionaries(st.text(min_size=1, max_size=10), _values, max_size=3),
    name=st.text(max_size=30),
)
def test_generated_attributes_encode_as_the_sdk_encodes_them(
    attributes: dict[str, Any], event_attributes: dict[str, Any], name: str
) -> None:
    provider, spans = _recorder()
    span = provider.get_tracer("t").start_span(name, attributes=attributes)
    span.add_event(name, event_attributes)
    span.end()
    _same(list(spans.get_finished_spans()))


def test_the_grpc_exporter_sends_our_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9")  # never dialled here
    provider, spans = _recorder()
    provider.get_tracer("t").start_span("s", attributes={"k": "v"}).end()
    exporter = telemetry_otlp.grpc_span_exporter()
    try:
        batch = list(spans.get_finished_spans())
        assert exporter._translate_data(batch) == sdk_encode_spans(batch)
    finally:
        exporter.shutdown()


class _Collector(http.server.BaseHTTPRequestHandler):
    bodies: ClassVar[list[tuple[str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.bodies.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_the_http_exporter_posts_our_encoding_to_a_real_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Collector.bodies.clear()
    try:
        monkeypatch.setenv(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
        )
        provider, spans = _recorder()
        provider.get_tracer("t").start_span("s", attributes={"k": "v", "n": 2}).end()
        exporter = telemetry_otlp.http_span_exporter()
        batch = list(spans.get_finished_spans())
        assert exporter.export(batch) is SpanExportResult.SUCCESS
        exporter.shutdown()
        assert exporter.export(batch) is SpanExportResult.FAILURE  # after shutdown, as the SDK's
    finally:
        server.shutdown()
        server.server_close()
    ((path, body),) = _Collector.bodies
    assert path == "/v1/traces"
    assert ExportTraceServiceRequest.FromString(body) == sdk_encode_spans(batch)
