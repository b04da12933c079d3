"""The async Python client of contextsvc (grpc.aio), in plain Python shapes.

    from contextsvc.client import ContextClient

    async with ContextClient("127.0.0.1:50051", token="…") as client:
        session = await client.create_session(name="demo")
        await client.append_messages(session["id"], [{"role": "user", "content": "hello"}])
        view = await client.build_context(session["id"])

Requests take and responses return plain values: dicts keyed by the proto field names, ``int`` for
64-bit numbers, ``datetime`` (UTC) for timestamps, ``dict`` for ``Struct`` metadata, and enums as
short lower-case names (``"user"``, ``"summary"``, ``"forced"``; ``None`` for the unset value).
Errors are raised as the package's own hierarchy (:mod:`contextsvc.errors`), decoded from the
``google.rpc.ErrorInfo`` in the status details, so ``except ContextTooLarge`` works the same on both
sides of the wire. Calls failing with ``UNAVAILABLE`` are retried (honouring ``RetryInfo``), and
appends carry a generated ``request_id`` so a retried append is applied once. Calls that are not
idempotent (``CreateSession``, ``ForkSession``, ``DeleteSession``, ``RecordBaseline``, a ``Compress``
that is not a dry run, an ``AppendMessages`` without a ``request_id``) are retried only when the
server says it did not start them (``SHUTTING_DOWN``, ``STORE_NOT_READY``): an ``UNAVAILABLE`` from
a dropped connection may come after the server applied the call.

``client.with_token(token)`` is a view of the same channel that sends another token (a gateway
serving many users on one connection); ``client.call(name, request)`` runs an RPC with protobuf
messages in and out, under the same deadline, retry and error rules.

It lives in the main distribution rather than a separate one: it is built on the same error
classes and generated stubs the service uses, needs no dependency the package does not already
have, and ships in lockstep with the contract it speaks.
"""

from __future__ import annotations

import asyncio
import random
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any, TypeVar

import grpc
from google.protobuf import field_mask_pb2, json_format, struct_pb2, timestamp_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message as ProtoMessage
from google.rpc import error_details_pb2, status_pb2

from contextsvc import errors
from contextsvc.telemetry import outgoing_metadata
from contextsvc.v1 import context_service_pb2 as pb
from contextsvc.v1 import context_service_pb2_grpc as pb_grpc
from contextsvc.v1 import events_pb2, resources_pb2

__all__ = ["ContextClient", "RetryPolicy", "TLSOptions", "from_plain", "to_plain"]

Plain = dict[str, Any]
M = TypeVar("M", bound=ProtoMessage)
T = TypeVar("T")

_STATUS_DETAILS_KEY = "grpc-status-details-bin"

_SERVICE: Any = pb.DESCRIPTOR.services_by_name["ContextService"]

#: RPCs whose retry could apply them twice (see ``_idempotent`` for the conditional ones).
_NOT_IDEMPOTENT = frozenset({"CreateSession", "ForkSession", "DeleteSession", "RecordBaseline"})

#: ErrorInfo reasons of an UNAVAILABLE the server sends before it starts a call: safe to retry any call.
NOT_STARTED_REASONS = frozenset({"SHUTTING_DOWN", "STORE_NOT_READY"})

#: Largest response the client reads unless ``channel_options`` say otherwise: the server's own send
#: limit (``limits.grpc_max_send_bytes``, 64 MiB). gRPC's default of 4 MiB is less than one message
#: at the content limit (4 Mi characters) or a view carrying a few screenshots, so an agent could
#: append what it could then never read back.
MAX_RECEIVE_BYTES = 64 * 1024 * 1024


def _idempotent(method: str, request: ProtoMessage) -> bool:
    """True when running ``request`` twice has the effect of running it once."""
    if method in _NOT_IDEMPOTENT:
        return False
    if isinstance(request, pb.AppendMessagesRequest):
        return bool(request.request_id)  # the server applies a request id once
    if isinstance(request, pb.CompressRequest):
        return request.dry_run
    return True


# --------------------------------------------------------------------------------------------- errors

# ErrorInfo reason -> the most specific class of the hierarchy that declares it.
_BY_REASON: dict[str, type[errors.ContextError]] = {}


def _collect(kind: type[errors.ContextError]) -> None:
    _BY_REASON.setdefault(kind.reason, kind)
    for sub in kind.__subclasses__():
        _collect(sub)


