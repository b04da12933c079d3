"""Finished spans to an OTLP ``ExportTraceServiceRequest``, written straight to the protobuf wire format.

The SDK's encoder (``opentelemetry-exporter-otlp-proto-common``) builds a protobuf object for every
span, attribute, value and event, and copies each span twice more into its parents: on this
service's traces it was the largest single item of a sampled call's CPU (bench/RESULTS.md,
"Telemetry overhead"). This encoder writes the same message as bytes, reusing what repeats from span
to span (the resource and scope header, attribute keys, the attribute pairs of short strings and
integers, span names), and the exporters below hand those bytes to the SDK's OTLP exporters: the
gRPC one through its ``_translate_data`` hook (one C-level parse into the request object), the HTTP
one through its encoder. The output equals the SDK's own encoding field for field
(tests/unit/test_telemetry_otlp.py compares them over generated spans); a value of a type it does
not know (a mapping, say) is encoded by the SDK's protobuf classes, so nothing is lost.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

__all__ = ["encode_spans", "grpc_span_exporter", "http_span_exporter"]

log = logging.getLogger(__name__)

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_pack_q = struct.Struct("<Q").pack
_pack_d = struct.Struct("<d").pack
_pack_i = struct.Struct("<I").pack

#: varints of 0..16383 (every length a span part has in practice), built once
_VARINTS = [bytes((n,)) if n < 0x80 else bytes(((n & 0x7F) | 0x80, n >> 7)) for n in range(1 << 14)]


def _varint(n: int) -> bytes:
    if 0 <= n < 16384:
        return _VARINTS[n]
    if n < 0:
        n &= (1 << 64) - 1  # int64: two's complement, ten bytes
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: ``tag`` (already encoded), length, payload."""
    n = len(payload)
    return tag + (_VARINTS[n] if n < 16384 else _varint(n)) + payload


_KIND = {
    SpanKind.INTERNAL: PbSpan.SPAN_KIND_INTERNAL,
    SpanKind.SERVER: PbSpan.SPAN_KIND_SERVER,
    SpanKind.CLIENT: PbSpan.SPAN_KIND_CLIENT,
    SpanKind.PRODUCER: PbSpan.SPAN_KIND_PRODUCER,
    SpanKind.CONSUMER: PbSpan.SPAN_KIND_CONSUMER,
}
_HAS_IS_REMOTE = 0x100  # SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = 0x200  # SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_FLAGS_LOCAL = b"\x85\x01" + _pack_i(_HAS_IS_REMOTE)  # Span.flags (field 16, fixed32)
_FLAGS_REMOTE = b"\x85\x01" + _pack_i(_HAS_IS_REMOTE | _IS_REMOTE)

#: (key, value type, value) -> an encoded KeyValue, for the values that repeat (bounded)
_pairs: dict[tuple[bytes, str, type, Any], bytes] = {}
_PAIRS_MAX = 4096
_PAIR_VALUE_MAX = 64  # strings longer than this (ids excepted) are rarely repeated: not cached
#: key -> its encoded KeyValue.key field
_keys: dict[str, bytes] = {}
#: (name, kind) -> Span.name and Span.kind fields
_names: dict[tuple[str, Any], bytes] = {}
_NAMES_MAX = 1024


def _key(key: str) -> bytes:
    found = _keys.get(key)
    if found is None:
        if len(_keys) >= _PAIRS_MAX:
            _keys.clear()
        found = _keys[key] = _field(b"\x0a", key.encode())
    return found


def _any_value(value: Any) -> bytes:
    """An encoded AnyValue."""
    kind = value.__class__
    if kind is str:
        return _field(b"\x0a", value.encode())
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is int:
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise OverflowError(f"{value} does not fit an int64")
        return b"\x18" + _varint(value)
    if kind is float:
        return b"\x21" + _pack_d(value)
    return _sdk_value(value).SerializeToString()


