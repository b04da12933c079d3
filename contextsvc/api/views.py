"""Mapping of built views, estimates and compression reports to protobuf."""

from __future__ import annotations

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import events_pb2, resources_pb2
from contextsvc.api.mapping import message_to_pb
from contextsvc.core.compression.plan import CompactionPlan
from contextsvc.core.tokens import EstimateMethod, TokenEstimate
from contextsvc.engine.compaction import CompressionReport, Method, Reason, Stage, plan_payload
from contextsvc.engine.views import BuiltView

_METHODS = {
    EstimateMethod.CALIBRATED: resources_pb2.ESTIMATE_METHOD_CALIBRATED,
    EstimateMethod.FALLBACK: resources_pb2.ESTIMATE_METHOD_FALLBACK,
    EstimateMethod.BASELINE_DELTA: resources_pb2.ESTIMATE_METHOD_BASELINE_DELTA,
    EstimateMethod.EXACT: resources_pb2.ESTIMATE_METHOD_EXACT,
}


def estimate_to_pb(e: TokenEstimate) -> resources_pb2.TokenEstimate:
    s = e.segments
    return resources_pb2.TokenEstimate(
        total=e.total,
        text=e.text,
        images=e.images,
        method=_METHODS[e.method],
        window=e.window,
        budget=e.budget,
        fraction=e.fraction,
        segments=resources_pb2.TokenSegments(
            system=s.system,
            records=s.records,
            summaries=s.summaries,
            pinned=s.pinned,
            messages=s.messages,
            images=s.images,
            incoming=s.incoming,
            recall=s.recall,
        ),
        margin=e.margin,
    )


def build_response(built: BuiltView) -> pb.BuildContextResponse:
    """The whole response as a protobuf message (the reference the wire encoder must match)."""
    messages = []
    for vm in built.messages:
        m = message_to_pb(vm.message, truncated_in_view=vm.truncated)
        for image, data in zip(m.images, vm.image_data, strict=True):
            image.data = data
        messages.append(m)
    response = response_fields(built)
    response.messages.extend(messages)
    return response


def response_fields(built: BuiltView, *, with_view_id: bool = True) -> pb.BuildContextResponse:
    """Every field of the response but ``messages`` (``api.wire`` writes those from bytes), and
    but the view id too without ``with_view_id``."""
    response = pb.BuildContextResponse(
        view_id=built.view_id if with_view_id else "",
        estimate=estimate_to_pb(built.estimate),
        notices=built.notices,
        injected_chunk_ids=built.injected_chunk_ids,
    )
    if built.compression is not None:
        response.compression.CopyFrom(report_to_pb(built.compression))
    return response


_REASONS = {
    Reason.PRETURN: events_pb2.COMPRESSION_REASON_PRETURN,
    Reason.MIDTURN: events_pb2.COMPRESSION_REASON_MIDTURN,
    Reason.POSTTURN: events_pb2.COMPRESSION_REASON_POSTTURN,
    Reason.FORCED: events_pb2.COMPRESSION_REASON_FORCED,
}
_COMPRESSION_METHODS = {
    None: events_pb2.COMPRESSION_METHOD_UNSPECIFIED,
    Method.SUMMARY: events_pb2.COMPRESSION_METHOD_SUMMARY,
    Method.HARD_TRUNCATE: events_pb2.COMPRESSION_METHOD_HARD_TRUNCATE,
    Method.CLEAR_TOOL_RESULTS: events_pb2.COMPRESSION_METHOD_CLEAR_TOOL_RESULTS,
}


def plan_to_pb(plan: CompactionPlan | None) -> events_pb2.CompressionPlan | None:
    if plan is None:
        return None
    return events_pb2.CompressionPlan(**plan_payload(plan))


def stage_to_pb(stage: Stage) -> events_pb2.CompressionStage:
    return events_pb2.CompressionStage(
        method=_COMPRESSION_METHODS[stage.method],
        messages_removed=stage.messages_removed,
        messages_added=stage.messages_added,
        tokens_before=stage.tokens_before,
        tokens_after=stage.tokens_after,
    )


def report_to_pb(report: CompressionReport) -> pb.CompressionReport:
    return pb.CompressionReport(
        compressed=report.compressed,
        method=_COMPRESSION_METHODS[report.method],
        reason=_REASONS[report.reason],
        summary=report.summary,
        messages_before=report.messages_before,
        messages_after=report.messages_after,
        context_tokens_before=report.context_tokens_before,
        context_tokens_after=report.context_tokens_after,
        breadcrumbs=list(report.breadcrumbs),
        plan=plan_to_pb(report.plan),
        stages=[stage_to_pb(stage) for stage in report.stages],
    )


def report_to_compress_response(report: CompressionReport) -> pb.CompressResponse:
    return pb.CompressResponse(
        compressed=report.compressed,
        method=_COMPRESSION_METHODS[report.method],
        summary=report.summary,
        messages_before=report.messages_before,
        messages_after=report.messages_after,
        context_tokens_before=report.context_tokens_before,
        context_tokens_after=report.context_tokens_after,
        breadcrumbs=list(report.breadcrumbs),
        plan=plan_to_pb(report.plan),
        stages=[stage_to_pb(stage) for stage in report.stages],
    )
