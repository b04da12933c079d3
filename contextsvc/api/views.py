"""Mapping of built views, estimates and compression reports to protobuf."""

from __future__ import annotations

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2
from contextsvc.api.mapping import message_to_pb
from contextsvc.core.tokens import EstimateMethod, TokenEstimate
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
        ),
    )


def build_response(built: BuiltView) -> pb.BuildContextResponse:
    messages = []
    for vm in built.messages:
        m = message_to_pb(vm.message, truncated_in_view=vm.truncated)
        for image, data in zip(m.images, vm.image_data, strict=True):
            image.data = data
        messages.append(m)
    response = pb.BuildContextResponse(
        messages=messages,
        view_id=built.view_id,
        estimate=estimate_to_pb(built.estimate),
        notices=built.notices,
    )
    return response


def report_to_compress_response(report: object) -> pb.CompressResponse:
    raise NotImplementedError("compression reports arrive with the compression capability")