def _sdk_value(value: Any) -> AnyValue:
    """What the SDK's encoder makes of any other value (subclasses, bytes, sequences, mappings)."""
    if value is None:
        return AnyValue()
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, Sequence):
        return AnyValue(array_value=ArrayValue(values=[_sdk_value(v) for v in value]))
    if isinstance(value, Mapping):
        return AnyValue(
            kvlist_value=KeyValueList(values=[KeyValue(key=str(k), value=_sdk_value(v)) for k, v in value.items()])
        )
    raise TypeError(f"attribute value of type {type(value).__name__}")


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    """Every attribute as one repeated KeyValue field ``tag``."""
    if not attributes:
        return b""
    out = []
    pairs = _pairs
    # The SDK's BoundedAttributes keeps a plain dict: iterating it directly skips the Mapping ABC.
    plain = getattr(attributes, "_dict", None)
    for key, value in (plain if isinstance(plain, dict) else attributes).items():
        kind = value.__class__
        if kind is float:  # durations, fractions: seldom the same twice
            kv = _key(key) + b"\x12\x09\x21" + _pack_d(value)
        else:
            cacheable = kind is bool or kind is int or (kind is str and len(value) <= _PAIR_VALUE_MAX)
            if cacheable:
                found = pairs.get((tag, key, kind, value))
                if found is not None:
                    out.append(found)
                    continue
            try:
                kv = _key(key) + _field(b"\x12", _any_value(value))
            except (TypeError, ValueError, OverflowError):
                log.warning("attribute %s not encoded: unsupported value", key, exc_info=True)
                continue  # as the SDK's encoder does: the span goes out without it
            if cacheable:
                if len(pairs) >= _PAIRS_MAX:
                    pairs.clear()
                pairs[(tag, key, kind, value)] = kv = _field(tag, kv)
                out.append(kv)
                continue
        out.append(_field(tag, kv))
    return b"".join(out)


def _name(name: str, kind: Any) -> bytes:
    found = _names.get((name, kind))
    if found is None:
        if len(_names) >= _NAMES_MAX:
            _names.clear()
        found = _names[(name, kind)] = _field(b"\x2a", name.encode()) + b"\x30" + _varint(_KIND[kind])
    return found


def _trace_state(tag: bytes, trace_state: Any) -> bytes:
    if not trace_state:
        return b""
    return _field(tag, ",".join(f"{key}={value}" for key, value in trace_state.items()).encode())


def _span(span: ReadableSpan) -> bytes:
    """One encoded Span message (without its field tag and length)."""
    context = span.get_span_context()
    assert context is not None  # a finished SDK span always has one
    parent = span.parent
    parts = [
        b"\x0a\x10",
        context.trace_id.to_bytes(16, "big"),
        b"\x12\x08",
        context.span_id.to_bytes(8, "big"),
        _trace_state(b"\x1a", context.trace_state),
        b"\x22\x08" + parent.span_id.to_bytes(8, "big") if parent else b"",
        _name(span.name, span.kind),
        b"\x39",
        _pack_q(span.start_time or 0),
        b"\x41",
        _pack_q(span.end_time or 0),
        _attributes(b"\x4a", span.attributes),
    ]
    dropped = span.dropped_attributes
    if dropped:
        parts.append(b"\x50" + _varint(dropped))
    for event in span.events:
        body = (
            b"\x09"
            + _pack_q(event.timestamp)
            + _field(b"\x12", event.name.encode())
            + _attributes(b"\x1a", event.attributes)
        )
        if event.dropped_attributes:
            body += b"\x20" + _varint(event.dropped_attributes)
        parts.append(_field(b"\x5a", body))
    if span.dropped_events:
        parts.append(b"\x60" + _varint(span.dropped_events))
    for link in span.links:
        linked = link.context
        body = (
            b"\x0a\x10"
            + linked.trace_id.to_bytes(16, "big")
            + b"\x12\x08"
            + linked.span_id.to_bytes(8, "big")
            + _attributes(b"\x22", link.attributes)
        )
        if link.dropped_attributes:
            body += b"\x28" + _varint(link.dropped_attributes)
        body += b"\x35" + _pack_i(_HAS_IS_REMOTE | _IS_REMOTE if linked.is_remote else _HAS_IS_REMOTE)
        parts.append(_field(b"\x6a", body))
    if span.dropped_links:
        parts.append(b"\x70" + _varint(span.dropped_links))
    status = span.status
    code = status.status_code.value
    body = (_field(b"\x12", status.description.encode()) if status.description else b"") + (
        b"\x18" + _varint(code) if code else b""
    )
    parts.append(_field(b"\x7a", body))
    parts.append(_FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL)
    return b"".join(parts)


#: (id(resource), id(scope)) -> (resource, scope, their encoded fields); the objects are kept so
#: that their ids cannot be reused by others while cached (bounded)
_headers: dict[tuple[int, int], tuple[Any, Any, tuple[bytes, bytes, bytes, bytes]]] = {}