_collect(errors.ContextError)

# gRPC code -> class, for reasons the hierarchy has no class of its own for (e.g. UNKNOWN_PROFILE).
_BY_CODE: dict[grpc.StatusCode, type[errors.ContextError]] = {
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.ABORTED: errors.Conflict,
    grpc.StatusCode.ALREADY_EXISTS: errors.Conflict,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Unavailable,
    grpc.StatusCode.UNIMPLEMENTED: errors.Unimplemented,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
}


def _seconds(text: str | None) -> float:
    try:
        return max(0.0, float(text or 0))
    except ValueError:
        return 0.0


def error_from_rpc(exc: grpc.aio.AioRpcError) -> errors.ContextError:
    """The typed error of a failed call. Sets ``code`` (the gRPC status code), ``domain`` and
    ``retry_delay`` (seconds from ``RetryInfo``, or None) as extra attributes."""
    code = exc.code()
    message = exc.details() or code.name
    reason, domain, metadata = "", "", {}
    violations: list[errors.FieldViolation] = []
    retry_delay: float | None = None
    subject = ""
    for key, value in exc.trailing_metadata() or ():
        if key != _STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason, domain, metadata = info.reason, info.domain, dict(info.metadata)
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                violations = [errors.FieldViolation(v.field, v.description) for v in bad.field_violations]
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                retry_delay = retry.retry_delay.ToTimedelta().total_seconds()
            elif detail.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
                quota = error_details_pb2.QuotaFailure()
                detail.Unpack(quota)
                subject = quota.violations[0].subject if quota.violations else ""
    kind = _BY_REASON.get(reason) or _BY_CODE.get(code, errors.ContextError)
    # Made without the class's own constructor: some take what the server raising them had
    # (RequestIdReused a request id, ResourceExhausted a limit), not what the status carries.
    err = kind.__new__(kind)
    # Without an ErrorInfo (gRPC's own refusals: a deadline, a message over the size limit) the
    # reason is the canonical code name, as in the Go and TypeScript clients, not the class's.
    named = reason or code.name
    if isinstance(err, errors.InvalidArgument):
        errors.InvalidArgument.__init__(err, message, violations=violations, reason=named, metadata=metadata)
    else:
        errors.ContextError.__init__(err, message, reason=named, metadata=metadata)
    if isinstance(err, errors.ResourceExhausted):
        err.limit = metadata.get("limit", "")
        err.subject = subject
        later = retry_delay if retry_delay is not None else _seconds(metadata.get("retry_after_seconds"))
        err.retry_after_seconds = later
    err.code = code  # type: ignore[attr-defined]
    err.domain = domain  # type: ignore[attr-defined]
    err.retry_delay = retry_delay  # type: ignore[attr-defined]
    return err


# ------------------------------------------------------------------------------------- plain shapes


def _enum_prefix(enum: Any) -> str:
    snake = "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(enum.name))
    return snake.upper() + "_"


def enum_to_plain(enum: Any, number: int) -> str | None:
    value = enum.values_by_number.get(number)
    if value is None or number == 0:
        return None
    return str(value.name).removeprefix(_enum_prefix(enum)).lower()


def enum_from_plain(enum: Any, value: str | int | None) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    name = _enum_prefix(enum) + value.upper()
    found = enum.values_by_name.get(name) or enum.values_by_name.get(value)
    if found is None:
        choices = ", ".join(v.name.removeprefix(_enum_prefix(enum)).lower() for v in enum.values if v.number)
        raise ValueError(f"{enum.name}: unknown value {value!r} (one of {choices})")
    return int(found.number)


def _is_map(fd: Any) -> bool:
    return fd.message_type is not None and bool(fd.message_type.GetOptions().map_entry)


def _value_to_plain(fd: Any, value: Any) -> Any:
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return enum_to_plain(fd.enum_type, value)
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return to_plain(value)
    return value


