"""Requests that do not decode are the client's fault: INVALID_ARGUMENT, one throttled log line.

grpc.aio deserializes a request before any servicer code runs; a body that is not valid protobuf
(random bytes, a string that is not UTF-8 such as a lone surrogate, nesting deeper than the
decoder allows) raises ``DecodeError`` there, which grpc reports as ``UNKNOWN: Unexpected
DecodeError`` with a traceback at error level. ``DecodeGuard`` wraps the deserializer of every
registered method (ContextService, health, reflection): a failed decode yields an
``Undecodable`` marker instead, and the wrapped handler answers it with INVALID_ARGUMENT, reason
``UNDECODABLE_REQUEST`` and a ``BadRequest`` violation, before the servicer sees it.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NoReturn

import grpc

from contextsvc.api.errors import to_status
from contextsvc.errors import ContextError, FieldViolation, InvalidArgument
from contextsvc.throttled_log import ThrottledLog

log = logging.getLogger(__name__)

REASON = "UNDECODABLE_REQUEST"

_TYPE_NAME = re.compile(r"message with type '([^']+)'")

# What each kind of decode failure means for the client, with what to do about it.
_CAUSES: dict[str, str] = {
    "too_deep": "is nested deeper than the protobuf decoder allows; metadata objects are limited in depth "
    "(see limits.max_metadata_depth)",
    "bad_utf8": "has a string field that is not valid UTF-8 (for example a lone surrogate)",
    "malformed": "is not a valid protobuf encoding of the request message",
}


class Undecodable:
    """Stands in for a request whose bytes could not be decoded."""

    __slots__ = ("cause", "message_type", "size")

    def __init__(self, cause: str, message_type: str, size: int):
        self.cause = cause
        self.message_type = message_type
        self.size = size


def classify(exc: Exception) -> str:
    text = str(exc)
    if "MaxDepth" in text or "recursion" in text.lower() or "too deep" in text.lower():
        return "too_deep"
    if "UTF-8" in text or "utf-8" in text:
        return "bad_utf8"
    return "malformed"


def safe_deserializer(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:  # DecodeError, and whatever else a decoder raises on bad bytes
            match = _TYPE_NAME.search(str(exc))
            return Undecodable(classify(exc), match.group(1) if match else "", len(raw))

    return decode


def undecodable_error(bad: Undecodable, method: str) -> InvalidArgument:
    description = _CAUSES[bad.cause]
    return InvalidArgument(
        f"the request body {description}",
        violations=[FieldViolation("request", description)],
        reason=REASON,
        metadata={"method": method, "cause": bad.cause, "message_type": bad.message_type},
    )


# The handler namedtuple grpc builds (grpc._utilities.RpcMethodHandler); its fields are typed loosely.
Handler = Any
Release = Callable[[], None]
#: Decides whether a decoded call may run: raises a ContextError to refuse it (the status the client
#: gets), or returns a release callback run when the call ends (None when there is nothing to undo).
#: ``request`` is None for client-streaming methods.
Admission = Callable[[str, Any, Any], Awaitable[Release | None]]


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Wraps every method handler so an undecodable request is refused with INVALID_ARGUMENT, then
    runs the admissions (serving gate, quotas) before the servicer sees the call."""

    def __init__(self, *, log_per_minute: int, admissions: Sequence[Admission] = (), decoding: bool = True):
        """``decoding=False`` runs only the admissions (a guard placed after authentication)."""
        self._refusals = ThrottledLog(log, per_minute=log_per_minute)
        self._admissions = tuple(admissions)
        self._decoding = decoding
        # method path -> (handler as registered, wrapped handler); bounded by the registered methods.
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler: Handler = await continuation(handler_call_details)
        if handler is None or (self._decoding and handler.request_deserializer is None):
            return handler
        if not self._decoding and not self._admissions:
            return handler
        method: str = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self.wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    async def _refuse(self, bad: Undecodable, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
        self._refusals.write(
            "request refused: body does not decode",
            method=method,
            cause=bad.cause,
            body_bytes=bad.size,
            peer=context.peer(),
        )
        await context.abort_with_status(to_status(undecodable_error(bad, method)))
        raise AssertionError("abort_with_status returned")  # pragma: no cover

    async def _admit(self, method: str, request: Any, context: Any) -> list[Release]:
        releases: list[Release] = []
        try:
            for admission in self._admissions:
                release = await admission(method, request, context)
                if release is not None:
                    releases.append(release)
        except ContextError as exc:
            for release in releases:
                release()
            await context.abort_with_status(to_status(exc))
        return releases

    def wrap(self, handler: Handler, method: str) -> Handler:
        """``handler`` with undecodable requests refused and the admissions run first."""
        refuse = self._refuse
        admit = self._admit
        changes: dict[str, Any] = {}
        if self._decoding:
            changes["request_deserializer"] = safe_deserializer(handler.request_deserializer)
        if handler.request_streaming:

            async def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                async for request in requests:
                    if isinstance(request, Undecodable):
                        await refuse(request, method, context)
                    yield request

            if handler.response_streaming:
                inner_ss = handler.stream_stream

                async def stream_stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                    releases = await admit(method, None, context)
                    try:
                        async for response in _responses(inner_ss(checked(requests, context), context)):
                            yield response
                    finally:
                        _release(releases)

                changes["stream_stream"] = stream_stream
            else:
                inner_su = handler.stream_unary

                async def stream_unary(requests: AsyncIterator[Any], context: Any) -> Any:
                    releases = await admit(method, None, context)
                    try:
                        return await inner_su(checked(requests, context), context)
                    finally:
                        _release(releases)

                changes["stream_unary"] = stream_unary
        elif handler.response_streaming:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                if isinstance(request, Undecodable):
                    await refuse(request, method, context)
                releases = await admit(method, request, context)
                try:
                    async for response in _responses(inner_us(request, context)):
                        yield response
                finally:
                    _release(releases)

            changes["unary_stream"] = unary_stream
        else:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                if isinstance(request, Undecodable):
                    await refuse(request, method, context)
                releases = await admit(method, request, context)
                try:
                    result = inner_uu(request, context)
                    return await result if inspect.isawaitable(result) else result
                finally:
                    _release(releases)

            changes["unary_unary"] = unary_unary
        return handler._replace(**changes)


def _release(releases: list[Release]) -> None:
    for release in releases:
        release()


async def _responses(result: Any) -> AsyncIterator[Any]:
    """A streaming handler either yields its responses or writes them with ``context.write``."""
    if inspect.isasyncgen(result):
        async for item in result:
            yield item
    elif inspect.isawaitable(result):
        await result
    else:
        for item in result:
            yield item
