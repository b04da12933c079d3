"""The service's own spans (server, view assembly, compaction), made in fewer steps than the SDK's.

The SDK's ``Tracer.start_span`` and ``Span`` do, per span, what a general-purpose tracer must: look
the parent up again, consult the sampler for every child, build a lock, a bounded attribute mapping
that validates each value as it is set, two bounded lists, call every span processor at start, and
copy the span into a new ``ReadableSpan`` at its end. For the few spans this service starts on
every call that was most of a sampled call's telemetry CPU (bench/RESULTS.md, "Telemetry
overhead"). ``SpanFactory`` makes them from the SDK's own parts, through its public API: the
provider's sampler, id generator, resource and span limits decide and describe the span as the SDK
would, and at its end the span is handed, as the SDK's ``ReadableSpan``, to the batch processor the
exporters read from. The differences are internal: the sampler is consulted for a span with no
local parent (the server span); a child of one of our recording spans is recorded without asking it
again, which is what every sampler ``OTEL_TRACES_SAMPLER`` can name decides for it (a sampled local
parent, or the same trace id for the ratio sampler) — with any other sampler the SDK's tracer is
used instead; attribute values are this module's own (ids, counts, names, durations), so they are
not validated one by one, and the span limits apply when the span ends.

Spans of other code (the GenAI client span, asyncpg and httpx instrumentations) still come from the
SDK's tracer; they find these spans as their parents through the context as usual.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Mapping, Sequence
from time import time_ns
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    ParentBasedTraceIdRatio,
    Sampler,
    StaticSampler,
    TraceIdRatioBased,
)
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

__all__ = ["LightSpan", "SpanFactory"]

#: the samplers ``OTEL_TRACES_SAMPLER`` names (as the SDK builds them from it): each records the
#: child of a recording local span of the same trace.
_CHILDREN_FOLLOW = (ParentBased, ParentBasedTraceIdRatio, StaticSampler, TraceIdRatioBased)


class SpanFactory:
    """Starts ``LightSpan``\\ s for one provider and ends them into ``processor``."""

    #: the class of the spans it starts (callers check a parent against it without importing it)
    span_type: type[LightSpan]

    def __init__(self, provider: TracerProvider, processor: SpanProcessor, scope_name: str) -> None:
        self.sampler: Sampler = provider.sampler
        self._ids = provider.id_generator
        self.resource = provider.resource
        self.scope = InstrumentationScope(scope_name)
        self.processor = processor
        limits = SpanLimits()  # OTEL_SPAN_* / OTEL_ATTRIBUTE_* as the provider reads them
        self.max_attributes = limits.max_span_attributes
        self.max_value_length = limits.max_span_attribute_length
        self.max_events = limits.max_events
        self.max_event_attributes = limits.max_event_attributes

    @staticmethod
    def usable(provider: TracerProvider) -> bool:
        """Whether the provider's sampler lets a child of a recording span skip it (see above)."""
        return type(provider.sampler) in _CHILDREN_FOLLOW

    def start(
        self, name: str, context: otel_context.Context | None, kind: SpanKind, attributes: Mapping[str, Any]
    ) -> trace.Span:
        """A span under ``context``'s span (a remote caller's, or none), as the sampler decides."""
        parent: SpanContext | None = trace.get_current_span(context).get_span_context()
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
            random_id = parent.trace_flags.random_trace_id
        else:
            parent = None
            trace_id = self._ids.generate_trace_id()
            random_id = self._ids.is_trace_id_random()
        result = self.sampler.should_sample(context, trace_id, name, kind, attributes)
        decision = result.decision
        flags = TraceFlags.SAMPLED if decision is Decision.RECORD_AND_SAMPLE else TraceFlags.DEFAULT
        if random_id:
            flags |= TraceFlags.RANDOM_TRACE_ID
        span_context = SpanContext(trace_id, self._ids.generate_span_id(), False, TraceFlags(flags), result.trace_state)
        if decision is Decision.DROP:
            return NonRecordingSpan(span_context)
        return LightSpan(self, name, span_context, parent, kind, dict(result.attributes or {}))

    def child(self, name: str, parent: LightSpan, attributes: Mapping[str, Any]) -> LightSpan:
        """An internal span under ``parent`` (recording, so this one is too)."""
        above = parent.context
        span_context = SpanContext(
            above.trace_id, self._ids.generate_span_id(), False, above.trace_flags, above.trace_state
        )
        return LightSpan(self, name, span_context, above, SpanKind.INTERNAL, dict(attributes))


class LightSpan(trace.Span):
    """A recording span of ours: attributes in a dict, ended into the factory's processor."""

    __slots__ = (
        "_attributes",
        "_end",
        "_events",
        "_factory",
        "_kind",
        "_lock",
        "_name",
        "_parent",
        "_start",
        "_status",
        "context",
    )

    def __init__(
        self,
        factory: SpanFactory,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, Any],
    ) -> None:
        self._factory = factory
        self._name = name
        self.context = context
        self._parent = parent
        self._kind = kind
        self._attributes = attributes
        self._events: list[Event] | None = None
        self._status = Status(StatusCode.UNSET)
        self._start = time_ns()
        self._end: int | None = None
        self._lock = threading.Lock()  # end() once, whichever thread ends it

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self._end is None

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self._end is None:
            self._attributes.update(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end is None:
            self._attributes[key] = value

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        if self._end is not None:
            return
        if self._events is None:
            self._events = []
        self._events.append(Event(name, attributes, timestamp, limit=self._factory.max_event_attributes))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        del context, attributes  # links are given at start only; ours have none

    def update_name(self, name: str) -> None:
        if self._end is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self._end is not None or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self._status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        kind = type(exception)
        module = kind.__module__
        described: dict[str, Any] = {
            "exception.type": f"{module}.{kind.__qualname__}" if module and module != "builtins" else kind.__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            described.update(attributes)
        self.add_event("exception", described, timestamp)

    def end(self, end_time: int | None = None) -> None:
        with self._lock:
            if self._end is not None:
                return
            self._end = end_time if end_time is not None else time_ns()
        factory = self._factory
        attributes: Any = self._attributes
        most = factory.max_attributes
        if (most is not None and len(attributes) > most) or factory.max_value_length is not None:
            attributes = BoundedAttributes(
                factory.max_attributes, attributes, immutable=True, max_value_len=factory.max_value_length
            )
        events: Sequence[Event] = ()
        if self._events:
            events = tuple(self._events)
            if factory.max_events is not None and len(events) > factory.max_events:
                events = BoundedList.from_seq(factory.max_events, events)
        factory.processor.on_end(
            ReadableSpan(
                name=self._name,
                context=self.context,
                parent=self._parent,
                resource=factory.resource,
                attributes=attributes,
                events=events,
                links=(),
                kind=self._kind,
                status=self._status,
                start_time=self._start,
                end_time=self._end,
                instrumentation_scope=factory.scope,
            )
        )


SpanFactory.span_type = LightSpan
