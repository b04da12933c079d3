"""Domain errors -> gRPC status with google.rpc details (AIP-193), in one place."""

from __future__ import annotations

import logging
from typing import cast

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from contextsvc import errors

log = logging.getLogger(__name__)

DOMAIN = "contextsvc.dev"

_CODES: list[tuple[type[errors.ContextError], grpc.StatusCode]] = [
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Conflict, grpc.StatusCode.ABORTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.Internal, grpc.StatusCode.INTERNAL),
]

# How long a client should wait before retrying an UNAVAILABLE call.
RETRY_DELAY_SECONDS = 1


def status_code_for(exc: errors.ContextError) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.FAILED_PRECONDITION


def to_status(exc: errors.ContextError) -> grpc.Status:
    code = status_code_for(exc)
    details: list[any_pb2.Any] = []
    info = error_details_pb2.ErrorInfo(reason=exc.reason, domain=DOMAIN, metadata=exc.metadata)
    details.append(_pack(info))
    if isinstance(exc, errors.InvalidArgument) and exc.violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in exc.violations
            ]
        )
        details.append(_pack(bad))
    if isinstance(exc, errors.Unavailable):
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.seconds = RETRY_DELAY_SECONDS
        details.append(_pack(retry))
    if isinstance(exc, errors.ResourceExhausted):
        quota = error_details_pb2.QuotaFailure(
            violations=[error_details_pb2.QuotaFailure.Violation(subject=exc.subject, description=exc.message)]
        )
        details.append(_pack(quota))
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromNanoseconds(max(1_000_000, int(exc.retry_after_seconds * 1e9)))
        details.append(_pack(retry))
    status = status_pb2.Status(code=code.value[0], message=exc.message, details=details)
    return cast(grpc.Status, rpc_status.to_status(status))


def internal_status(message: str = "internal error; see the server log") -> grpc.Status:
    status = status_pb2.Status(code=code_pb2.INTERNAL, message=message)
    return cast(grpc.Status, rpc_status.to_status(status))


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed
