"""Who is calling: the auth interceptor and ``caller_of`` (DESIGN §5.10).

``AuthInterceptor`` wraps every ContextService method (health and reflection stay open). With
authentication on, it reads the ``authorization`` metadata, asks the ``Authenticator`` for the
principal and runs the method with it; a refusal is ``UNAUTHENTICATED`` before the method runs.
With authentication off, every caller is the local admin ``anonymous``. The servicer asks
``caller_of(context)``; ownership itself is enforced by every store through the principal.

Audit: when a caller with a token is an admin and is let into another user's session, one line
``admin read of another user's session`` (logger ``contextsvc.audit``) names the admin, the owner,
the method and the session; listing sessions or streaming events across all users is one line too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from contextsvc import errors
from contextsvc.api.auth_limit import FailedAuthLimiter, peer_address
from contextsvc.api.errors import to_status
from contextsvc.core.session import ANONYMOUS, Principal
from contextsvc.engine.authn import TOKEN_INVALID, Authenticator
from contextsvc.throttled_log import ThrottledLog

audit = logging.getLogger("contextsvc.audit")
log = logging.getLogger(__name__)

SERVICE_PREFIX = "/contextsvc.v1.ContextService/"
#: methods that, without a session id, reach every session the caller may read.
_ACROSS_USERS = {"ListSessions", "StreamEvents"}

_CALLER: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("contextsvc_caller", default=None)

Context = grpc.aio.ServicerContext[Any, Any]


def caller_of(context: Context) -> Principal:
    """The principal of the current call, as the interceptor established it.

    Outside a server built by ``server.start`` (a servicer driven directly, in tests) no
    interceptor runs, and the caller is the local admin, as with authentication off.
    """
    return _CALLER.get() or ANONYMOUS


def authorization_of(metadata: Any) -> str | None:
    """The ``authorization`` value of invocation metadata (keys arrive lower-case).

    Several values are refused rather than one picked: with a proxy adding its own credentials
    beside a client's, whichever came first would silently decide whose call it is."""
    values = [value for key, value in metadata or () if key == "authorization"]
    if len(values) > 1:
        raise errors.Unauthenticated("send one 'authorization' metadata value, not several", reason=TOKEN_INVALID)
    return values[0] if values and isinstance(values[0], str) else None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Establishes the caller of every ContextService call; ``authenticator=None`` = auth off."""

    def __init__(
        self,
        authenticator: Authenticator | None,
        *,
        stream_check_seconds: float,
        failures: FailedAuthLimiter | None = None,
    ) -> None:
        self._authenticator = authenticator
        self._every = stream_check_seconds
        #: failed authentications per peer address (None: not limited).
        self._failures = failures
        # Every open stream checks again while the token store is down: a few lines a minute.
        self._unchecked = ThrottledLog(log, per_minute=6)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler
        name = method.removeprefix(SERVICE_PREFIX)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(name, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(name, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        # Client- and bidi-streaming methods do not exist in the contract; refuse rather than
        # let a future one through unauthenticated.
        raise AssertionError(f"{method}: only unary and server-streaming methods are wrapped")

    def _unary(self, name: str, behavior: Any) -> Callable[[Any, Context], Awaitable[Any]]:
        async def wrapped(request: Any, context: Context) -> Any:
            principal = await self._principal(name, request, context)
            token = _CALLER.set(principal)
            try:
                return await behavior(request, context)
            finally:
                _CALLER.reset(token)

        return wrapped

    def _stream(self, name: str, behavior: Any) -> Callable[[Any, Context], AsyncIterator[Any]]:
        async def wrapped(request: Any, context: Context) -> AsyncIterator[Any]:
            principal = await self._principal(name, request, context)
            _CALLER.set(principal)  # the stream runs in this call's own task and context
            items = behavior(request, context)
            if self._authenticator is not None:
                # A stream outlives the check made when it opened: without checking again, a
                # revoked or expired token would keep receiving events until the client reconnects.
                authorization = authorization_of(context.invocation_metadata())
                items = _while_valid(items, lambda: self._recheck(authorization, context), self._every)
            async with contextlib.aclosing(items):
                async for item in items:
                    yield item

        return wrapped

    async def _recheck(self, authorization: str | None, context: Context) -> None:
        assert self._authenticator is not None
        try:
            await self._authenticator.authenticate(authorization)
        except errors.Unauthenticated as exc:
            await context.abort_with_status(to_status(exc))
        except errors.ContextError as exc:
            # The token store could not answer (a failover, a file being replaced): the token is
            # not known to be bad, and the stream goes on; the next check asks again.
            self._unchecked.write("an open stream's token could not be checked again", error=str(exc))

    async def _principal(self, name: str, request: Any, context: Context) -> Principal:
        if self._authenticator is None:
            return ANONYMOUS
        peer = peer_address(context.peer() or "") if self._failures is not None else ""
        try:
            authorization = authorization_of(context.invocation_metadata())
            # The peer's allowance first (a dict lookup): the token is looked at only when it is spent.
            wait = self._failures.wait(peer) if self._failures is not None else 0.0
            if wait and self._authenticator.unvouched_lookup(authorization):
                raise errors.ResourceExhausted(
                    "too many failed authentications from this address; retry later",
                    limit="auth.failures_per_peer_per_minute",
                    subject=f"peer:{peer}",
                    retry_after_seconds=wait,
                )
            principal = await self._authenticator.authenticate(authorization)
        except errors.ContextError as exc:
            if self._failures is not None and isinstance(exc, errors.Unauthenticated):
                self._failures.failed(peer)
            await context.abort_with_status(to_status(exc))
            raise AssertionError("abort_with_status returned") from None  # pragma: no cover
        if not principal.is_admin:
            return principal
        session_id = str(getattr(request, "session_id", "") or "")
        if name == "UpdateSession":
            session_id = request.session.id
        if name in _ACROSS_USERS and not session_id:
            audit.info("admin read across users", extra={"audit": True, "user": principal.user_id, "method": name})
            return principal
        return Principal(
            user_id=principal.user_id,
            is_admin=True,
            on_foreign_read=_audit_foreign_read(principal.user_id, name, session_id),
        )


async def _while_valid(
    items: AsyncIterator[Any], check: Callable[[], Awaitable[None]], every: float
) -> AsyncGenerator[Any, None]:
    """Yield ``items`` while ``check()`` passes. It runs every ``every`` seconds in a task of its
    own beside the stream; when it aborts the call (the status goes to the client at once), the
    stream's task is cancelled so the handler ends too. One task a stream: racing each item
    against a timer took a task and a timer an event (~16 us, every watcher of every event)."""
    stream = asyncio.current_task()
    assert stream is not None

    async def watch() -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await check()
            except Exception:  # the call was aborted (AbortError): end the stream's task too
                stream.cancel()
                return

    watchdog = asyncio.create_task(watch(), name="stream-token-check")
    try:
        async for item in items:
            yield item
    finally:
        watchdog.cancel()


def _audit_foreign_read(admin: str, method: str, session_id: str) -> Callable[[str], None]:
    seen: set[str] = set()

    def record(owner: str) -> None:
        if owner in seen:  # once per call and owner, however often the store checks
            return
        seen.add(owner)
        audit.info(
            "admin read of another user's session",
            extra={"audit": True, "user": admin, "owner": owner, "method": method, "session_id": session_id},
        )

    return record