def to_plain(message: ProtoMessage) -> Any:
    """A protobuf message as plain Python values (see the module docstring)."""
    desc: Any = message.DESCRIPTOR
    if desc.full_name == "google.protobuf.Timestamp":
        assert isinstance(message, timestamp_pb2.Timestamp)
        return message.ToDatetime(tzinfo=UTC)
    if desc.full_name == "google.protobuf.Struct":
        return json_format.MessageToDict(message)
    out: Plain = {}
    for fd in desc.fields:
        value = getattr(message, fd.name)
        oneof = fd.containing_oneof
        if oneof is not None and not fd.has_presence:
            continue
        if oneof is not None and not _synthetic(oneof) and not message.HasField(fd.name):
            continue  # a real oneof: only the member that is set appears
        if _is_map(fd):
            vfd = fd.message_type.fields_by_name["value"]
            out[fd.name] = {k: _value_to_plain(vfd, v) for k, v in value.items()}
        elif fd.is_repeated:
            out[fd.name] = [_value_to_plain(fd, v) for v in value]
        elif fd.has_presence and not message.HasField(fd.name):
            out[fd.name] = None
        else:
            out[fd.name] = _value_to_plain(fd, value)
    for oneof in desc.oneofs:
        if not _synthetic(oneof):
            out[oneof.name] = message.WhichOneof(oneof.name)
    return out


def _synthetic(oneof: Any) -> bool:
    """True for the oneof protoc makes for a proto3 ``optional`` field."""
    return len(oneof.fields) == 1 and oneof.name == "_" + oneof.fields[0].name


def from_plain(cls: type[M], values: Mapping[str, Any] | M | None) -> M:
    """A protobuf message of type ``cls`` from plain values (or the message itself)."""
    if isinstance(values, cls):
        return values
    message = cls()
    if values is not None:
        _fill(message, values)
    return message


def _fill(message: ProtoMessage, values: Any) -> None:
    desc: Any = message.DESCRIPTOR
    if desc.full_name == "google.protobuf.Timestamp":
        assert isinstance(message, timestamp_pb2.Timestamp)
        message.FromDatetime(values)
        return
    if desc.full_name == "google.protobuf.Struct":
        assert isinstance(message, struct_pb2.Struct)
        message.update(dict(values))
        return
    if desc.full_name == "google.protobuf.FieldMask":
        assert isinstance(message, field_mask_pb2.FieldMask)
        message.paths.extend(values)
        return
    if desc.full_name == "contextsvc.v1.Image" and isinstance(values, bytes | bytearray):
        values = {"data": bytes(values)}
    if not isinstance(values, Mapping):
        raise TypeError(f"{desc.name}: expected a mapping, got {type(values).__name__}")
    for key, value in values.items():
        fd = desc.fields_by_name.get(key)
        if fd is None and key in desc.oneofs_by_name:
            # ``to_plain`` names a real oneof's set member under the oneof's name (``payload``).
            _fill_oneof_name(message, desc.oneofs_by_name[key], value, values)
            continue
        if fd is None:
            raise TypeError(f"{desc.name} has no field {key!r}")
        if value is None:
            continue
        if fd.is_repeated and not _is_map(fd):
            target = getattr(message, key)
            for item in value:
                if fd.type == FieldDescriptor.TYPE_MESSAGE:
                    _fill(target.add(), item)
                elif fd.type == FieldDescriptor.TYPE_ENUM:
                    target.append(enum_from_plain(fd.enum_type, item))
                else:
                    target.append(item)
        elif _is_map(fd):
            getattr(message, key).update(value)
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            _fill(getattr(message, key), value)
            getattr(message, key).SetInParent()
        elif fd.type == FieldDescriptor.TYPE_ENUM:
            setattr(message, key, enum_from_plain(fd.enum_type, value))
        else:
            setattr(message, key, value)


def _fill_oneof_name(message: ProtoMessage, oneof: Any, value: Any, values: Mapping[str, Any]) -> None:
    """The oneof-name key of a plain message (``"payload": "messages_appended"``): None, or the
    name of one of its members, which is then set even when its own key is missing (an empty one)."""
    if value is None:
        return
    member = next((f for f in oneof.fields if f.name == value), None)
    if member is None:
        choices = ", ".join(f.name for f in oneof.fields)
        raise TypeError(f"{message.DESCRIPTOR.name}.{oneof.name}: unknown member {value!r} (one of {choices})")
    if values.get(value) is None and member.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(message, value).SetInParent()


