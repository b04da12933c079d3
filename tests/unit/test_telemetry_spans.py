"""SpanFactory / LightSpan: the spans the service starts on every call, as the SDK would make them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    DEFAULT_ON,
    Decision,
    ParentBasedTraceIdRatio,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from contextsvc.telemetry_spans import LightSpan, SpanFactory

ATTRS = {"rpc.method": "BuildContext"}


class Recorder:
    def __init__(self, sampler: Sampler = DEFAULT_ON) -> None:
        self.exported = InMemorySpanExporter()
        self.provider = TracerProvider(sampler=sampler)
        processor = SimpleSpanProcessor(self.exported)
        self.provider.add_span_processor(processor)
        self.factory = SpanFactory(self.provider, processor, "contextsvc")


@pytest.fixture
def rec() -> Iterator[Recorder]:
    yield Recorder()


class Custom(Sampler):
    def should_sample(self, *args: object, **kwargs: object) -> SamplingResult:
        return SamplingResult(Decision.RECORD_AND_SAMPLE)

    def get_description(self) -> str:
        return "custom"


def test_only_the_samplers_the_environment_can_name_let_children_skip_the_sampler() -> None:
    for sampler in (DEFAULT_ON, ALWAYS_ON, TraceIdRatioBased(0.5), ParentBasedTraceIdRatio(0.1)):
        assert SpanFactory.usable(TracerProvider(sampler=sampler))
    assert not SpanFactory.usable(TracerProvider(sampler=Custom()))


def test_a_root_span_and_its_children_as_the_sdk_would_export_them(rec: Recorder) -> None:
    root = rec.factory.start("/svc/Method", None, SpanKind.SERVER, ATTRS)
    assert isinstance(root, LightSpan) and root.is_recording()
    flags = root.get_span_context().trace_flags
    assert flags.sampled and flags.random_trace_id
    child = rec.factory.child("contextsvc.build_view", root, {"contextsvc.session_id": "s"})
    # Other code's spans (the SDK's tracer) find ours as their parent through the context.
    token = otel_context.attach(trace.set_span_in_context(child))
    try:
        rec.provider.get_tracer("asyncpg").start_span("SELECT", kind=SpanKind.CLIENT).end()
    finally:
        otel_context.detach(token)
    child.set_attributes({"contextsvc.view.tokens": 120})
    child.add_event("store.save_view", {"contextsvc.store.duration_ms": 12.5})
    child.end()
    root.set_attribute("rpc.grpc.status_code", 0)
    root.end()
    select, view, server = rec.exported.get_finished_spans()
    assert server.name == "/svc/Method" and server.kind is SpanKind.SERVER and server.parent is None
    assert dict(server.attributes or {}) == {**ATTRS, "rpc.grpc.status_code": 0}
    assert server.resource is rec.provider.resource
    assert server.instrumentation_scope is not None and server.instrumentation_scope.name == "contextsvc"
    assert view.parent == server.context and view.context.trace_id == server.context.trace_id
    assert view.kind is SpanKind.INTERNAL
    assert dict(view.attributes or {}) == {"contextsvc.session_id": "s", "contextsvc.view.tokens": 120}
    (event,) = view.events
    assert event.name == "store.save_view" and dict(event.attributes or {}) == {"contextsvc.store.duration_ms": 12.5}
    assert select.parent == view.context and select.context.trace_flags.sampled
    assert server.start_time is not None and view.start_time is not None and select.start_time is not None
    assert server.start_time <= view.start_time <= select.start_time
    assert view.end_time is not None and server.end_time is not None and view.end_time <= server.end_time


def test_a_remote_parent_is_continued_and_the_sampler_decides_for_a_root(rec: Recorder) -> None:
    remote = SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, True, TraceFlags(0x01))
    span = rec.factory.start("/svc/M", trace.set_span_in_context(NonRecordingSpan(remote)), SpanKind.SERVER, ATTRS)
    assert span.get_span_context().trace_id == remote.trace_id and span.is_recording()
    span.end()
    (exported,) = rec.exported.get_finished_spans()
    assert exported.parent == remote
    unsampled = SpanContext(remote.trace_id, remote.span_id, True, TraceFlags(0x00))
    context = trace.set_span_in_context(NonRecordingSpan(unsampled))
    dropped = rec.factory.start("/svc/M", context, SpanKind.SERVER, ATTRS)
    assert not dropped.is_recording() and not dropped.get_span_context().trace_flags.sampled
    assert dropped.get_span_context().trace_id == remote.trace_id
    never = Recorder(TraceIdRatioBased(0.0))
    root = never.factory.start("/svc/M", None, SpanKind.SERVER, ATTRS)
    assert isinstance(root, NonRecordingSpan) and root.get_span_context().is_valid
    root.end()
    assert never.exported.get_finished_spans() == ()


def test_a_span_ends_once_and_ignores_what_comes_after(rec: Recorder) -> None:
    span = rec.factory.start("s", None, SpanKind.INTERNAL, {})
    span.set_status(Status(StatusCode.OK))
    span.set_status(Status(StatusCode.ERROR, "later"))  # OK is final, as in the SDK
    span.update_name("renamed")
    span.end()
    span.end()
    span.set_attribute("late", 1)
    span.add_event("late")
    span.update_name("too late")
    (exported,) = rec.exported.get_finished_spans()
    assert exported.name == "renamed" and exported.status.status_code is StatusCode.OK
    assert dict(exported.attributes or {}) == {} and exported.events == ()
    assert not span.is_recording()


def test_an_exception_is_an_event_as_the_sdk_records_it(rec: Recorder) -> None:
    span = rec.factory.start("s", None, SpanKind.SERVER, {})
    try:
        raise LookupError("gone")
    except LookupError as exc:
        span.record_exception(exc, {"extra": 1})
    span.set_status(StatusCode.ERROR, "LookupError")
    span.end()
    (exported,) = rec.exported.get_finished_spans()
    (event,) = exported.events
    attributes = dict(event.attributes or {})
    assert event.name == "exception" and attributes["exception.type"] == "LookupError"
    assert attributes["exception.message"] == "gone" and "LookupError: gone" in attributes["exception.stacktrace"]
    assert attributes["extra"] == 1
    assert exported.status.status_code is StatusCode.ERROR and exported.status.description == "LookupError"


def test_the_span_limits_of_the_environment_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "4")
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "1")
    rec = Recorder()
    span = rec.factory.start("s", None, SpanKind.SERVER, {"a": "abcdefgh"})
    span.set_attributes({"b": 1, "c": 2})
    span.add_event("one")
    span.add_event("two")
    span.end()
    (exported,) = rec.exported.get_finished_spans()
    attributes = dict(exported.attributes or {})
    assert len(attributes) == 2 and exported.dropped_attributes == 1
    assert all(len(v) <= 4 for v in attributes.values() if isinstance(v, str))
    assert len(exported.events) == 1 and exported.dropped_events == 1
