"""The gateway's only door to the service: ContextService over gRPC, with the caller's token.

Everything the gateway asks the service goes through :class:`Upstream`, so that switching to the
Python client library later changes this module only. The browser's API token is forwarded as
``authorization: Bearer …`` metadata: the service, not the gateway, decides who may do what.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import events_pb2, resources_pb2
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class UpstreamError(Exception):
    """A failed call: the gRPC status code name, its message and the ErrorInfo reason, if any."""

    code: str
    message: str
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    @property
    def denied(self) -> bool:
        return self.code in ("UNAUTHENTICATED", "PERMISSION_DENIED")

    @property
    def not_found(self) -> bool:
        return self.code == "NOT_FOUND"


def _error(exc: grpc.aio.AioRpcError) -> UpstreamError:
    reason = ""
    try:
        status = rpc_status.from_call(exc)
    except Exception:
        status = None
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
    code = exc.code()
    return UpstreamError(code.name if code is not None else "UNKNOWN", exc.details() or "", reason)


def _metadata(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),) if token else ()


class Upstream:
    """One channel to the service, shared by every socket of the gateway."""

    def __init__(self, target: str, *, timeout: float, max_message_bytes: int):
        self.target = target
        self._timeout = timeout
        self._channel = grpc.aio.insecure_channel(
            target,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        self._stub = ContextServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def get_session(self, token: str, session_id: str) -> resources_pb2.Session:
        try:
            return await self._stub.GetSession(
                pb.GetSessionRequest(session_id=session_id), metadata=_metadata(token), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def list_sessions(
        self, token: str, *, query: str, page_size: int, page_token: str
    ) -> pb.ListSessionsResponse:
        request = pb.ListSessionsRequest(query=query, page_size=page_size, page_token=page_token)
        try:
            return await self._stub.ListSessions(request, metadata=_metadata(token), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def append(self, token: str, request: pb.AppendMessagesRequest) -> pb.AppendMessagesResponse:
        try:
            return await self._stub.AppendMessages(request, metadata=_metadata(token), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def compress(self, token: str, session_id: str, *, dry_run: bool, reason: str) -> pb.CompressResponse:
        request = pb.CompressRequest(session_id=session_id, dry_run=dry_run, reason=reason)
        try:
            return await self._stub.Compress(request, metadata=_metadata(token), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def list_messages(
        self, token: str, session_id: str, *, buffer: pb.Buffer.ValueType, page_size: int
    ) -> pb.ListMessagesResponse:
        request = pb.ListMessagesRequest(session_id=session_id, buffer=buffer, page_size=page_size)
        try:
            return await self._stub.ListMessages(request, metadata=_metadata(token), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def build_context(self, token: str, session_id: str) -> pb.BuildContextResponse:
        # auto_compress off: looking at a session must never change it.
        request = pb.BuildContextRequest(session_id=session_id, auto_compress=False)
        try:
            return await self._stub.BuildContext(request, metadata=_metadata(token), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def search_history(self, token: str, session_id: str, *, query: str, limit: int) -> pb.SearchHistoryResponse:
        request = pb.SearchHistoryRequest(session_id=session_id, query=query, limit=limit)
        try:
            return await self._stub.SearchHistory(request, metadata=_metadata(token), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def expand_summary(self, token: str, session_id: str, sequence_number: int) -> pb.ExpandSummaryResponse:
        request = pb.ExpandSummaryRequest(session_id=session_id, sequence_number=sequence_number)
        try:
            return await self._stub.ExpandSummary(request, metadata=_metadata(token), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def events(self, token: str, session_id: str, after_event_id: int) -> AsyncGenerator[events_pb2.Event]:
        """The session's events after ``after_event_id`` (0 = live only); raises UpstreamError when it breaks."""
        call = self._stub.StreamEvents(
            pb.StreamEventsRequest(session_id=session_id, after_event_id=after_event_id), metadata=_metadata(token)
        )
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()