def _merge_equal(
    grouped: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]],
) -> list[tuple[Any, list[tuple[Any, list[bytes]]]]]:
    """The identity groups merged where resources or scopes are equal (rare: several providers)."""
    merged: list[tuple[Any, list[tuple[Any, list[bytes]]]]] = []
    for resource, scopes in grouped.values():
        into = next((found for found in merged if found[0] == resource), None) if merged else None
        if into is None:
            into = (resource, [])
            merged.append(into)
        for scope, encoded in scopes.values():
            same = next((found for found in into[1] if found[0] == scope), None) if into[1] else None
            if same is None:
                into[1].append((scope, encoded))
            else:
                same[1].extend(encoded)
    return merged


def _header(resource: Any, scope: Any) -> tuple[bytes, bytes, bytes, bytes]:
    """ResourceSpans.resource and .schema_url, ScopeSpans.scope and .schema_url, encoded."""
    key = (id(resource), id(scope))
    cached = _headers.get(key)
    if cached is not None and cached[0] is resource and cached[1] is scope:
        return cached[2]
    if len(_headers) >= 64:
        _headers.clear()
    resource_body = _attributes(b"\x0a", resource.attributes)
    scope_body = b""
    scope_url = b""
    if scope is not None:
        scope_body = (
            (_field(b"\x0a", scope.name.encode()) if scope.name else b"")
            + (_field(b"\x12", scope.version.encode()) if scope.version else b"")
            + _attributes(b"\x1a", scope.attributes)
        )
        scope_url = _field(b"\x1a", scope.schema_url.encode()) if scope.schema_url else b""
    resource_url = _field(b"\x1a", resource.schema_url.encode()) if resource.schema_url else b""
    found = (_field(b"\x0a", resource_body), resource_url, _field(b"\x0a", scope_body), scope_url)
    _headers[key] = (resource, scope, found)
    return found


def encode_spans(spans: Sequence[ReadableSpan]) -> bytes:
    """A serialized ``ExportTraceServiceRequest`` holding ``spans``, grouped by resource and scope."""
    # Grouped by identity: a provider's spans share its resource and its tracers' scope objects
    # (the SDK's encoder groups by equality, hashing the resource's attributes for every span).
    grouped: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for span in spans:
        resource = span.resource
        by_resource = grouped.get(id(resource))
        if by_resource is None:
            by_resource = grouped[id(resource)] = (resource, {})
        scope = span.instrumentation_scope or None
        by_scope = by_resource[1].get(id(scope))
        if by_scope is None:
            by_scope = by_resource[1][id(scope)] = (scope, [])
        by_scope[1].append(_field(b"\x12", _span(span)))
    out = []
    for resource, scopes in _merge_equal(grouped):
        body: list[bytes] = []
        resource_url = b""
        for scope, encoded in scopes:
            resource_field, resource_url, scope_field, scope_url = _header(resource, scope)
            if not body:
                body.append(resource_field)
            body.append(_field(b"\x12", scope_field + b"".join(encoded) + scope_url))
        body.append(resource_url)
        out.append(_field(b"\x0a", b"".join(body)))
    return b"".join(out)


def grpc_span_exporter() -> Any:
    """The SDK's OTLP/gRPC span exporter (configured by the same ``OTEL_*`` variables), encoding
    with ``encode_spans``: its ``_translate_data`` hook returns the request parsed from our bytes."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    class _Exporter(OTLPSpanExporter):
        def _translate_data(self, data: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
            return ExportTraceServiceRequest.FromString(encode_spans(data))

    return _Exporter()


def http_span_exporter() -> Any:
    """The SDK's OTLP/HTTP span exporter (the same ``OTEL_*`` variables), posting ``encode_spans``'s
    bytes through its own HTTP client. Where that client is not there (another SDK release), or the
    SDK's own exporter metrics are asked for, the SDK's ``export`` runs unchanged."""
    import os

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    internal_metrics = os.environ.get("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "").strip().lower() == "true"

    class _Exporter(OTLPSpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            client = getattr(self, "_client", None)
            if internal_metrics or getattr(self, "_shutdown", True) or not callable(getattr(client, "export", None)):
                return super().export(spans)
            try:
                data = encode_spans(spans)
            except Exception:  # as the SDK's exporter does: the batch is reported failed, not raised
                log.exception("could not encode a batch of %d spans", len(spans))
                return SpanExportResult.FAILURE
            limit = getattr(self, "_max_request_size", 0) or 0
            if limit > 0 and len(data) > limit:
                log.warning("span batch of %d bytes dropped: over the %d-byte request limit", len(data), limit)
                return SpanExportResult.FAILURE
            result = client.export(data)  # type: ignore[union-attr]
            return SpanExportResult.SUCCESS if getattr(result, "success", False) else SpanExportResult.FAILURE

    return _Exporter()