# ------------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of calls that fail with ``UNAVAILABLE`` (and only those).

    The wait before attempt n+1 is the server's ``RetryInfo`` delay when it sent one, else an
    exponential backoff ``initial_backoff * multiplier**n`` with full jitter, capped at ``max_backoff``.
    The same numbers pace the reconnects of :meth:`ContextClient.events`."""

    #: attempts per call, the first included (1 = no retry).
    max_attempts: int = 4
    #: seconds before the first retry when the server sent no RetryInfo.
    initial_backoff: float = 0.1
    #: longest wait between two attempts, in seconds (a RetryInfo delay is capped by it too).
    max_backoff: float = 5.0
    multiplier: float = 2.0
    #: consecutive failed reconnects after which ``events()`` gives up with Unavailable.
    max_reconnects: int = 10
    #: longest wait of the channel's own reconnects to a server that went away, in seconds (gRPC's
    #: default grows to 120 s: calls went on failing for seconds after a restarted server was back,
    #: and grpc.aio cannot reset that backoff). The channel's first reconnect waits ``initial_backoff``.
    max_reconnect_backoff: float = 1.0

    def backoff(self, attempt: int, hint: float | None = None) -> float:
        if hint is not None and hint > 0:
            return min(hint, self.max_backoff)
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier**attempt)
        return random.uniform(ceiling / 2, ceiling)


@dataclass(frozen=True)
class TLSOptions:
    """TLS for the channel. All PEM bytes; leave ``root_certificates`` unset for the system roots."""

    root_certificates: bytes | None = None
    #: client certificate and key, for mutual TLS.
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    #: expected server name when it differs from the target host (tests, IP targets).
    server_name: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- client


def _bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata sending ``token``. A token read from a file (a mounted secret) ends with a
    newline, which gRPC refuses in a header with an untyped error: surrounding whitespace is
    dropped, as Node's headers (the TypeScript client) drop it; a token holds none of its own."""
    token = (token or "").strip()
    return (("authorization", f"Bearer {token}"),) if token else ()


#: what a header value can carry: visible ASCII and spaces.
_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")


def _token_error(metadata: tuple[tuple[str, str], ...]) -> errors.Unauthenticated | None:
    """A token no header can carry (``"tok\u00e9n"``, a control character) is a wrong token: the
    ``UNAUTHENTICATED`` / ``TOKEN_INVALID`` the service and the gateway answer for one, not gRPC's
    untyped ``ExecuteBatchError`` when the call sends its metadata."""
    if all(_HEADER_VALUE.fullmatch(value) for _, value in metadata):
        return None
    err = errors.Unauthenticated("the API token holds characters no token has", reason="TOKEN_INVALID")
    err.code = grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    err.domain = ""  # type: ignore[attr-defined]
    err.retry_delay = None  # type: ignore[attr-defined]
    return err


class _Connection:
    """The channel of a client and its ``with_token`` views, made on first use: grpc.aio binds a
    channel to the event loop current when it is made, so one made with the client, before
    ``asyncio.run`` (at module level, as the README shows), failed in the loop that used it."""

    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]):
        self._target, self._credentials, self._options = target, credentials, options
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._closed = False

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._closed:
            # As httpx: a closed client is a programming error, never a channel opened again that
            # nothing would close.
            raise RuntimeError("the ContextClient is closed")
        if self._channel is None:
            if self._credentials is None:
                self._channel = grpc.aio.insecure_channel(self._target, options=self._options)
            else:
                self._channel = grpc.aio.secure_channel(self._target, self._credentials, options=self._options)
        return self._channel

    @property
    def stub(self) -> Any:
        if self._stub is None or self._closed:
            self._stub = pb_grpc.ContextServiceStub(self.channel)
        return self._stub

    async def close(self) -> None:
        self._closed = True
        if self._channel is not None:
            await self._channel.close()

    def cut_off(self) -> bool:
        """Whether a call just ended by a CancelledError was cut off by :meth:`close` (grpc.aio
        cancels the calls of a channel it closes) rather than by its own task's cancellation."""
        task = asyncio.current_task()
        return self._closed and (task is None or task.cancelling() == 0)


