"""The gateway's only door to the service: ContextService through the Python client, with the caller's token.

Everything the gateway asks the service goes through :class:`Upstream`, built on
:class:`contextsvc.client.ContextClient`: one channel (plaintext or TLS) for the whole gateway, and a
``with_token`` view of it per call, so the browser's API token is what the service sees
(``authorization: Bearer …``): the service, not the gateway, decides who may do what. Calls use the
client's deadline, retry and error rules; the gateway keeps protobuf responses (``client.call``)
because it renders them to its own JSON frames (frames.py).
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import Message

from contextsvc import errors, telemetry
from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import events_pb2, resources_pb2
from contextsvc.client import ContextClient, RetryPolicy, TLSOptions


@dataclass(eq=False)
class UpstreamError(Exception):
    """A failed call: the gRPC status code name, its message and the ErrorInfo reason, if any.

    Not a frozen dataclass: Python sets an exception's ``__traceback__`` as it passes through a
    generator context manager (the tracer's span, with telemetry on), which a frozen one refuses
    with a TypeError, so every refused call closed its socket 1011 with a traceback logged.
    ``eq=False`` keeps an exception's identity equality and hash."""

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


#: What an API token can be: an HTTP/2 header value is visible ASCII (a browser's cookie, query
#: or auth frame may hold anything; a token of other characters is no token, not a failed call).
#: Only that: the shape of a token (``credentials.looks_like_token``) is the service's to judge, and
#: a service with authentication off lets any value through.
_TOKEN = re.compile(r"[\x21-\x7e]*")


def _checked(token: str) -> str:
    if not _TOKEN.fullmatch(token):
        raise UpstreamError("UNAUTHENTICATED", "the API token holds characters no token has", "TOKEN_INVALID")
    return token


def _error(err: errors.ContextError) -> UpstreamError:
    code = getattr(err, "code", None)
    # The client fills a class default when the status carried no ErrorInfo; only the service's own counts.
    reason = err.reason if getattr(err, "domain", "") else ""
    return UpstreamError(code.name if code is not None else "UNKNOWN", str(err), reason)


@dataclass(frozen=True, slots=True)
class UpstreamTLS:
    """TLS to the service: PEM files of the trusted CAs (empty: the system roots), an optional
    client certificate and key (mutual TLS), and the name expected in the server's certificate
    when it differs from the target's host."""

    ca_file: str = ""
    client_cert: str = ""
    client_key: str = ""
    server_name: str = ""

    def options(self) -> TLSOptions:
        def read(path: str) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return TLSOptions(
            root_certificates=read(self.ca_file),
            certificate_chain=read(self.client_cert),
            private_key=read(self.client_key),
            server_name=self.server_name or None,
        )


class Upstream:
    """One channel to the service, shared by every socket of the gateway."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float,
        max_message_bytes: int,
        max_attempts: int = 4,
        tls: UpstreamTLS | None = None,
    ):
        self.target = target
        self.tls = tls
        self.client = ContextClient(
            target,
            tls=tls.options() if tls is not None else False,
            timeout=timeout,
            retry=RetryPolicy(max_attempts=max_attempts),
            channel_options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )

    async def close(self) -> None:
        await self.client.close()

    async def _call(self, token: str, method: str, request: Message) -> object:
        # A client span per call when tracing is on: the service's server span becomes its child.
        with telemetry.client_span(f"contextsvc.gateway/{method}"):
            try:
                return await self.client.with_token(_checked(token)).call(method, request)
            except errors.ContextError as exc:
                raise _error(exc) from None

    async def get_session(self, token: str, session_id: str) -> resources_pb2.Session:
        reply = await self._call(token, "GetSession", pb.GetSessionRequest(session_id=session_id))
        assert isinstance(reply, resources_pb2.Session)
        return reply

    async def list_sessions(
        self, token: str, *, query: str, page_size: int, page_token: str
    ) -> pb.ListSessionsResponse:
        request = pb.ListSessionsRequest(query=query, page_size=page_size, page_token=page_token)
        reply = await self._call(token, "ListSessions", request)
        assert isinstance(reply, pb.ListSessionsResponse)
        return reply

    async def append(self, token: str, request: pb.AppendMessagesRequest) -> pb.AppendMessagesResponse:
        # Sent as given: a browser's message without a request_id is not retried (it could land twice).
        reply = await self._call(token, "AppendMessages", request)
        assert isinstance(reply, pb.AppendMessagesResponse)
        return reply

    async def compress(self, token: str, session_id: str, *, dry_run: bool, reason: str) -> pb.CompressResponse:
        request = pb.CompressRequest(session_id=session_id, dry_run=dry_run, reason=reason)
        reply = await self._call(token, "Compress", request)
        assert isinstance(reply, pb.CompressResponse)
        return reply

    async def list_messages(
        self, token: str, session_id: str, *, buffer: pb.Buffer.ValueType, page_size: int, page_token: str = ""
    ) -> pb.ListMessagesResponse:
        request = pb.ListMessagesRequest(
            session_id=session_id, buffer=buffer, page_size=page_size, page_token=page_token
        )
        reply = await self._call(token, "ListMessages", request)
        assert isinstance(reply, pb.ListMessagesResponse)
        return reply

    async def build_context(self, token: str, session_id: str) -> pb.BuildContextResponse:
        # auto_compress off: looking at a session must never change it.
        request = pb.BuildContextRequest(session_id=session_id, auto_compress=False)
        reply = await self._call(token, "BuildContext", request)
        assert isinstance(reply, pb.BuildContextResponse)
        return reply

    async def search_history(self, token: str, session_id: str, *, query: str, limit: int) -> pb.SearchHistoryResponse:
        request = pb.SearchHistoryRequest(session_id=session_id, query=query, limit=limit)
        reply = await self._call(token, "SearchHistory", request)
        assert isinstance(reply, pb.SearchHistoryResponse)
        return reply

    async def expand_summary(self, token: str, session_id: str, sequence_number: int) -> pb.ExpandSummaryResponse:
        request = pb.ExpandSummaryRequest(session_id=session_id, sequence_number=sequence_number)
        reply = await self._call(token, "ExpandSummary", request)
        assert isinstance(reply, pb.ExpandSummaryResponse)
        return reply

    async def events(self, token: str, session_id: str, after_event_id: int) -> AsyncGenerator[events_pb2.Event]:
        """The session's events after ``after_event_id`` (0 = live only); the client reopens a
        dropped stream from the last event seen; raises UpstreamError when it gives up or is refused."""
        stream = self.client.with_token(_checked(token)).event_messages(session_id, after_event_id=after_event_id)
        try:
            async for event in stream:
                yield event
        except errors.ContextError as exc:
            raise _error(exc) from None
        finally:
            await stream.aclose()
