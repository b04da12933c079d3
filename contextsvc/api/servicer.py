"""The gRPC servicer: request validation at the edge, proto <-> core mapping, error mapping."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

import grpc
from google.protobuf import empty_pb2

from contextsvc import errors
from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import context_service_pb2_grpc as pb_grpc
from contextsvc._gen.v1 import events_pb2, resources_pb2
from contextsvc.api import mapping
from contextsvc.api.auth import caller_of
from contextsvc.api.errors import internal_status, to_status
from contextsvc.api.streams import until_stopped
from contextsvc.api.views import estimate_to_pb, report_to_compress_response
from contextsvc.api.wire import EncodedResponse, WireCache, encode_build_response, length_delimited, serialize
from contextsvc.core.calibration import Calibration
from contextsvc.core.priors import MESSAGE, TOOL_CALL
from contextsvc.engine.engine import Engine

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
Req = TypeVar("Req")
Resp = TypeVar("Resp")

_UPDATABLE = {"name", "pinned", "metadata"}


def unary(
    fn: Callable[[ContextServicer, Req, Context], Awaitable[Resp]],
) -> Callable[[ContextServicer, Req, Context], Awaitable[Resp]]:
    """Turn domain errors into statuses with details; anything unexpected is INTERNAL and logged."""

    @functools.wraps(fn)
    async def wrapper(self: ContextServicer, request: Req, context: Context) -> Resp:
        try:
            return await fn(self, request, context)
        except errors.ContextError as exc:
            await context.abort_with_status(to_status(exc))
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            await context.abort_with_status(internal_status())
        raise AssertionError("abort_with_status returned")  # pragma: no cover

    return wrapper


class ContextServicer(pb_grpc.ContextServiceServicer):
    def __init__(self, engine: Engine, *, wire_cache: WireCache | None = None, stopping: asyncio.Event | None = None):
        self._engine = engine
        self.wire_cache = wire_cache or WireCache(engine.settings.hot_path.wire_cache_mb * 1024 * 1024)
        # Set when the server drains: open StreamEvents calls end with UNAVAILABLE + after_event_id.
        self._stopping = stopping or asyncio.Event()
        #: the last calibration answered by RecordBaseline, with its field's bytes (``_calibration_field``).
        self._last_calibration: tuple[Calibration, str, bytes] | None = None

    @unary
    async def CreateSession(self, request: pb.CreateSessionRequest, context: Context) -> resources_pb2.Session:
        session = await self._engine.sessions.create(
            caller_of(context),
            profile_id=request.profile_id,
            name=request.name,
            metadata=mapping.struct_to_dict(request.metadata),
        )
        return mapping.session_to_pb(session)

    @unary
    async def GetSession(self, request: pb.GetSessionRequest, context: Context) -> resources_pb2.Session:
        return mapping.session_to_pb(await self._engine.sessions.get(caller_of(context), request.session_id))

    @unary
    async def ListSessions(self, request: pb.ListSessionsRequest, context: Context) -> pb.ListSessionsResponse:
        result = await self._engine.sessions.list(
            caller_of(context),
            page_size=request.page_size,
            page_token=request.page_token,
            profile_id=request.profile_id,
            query=request.query,
        )
        return pb.ListSessionsResponse(
            sessions=[mapping.session_to_pb(s) for s in result.sessions],
            next_page_token=result.next_page_token,
            total_size=result.total,
        )

    @unary
    async def UpdateSession(self, request: pb.UpdateSessionRequest, context: Context) -> resources_pb2.Session:
        paths = list(request.update_mask.paths)
        if not paths:
            raise errors.InvalidArgument.field("update_mask", "name at least one of: name, pinned, metadata")
        unknown = [p for p in paths if p not in _UPDATABLE]
        if unknown:
            raise errors.InvalidArgument.field(
                "update_mask", f"cannot update {', '.join(unknown)}; updatable: name, pinned, metadata"
            )
        s = request.session
        session = await self._engine.sessions.update(
            caller_of(context),
            s.id,
            name=s.name if "name" in paths else None,
            pinned=s.pinned if "pinned" in paths else None,
            metadata=mapping.struct_to_dict(s.metadata, "session.metadata") if "metadata" in paths else None,
        )
        return mapping.session_to_pb(session)

    @unary
    async def DeleteSession(self, request: pb.DeleteSessionRequest, context: Context) -> empty_pb2.Empty:
        await self._engine.sessions.delete(caller_of(context), request.session_id)
        self.wire_cache.forget_session(request.session_id)
        return empty_pb2.Empty()

    @unary
    async def AppendMessages(self, request: pb.AppendMessagesRequest, context: Context) -> pb.AppendMessagesResponse:
        incoming = [mapping.incoming_from_pb(m, f"messages[{i}]") for i, m in enumerate(request.messages)]
        outcome = await self._engine.append(
            caller_of(context),
            request.session_id,
            incoming,
            request_id=request.request_id,
            turn_complete=request.turn_complete,
        )
        return pb.AppendMessagesResponse(
            sequence_numbers=outcome.sequence_numbers,
            context_tokens=outcome.context_tokens,
            window_fraction=outcome.window_fraction,
        )

    @unary
    async def ListMessages(self, request: pb.ListMessagesRequest, context: Context) -> pb.ListMessagesResponse:
        page = await self._engine.sessions.list_messages(
            caller_of(context),
            request.session_id,
            buffer=mapping.buffer_from_pb(request.buffer),
            page_size=request.page_size,
            before_sequence=request.before_sequence,
            page_token=request.page_token,
        )
        return pb.ListMessagesResponse(
            messages=[mapping.message_to_pb(m) for m in page.messages],
            next_before_sequence=page.next_before_sequence,
            next_page_token=page.next_page_token,
        )

    @unary
    async def BuildContext(  # type: ignore[override]  # the wire form of a BuildContextResponse
        self, request: pb.BuildContextRequest, context: Context
    ) -> EncodedResponse:
        incoming = mapping.incoming_from_pb(request.incoming, "incoming") if request.HasField("incoming") else None
        built = await self._engine.build_context(
            caller_of(context),
            request.session_id,
            profile=mapping.profile_from_pb(request.profile if request.HasField("profile") else None),
            incoming=incoming,
            mid_turn=mapping.mid_turn_from_pb(request.phase),
            auto_compress=request.auto_compress if request.HasField("auto_compress") else True,
        )
        # Written from the encodings kept per stored message (api.wire), served as is by the
        # serializer ``add_to_server`` registers for this method.
        return encode_build_response(built, request.session_id, self.wire_cache)

    @unary
    async def EstimateTokens(self, request: pb.EstimateTokensRequest, context: Context) -> pb.EstimateTokensResponse:
        messages = [mapping.incoming_from_pb(m, f"messages[{i}]") for i, m in enumerate(request.messages)]
        estimate = await self._engine.estimate_tokens(
            caller_of(context),
            model=request.model,
            messages=messages,
            session_id=request.session_id,
            profile=mapping.profile_from_pb(request.profile if request.HasField("profile") else None),
        )
        return pb.EstimateTokensResponse(estimate=estimate_to_pb(estimate))

    @unary
    async def RecordBaseline(  # type: ignore[override]  # the wire form of a RecordBaselineResponse
        self, request: pb.RecordBaselineRequest, context: Context
    ) -> EncodedResponse:
        result = await self._engine.record_baseline(
            caller_of(context), request.session_id, view_id=request.view_id, prompt_tokens=request.prompt_tokens
        )
        head = pb.RecordBaselineResponse(
            recorded=result.recorded,
            truncated=result.truncated,
            truncation_reason=result.truncation_reason,
            lower_bound=result.lower_bound,
        ).SerializeToString()
        # The calibration field, encoded once per fit, after the others (fields may come in any order).
        return EncodedResponse(head + self._calibration_field(result.model, result.calibration))

    def _calibration_field(self, model: str, cal: Calibration) -> bytes:
        """``RecordBaselineResponse.calibration`` on the wire (tag, length, message), encoded once
        per fit: baselines that share a refit (``engine.accounting``) answer with the very same
        (frozen) calibration object, and its ~30 class ratios cost more to copy and encode than
        the rest of the response."""
        last = self._last_calibration
        if last is not None and last[0] is cal and last[1] == model:
            return last[2]
        message = resources_pb2.Calibration(
            model=model,
            overhead=cal.overhead,
            tokens_per_char=cal.tokens_per_char,
            observations=cal.observations,
            fitted=cal.fitted,
            per_message=cal.weights[MESSAGE],
            per_tool_call=cal.weights[TOOL_CALL],
            margin=cal.margin,
            family=cal.family,
            class_ratios=cal.class_ratios,
        )
        field = length_delimited(pb.RecordBaselineResponse.CALIBRATION_FIELD_NUMBER, message.SerializeToString())
        self._last_calibration = (cal, model, field)
        return field

    @unary
    async def Compress(self, request: pb.CompressRequest, context: Context) -> pb.CompressResponse:
        report = await self._engine.compress(
            caller_of(context),
            request.session_id,
            profile=mapping.profile_from_pb(request.profile if request.HasField("profile") else None),
            note=request.reason,
            dry_run=request.dry_run,
        )
        return report_to_compress_response(report)

    async def StreamEvents(self, request: pb.StreamEventsRequest, context: Context) -> AsyncIterator[events_pb2.Event]:
        try:
            events = self._engine.sessions.events(
                caller_of(context), session_id=request.session_id, after_event_id=request.after_event_id
            )
            stream = until_stopped(events, self._stopping, after_event_id=request.after_event_id)
            async with contextlib.aclosing(stream):  # its subscription is let go when the stream ends here
                async for event in stream:
                    yield mapping.event_to_pb(event)
                    if request.session_id and event.kind == "session_deleted":
                        return  # nothing more can come: the stream ends (OK), as the gateway's socket closes
        except errors.ContextError as exc:
            await context.abort_with_status(to_status(exc))
        except Exception:
            log.exception("unexpected error in StreamEvents")
            await context.abort_with_status(internal_status())

    @unary
    async def SearchHistory(self, request: pb.SearchHistoryRequest, context: Context) -> pb.SearchHistoryResponse:
        found = await self._engine.search_history(
            caller_of(context), request.session_id, query=request.query, limit=request.limit
        )
        return pb.SearchHistoryResponse(
            chunks=[
                pb.HistoryChunk(
                    text=s.chunk.text,
                    first_sequence=s.chunk.first_sequence,
                    last_sequence=s.chunk.last_sequence,
                    start_time=mapping.timestamp(s.chunk.start_time),
                    end_time=mapping.timestamp(s.chunk.end_time),
                    breadcrumbs=list(s.chunk.breadcrumbs),
                    chunk_id=s.chunk.content_hash,
                    score=s.score,
                )
                for s in found
            ]
        )

    @unary
    async def ExpandSummary(self, request: pb.ExpandSummaryRequest, context: Context) -> pb.ExpandSummaryResponse:
        messages = await self._engine.expand_summary(
            caller_of(context), request.session_id, sequence_number=request.sequence_number
        )
        response = pb.ExpandSummaryResponse(messages=[mapping.message_to_pb(m) for m in messages])
        limit = self._engine.settings.limits.grpc_max_send_bytes
        size = response.ByteSize()
        if size > limit:
            # A summary of a long history stands for more than one response may carry: gRPC failed
            # the call after the fact with a bare RESOURCE_EXHAUSTED ("Sent message larger than
            # max"), no reason and no way on. Said here, with where the rows can be read instead.
            first, last = messages[0].sequence_number, messages[-1].sequence_number
            raise errors.FailedPrecondition(
                f"summary #{request.sequence_number} stands for {len(messages)} messages (#{first}..#{last}, "
                f"{size} bytes), past the {limit}-byte response limit (limits.grpc_max_send_bytes); page "
                "through them with ListMessages (before_sequence) or find them with SearchHistory",
                reason="SUMMARY_TOO_LARGE",
                metadata={
                    "first_sequence": str(first),
                    "last_sequence": str(last),
                    "messages": str(len(messages)),
                    "bytes": str(size),
                    "limit_bytes": str(limit),
                },
            )
        return response

    @unary
    async def ForkSession(self, request: pb.ForkSessionRequest, context: Context) -> resources_pb2.Session:
        session = await self._engine.sessions.fork(
            caller_of(context),
            request.session_id,
            at_sequence=request.at_sequence,
            chunks_of=self._engine.compactor.history_chunks,
        )
        return mapping.session_to_pb(session)


class _Capture:
    """Stands in for a server to collect the generated registration's method handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.handlers = dict(handlers)


#: Methods whose handler may return an ``EncodedResponse`` (bytes already in wire form).
_PRE_ENCODED = ("BuildContext", "RecordBaseline")


def add_to_server(servicer: ContextServicer, server: grpc.aio.Server) -> None:
    """Register the service like the generated ``add_ContextServiceServicer_to_server``, except
    that methods answering with pre-encoded bytes get a serializer that passes them through."""
    capture = _Capture()
    pb_grpc.add_ContextServiceServicer_to_server(servicer, cast(grpc.aio.Server, capture))
    handlers = {
        name: handler._replace(response_serializer=serialize) if name in _PRE_ENCODED else handler  # type: ignore[attr-defined]
        for name, handler in capture.handlers.items()
    }
    service = pb.DESCRIPTOR.services_by_name["ContextService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