class ContextClient:
    """One channel to a contextsvc server; one async method per RPC. Use as an async context
    manager or call :meth:`close`."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: TLSOptions | bool = False,
        timeout: float | None = 30.0,
        retry: RetryPolicy | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        """``target`` is ``host:port``. ``token`` is sent as ``authorization: Bearer <token>``.
        ``tls`` True uses the system roots; a :class:`TLSOptions` sets roots, client cert or
        server name. ``timeout`` is the default deadline of one call in seconds (retries included);
        every method takes ``timeout=`` to override it, None meaning no deadline. Responses up to
        :data:`MAX_RECEIVE_BYTES` are read, and the channel reconnects on the retry policy's
        backoff (``initial_backoff`` up to ``max_reconnect_backoff``), unless ``channel_options`` set
        ``grpc.max_receive_message_length`` or ``grpc.*_reconnect_backoff_ms``."""
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._metadata = _bearer(token)
        options = list(channel_options)
        given = {name for name, _ in options}
        defaults = (
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", max(1, round(self.retry.initial_backoff * 1000))),
            ("grpc.max_reconnect_backoff_ms", max(1, round(self.retry.max_reconnect_backoff * 1000))),
        )
        options += [(name, value) for name, value in defaults if name not in given]
        creds = None
        if tls:
            opts = tls if isinstance(tls, TLSOptions) else TLSOptions()
            creds = grpc.ssl_channel_credentials(opts.root_certificates, opts.private_key, opts.certificate_chain)
            if opts.server_name:
                options.append(("grpc.ssl_target_name_override", opts.server_name))
        self._conn = _Connection(target, creds, options)
        self._owner = True

    @property
    def _channel(self) -> grpc.aio.Channel:
        return self._conn.channel

    @property
    def _stub(self) -> Any:
        return self._conn.stub

    def with_token(self, token: str | None) -> ContextClient:
        """A view of this client sending ``token`` (None or empty: no token) instead of its own.
        It shares the channel, deadline and retry policy; closing it does nothing (close the
        client that made it). Cheap enough to make per call."""
        view = object.__new__(ContextClient)
        view.target, view.timeout, view.retry = self.target, self.timeout, self.retry
        view._conn, view._owner = self._conn, False
        view._metadata = _bearer(token)
        return view

    async def close(self) -> None:
        if self._owner:
            await self._conn.close()

    def _auth(self) -> tuple[tuple[str, str], ...]:
        """The token's metadata; raises :class:`~contextsvc.errors.Unauthenticated` for a token no
        header can carry."""
        err = _token_error(self._metadata)
        if err is not None:
            raise err
        return self._metadata

    async def __aenter__(self) -> ContextClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------------------ plumbing

    async def call(self, method: str, request: ProtoMessage, *, timeout: float | None = None) -> Any:
        """The unary RPC ``method`` (e.g. ``"GetSession"``) with a protobuf request; returns the
        protobuf response. Same deadline, retries and typed errors as the named methods (an
        ``AppendMessagesRequest`` is sent as given: without a ``request_id`` it is not retried)."""
        rpc = _SERVICE.methods_by_name.get(method)
        if rpc is None or rpc.server_streaming or rpc.client_streaming:
            raise ValueError(f"{method!r} is not a unary RPC of ContextService")
        if request.DESCRIPTOR is not rpc.input_type:
            raise TypeError(f"{method} takes {rpc.input_type.name}, got {request.DESCRIPTOR.name}")
        return await self._call(getattr(self._stub, method), request, timeout, idempotent=_idempotent(method, request))

    async def _call(
        self,
        method: Callable[..., Awaitable[T]],
        request: ProtoMessage,
        timeout: float | None,
        *,
        idempotent: bool = True,
    ) -> T:
        """One unary call with the deadline spread over its retries on UNAVAILABLE (a call that is
        not idempotent only when the server says it did not start it)."""
        budget = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = None if budget is None else loop.time() + budget
        attempt = 0
        while True:
            # never 0: grpc reads a zero timeout as "no deadline"
            remaining = None if deadline is None else max(deadline - loop.time(), 1e-6)
            try:
                return await method(request, timeout=remaining, metadata=self._auth() + outgoing_metadata())
            except asyncio.CancelledError:
                # Closed under it: a CancelledError in a task nobody cancelled ended that task as
                # cancelled (asyncio.gather, TaskGroup) and passed every ``except Exception``.
                if self._conn.cut_off():
                    raise RuntimeError("the ContextClient is closed") from None
                raise
            except grpc.aio.AioRpcError as exc:
                err = error_from_rpc(exc)
                attempt += 1
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retry.max_attempts:
                    raise err from None
                if not idempotent and err.reason not in NOT_STARTED_REASONS:
                    raise err from None
                wait = self.retry.backoff(attempt - 1, err.retry_delay)  # type: ignore[attr-defined]
                if deadline is not None and loop.time() + wait >= deadline:
                    raise err from None
                await asyncio.sleep(wait)

    # --------------------------------------------------------------------------------- RPCs

    async def create_session(
        self,
        *,
        profile_id: str = "",
        name: str = "",
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Plain:
        req = from_plain(pb.CreateSessionRequest, {"profile_id": profile_id, "name": name, "metadata": metadata})
        reply = await self._call(self._stub.CreateSession, req, timeout, idempotent=False)
        return to_plain(reply)  # type: ignore[no-any-return]

    async def get_session(self, session_id: str, *, timeout: float | None = None) -> Plain:
        req = pb.GetSessionRequest(session_id=session_id)
        return to_plain(await self._call(self._stub.GetSession, req, timeout))  # type: ignore[no-any-return]

    async def list_sessions(
        self,
        *,
        page_size: int = 0,
        page_token: str = "",
        profile_id: str = "",
        query: str = "",
        timeout: float | None = None,
    ) -> Plain:
        req = pb.ListSessionsRequest(page_size=page_size, page_token=page_token, profile_id=profile_id, query=query)
        return to_plain(await self._call(self._stub.ListSessions, req, timeout))  # type: ignore[no-any-return]

    async def update_session(
        self,
        session_id: str,
        *,
        name: str | None = None,
        pinned: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Plain:
        """Updates the fields given (not None); the update mask is derived from them."""
        changes = {k: v for k, v in {"name": name, "pinned": pinned, "metadata": metadata}.items() if v is not None}
        req = from_plain(
            pb.UpdateSessionRequest, {"session": {"id": session_id, **changes}, "update_mask": sorted(changes)}
        )
        return to_plain(await self._call(self._stub.UpdateSession, req, timeout))  # type: ignore[no-any-return]

    async def delete_session(self, session_id: str, *, timeout: float | None = None) -> None:
        req = pb.DeleteSessionRequest(session_id=session_id)
        await self._call(self._stub.DeleteSession, req, timeout, idempotent=False)

    async def append_messages(
        self,
        session_id: str,
        messages: Iterable[Mapping[str, Any]],
        *,
        request_id: str | None = None,
        turn_complete: bool = False,
        timeout: float | None = None,
    ) -> Plain:
        """Appends messages (dicts like ``{"role": "user", "content": "…", "images": [png_bytes]}``).
        Without ``request_id`` one is generated, so retries of this call are applied once."""
        req = pb.AppendMessagesRequest(
            session_id=session_id,
            messages=[from_plain(resources_pb2.Message, m) for m in messages],
            request_id=request_id or str(uuid.uuid4()),
            turn_complete=turn_complete,
        )
        return to_plain(await self._call(self._stub.AppendMessages, req, timeout))  # type: ignore[no-any-return]

    async def list_messages(
        self,
        session_id: str,
        *,
        buffer: str = "display",
        page_size: int = 0,
        before_sequence: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Plain:
        """``buffer`` is ``"display"`` or ``"context"``. The newest ``page_size`` rows, oldest first;
        older ones with ``page_token=<the reply's next_page_token>`` (either buffer) or, for the
        display buffer, ``before_sequence``."""
        req = from_plain(
            pb.ListMessagesRequest,
            {
                "session_id": session_id,
                "buffer": buffer,
                "page_size": page_size,
                "before_sequence": before_sequence,
                "page_token": page_token,
            },
        )
        return to_plain(await self._call(self._stub.ListMessages, req, timeout))  # type: ignore[no-any-return]

    async def build_context(
        self,
        session_id: str,
        *,
        profile: Mapping[str, Any] | None = None,
        incoming: Mapping[str, Any] | None = None,
        phase: str | None = None,
        auto_compress: bool | None = None,
        timeout: float | None = None,
    ) -> Plain:
        """``phase`` is ``"pre_turn"`` (default) or ``"mid_turn"``."""
        req = from_plain(
            pb.BuildContextRequest,
            {
                "session_id": session_id,
                "profile": profile,
                "incoming": incoming,
                "phase": phase,
                "auto_compress": auto_compress,
            },
        )
        return to_plain(await self._call(self._stub.BuildContext, req, timeout))  # type: ignore[no-any-return]

    async def estimate_tokens(
        self,
        *,
        session_id: str = "",
        messages: Iterable[Mapping[str, Any]] = (),
        model: str = "",
        profile: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Plain:
        req = from_plain(
            pb.EstimateTokensRequest,
            {"session_id": session_id, "messages": list(messages), "model": model, "profile": profile},
        )
        return to_plain(await self._call(self._stub.EstimateTokens, req, timeout))  # type: ignore[no-any-return]

    async def record_baseline(
        self, session_id: str, view_id: str, prompt_tokens: int, *, timeout: float | None = None
    ) -> Plain:
        req = pb.RecordBaselineRequest(session_id=session_id, view_id=view_id, prompt_tokens=prompt_tokens)
        reply = await self._call(self._stub.RecordBaseline, req, timeout, idempotent=False)
        return to_plain(reply)  # type: ignore[no-any-return]

    async def compress(
        self,
        session_id: str,
        *,
        profile: Mapping[str, Any] | None = None,
        reason: str = "",
        dry_run: bool = False,
        timeout: float | None = None,
    ) -> Plain:
        req = from_plain(
            pb.CompressRequest, {"session_id": session_id, "profile": profile, "reason": reason, "dry_run": dry_run}
        )
        reply = await self._call(self._stub.Compress, req, timeout, idempotent=dry_run)
        return to_plain(reply)  # type: ignore[no-any-return]

    async def search_history(
        self, session_id: str, query: str, *, limit: int = 0, timeout: float | None = None
    ) -> Plain:
        req = pb.SearchHistoryRequest(session_id=session_id, query=query, limit=limit)
        return to_plain(await self._call(self._stub.SearchHistory, req, timeout))  # type: ignore[no-any-return]

    async def expand_summary(self, session_id: str, sequence_number: int, *, timeout: float | None = None) -> Plain:
        req = pb.ExpandSummaryRequest(session_id=session_id, sequence_number=sequence_number)
        return to_plain(await self._call(self._stub.ExpandSummary, req, timeout))  # type: ignore[no-any-return]

    async def fork_session(self, session_id: str, *, at_sequence: int = 0, timeout: float | None = None) -> Plain:
        req = pb.ForkSessionRequest(session_id=session_id, at_sequence=at_sequence)
        reply = await self._call(self._stub.ForkSession, req, timeout, idempotent=False)
        return to_plain(reply)  # type: ignore[no-any-return]

    async def events(self, session_id: str = "", *, after_event_id: int = 0) -> AsyncIterator[Plain]:
        """Events of one session (or of every session the caller may read), as plain dicts with
        ``event_id``, ``session_id``, ``time``, ``payload`` (the kind, e.g. ``"messages_appended"``)
        and that kind's fields under its name.

        A stream that drops (``UNAVAILABLE``, or closed by the server) is reopened from the last
        event id seen, so no event is lost or repeated within the server's retention window; waits
        between reconnects back off exponentially up to ``retry.max_backoff``, and after
        ``retry.max_reconnects`` consecutive failures the iterator raises :class:`Unavailable`.
        Other errors are raised at once. The iterator ends after a ``session_deleted`` event."""
        async for event in self.event_messages(session_id, after_event_id=after_event_id):
            yield to_plain(event)

    async def event_messages(
        self, session_id: str = "", *, after_event_id: int = 0
    ) -> AsyncGenerator[events_pb2.Event]:
        """:meth:`events` as protobuf ``Event`` messages (same resume and end rules)."""
        last = after_event_id
        failures = 0
        while True:
            call = self._stub.StreamEvents(
                pb.StreamEventsRequest(session_id=session_id, after_event_id=last),
                metadata=self._auth() + outgoing_metadata(),
            )
            hint: float | None = None
            try:
                async for event in call:
                    failures = 0
                    last = event.event_id
                    yield event
                    if session_id and event.WhichOneof("payload") == "session_deleted":
                        return
            except asyncio.CancelledError:
                if self._conn.cut_off():  # closed under it, as a unary call (_call)
                    raise RuntimeError("the ContextClient is closed") from None
                raise
            except grpc.aio.AioRpcError as exc:
                err = error_from_rpc(exc)
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise err from None
                hint = err.retry_delay  # type: ignore[attr-defined]
                if failures >= self.retry.max_reconnects:
                    raise err from None
            finally:
                call.cancel()
            if failures >= self.retry.max_reconnects:
                raise errors.Unavailable(f"event stream closed {failures} times in a row")
            await asyncio.sleep(self.retry.backoff(failures, hint))
            failures += 1
