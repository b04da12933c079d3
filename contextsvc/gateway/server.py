"""The WebSocket gateway: ``ws://host/ws/sessions/{id}`` for browsers, plus the inspector page.

It is a gRPC client of the service (see upstream.py) and holds no state the service does not:
only caches (the hubs' replay rings) and the sockets themselves. The protocol is in docs/websocket.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import mimetypes
import os
import re
import weakref
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode
from websockets.http11 import Request, Response
from websockets.protocol import Protocol, State

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2
from contextsvc.config import Settings
from contextsvc.gateway import frames
from contextsvc.gateway.hub import (
    CLOSE_DENIED,
    CLOSE_NOT_FOUND,
    CLOSE_UNAVAILABLE,
    OVER_QUOTA,
    HubRegistry,
    Item,
    SessionHub,
    Subscriber,
)
from contextsvc.gateway.tls import ListenerTLS, bundled_upstream_tls, listener_tls, standalone_upstream_tls
from contextsvc.gateway.upstream import Upstream, UpstreamError, UpstreamTLS
from contextsvc.throttled_log import ThrottledLog
from contextsvc.transport import TransportError, is_loopback, listen_host

log = logging.getLogger(__name__)
# The library logs every connection at INFO (an object repr, nothing useful): keep warnings only.
_ws_log = logging.getLogger("contextsvc.gateway.ws")
_ws_log.setLevel(logging.WARNING)

_WS_PATH = re.compile(r"^/ws/sessions/([^/]+)$")
_PAGE_PATH = re.compile(r"^/(sessions/[^/]+)?$")
_STATIC_PATH = re.compile(r"^/static/([A-Za-z0-9_\-]+\.(?:js|css|html|svg))$")
_EVENT_ID = re.compile(r"[0-9]{1,20}")
_BUFFERS = {"display": pb.BUFFER_DISPLAY, "context": pb.BUFFER_CONTEXT}


class _Closed(Exception):
    """Close the socket with this code."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _close_for(exc: UpstreamError, unreachable: ThrottledLog | None = None) -> _Closed:
    """The close of a socket whose call to the service failed; a service it cannot reach is one
    warning line, through ``unreachable`` (at most ``refusal_log_per_minute`` a minute)."""
    if exc.denied:
        return _Closed(CLOSE_DENIED, "access denied")
    if exc.not_found or exc.code == "INVALID_ARGUMENT":
        # A malformed id names no session either.
        return _Closed(CLOSE_NOT_FOUND, "session not found")
    if exc.code == "RESOURCE_EXHAUSTED":
        # A per-user quota, or failed authentications limited at the gateway's address: "try again
        # later", and no log line (the service wrote one; browsers retrying would add one each).
        return _Closed(CLOSE_UNAVAILABLE, OVER_QUOTA)
    # The operator needs the cause (a refused connection, a TLS handshake or name mismatch): the
    # browser gets the code only. gRPC's message names the address, never a token.
    # Every browser's (re)connect while the service is away comes here: without a bound, a line
    # each, as many as sockets are opened.
    fields = {"code": exc.code, "error": exc.message[:300]}
    if unreachable is not None:
        unreachable.write("service unreachable; closing the socket 1013", **fields)
    else:
        log.warning("service unreachable; closing the socket 1013", extra=fields)
    return _Closed(CLOSE_UNAVAILABLE, f"service unavailable: {exc.code}")


def _cookie_token(headers: Headers, name: str) -> str:
    cookie = SimpleCookie()
    for raw in headers.get_all("Cookie"):
        with contextlib.suppress(CookieError):
            cookie.load(raw)
    morsel = cookie.get(name)
    return morsel.value if morsel is not None else ""


class _Repeated(Exception):
    """A header that must come once came several times."""


def _header(headers: Headers, name: str) -> str | None:
    """The one value of ``name``; None when absent. ``Headers.get`` raises on repeated headers:
    a request with two Authorization or Origin headers is ambiguous, and refused (_Repeated)."""
    values = headers.get_all(name)
    if len(values) > 1:
        raise _Repeated(name)
    return values[0] if values else None


def _netloc(url: str) -> str | None:
    """The ``host:port`` of a URL; None for one that does not parse (it matches no Host)."""
    try:
        return urlsplit(url).netloc
    except ValueError:  # "http://[::1": an unclosed IPv6 bracket
        return None


def _bearer(headers: Headers) -> str:
    scheme, _, token = (_header(headers, "Authorization") or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _json_response(status: http.HTTPStatus, body: Any) -> Response:
    data = json.dumps(body, separators=(",", ":")).encode()
    headers = Headers([("Content-Type", "application/json"), ("Cache-Control", "no-store")])
    return Response(status.value, status.phrase, headers, data)


def _write_now(ws: ServerConnection, data: bytes) -> bool:
    """Frame and write a text message synchronously when the socket is open and its write buffer is
    empty (the kernel takes it at once). Otherwise the socket's sender task sends it in order, with
    flow control. Never splits a frame: this library's sends write whole frames without awaiting."""
    if ws.protocol.state is not State.OPEN or ws.transport.get_write_buffer_size() > 0:
        return False
    ws.protocol.send_text(data)
    for chunk in ws.protocol.data_to_send():
        if chunk:
            ws.transport.write(chunk)
    return True


@dataclass(slots=True)
class _Socket:
    """Per-connection state."""

    ws: ServerConnection
    session_id: str
    token: str
    sub: Subscriber | None = None
    #: the token came in an auth frame, whose answer (``auth_ok``) is still owed.
    auth_frame: bool = False


class Gateway:
    """The gateway server; ``start()`` then ``close()``."""

    def __init__(
        self,
        settings: Settings,
        target: str,
        *,
        upstream_tls: UpstreamTLS | None = None,
        tls: ListenerTLS | None = None,
    ):
        self.settings = settings
        self.gs = settings.gateway
        self.tls = tls
        self.upstream = Upstream(
            target,
            timeout=self.gs.upstream_timeout_seconds,
            max_message_bytes=max(settings.limits.grpc_max_receive_bytes, settings.limits.grpc_max_send_bytes),
            max_attempts=self.gs.upstream_max_attempts,
            tls=upstream_tls,
        )
        self.hubs = HubRegistry(self.upstream, self.gs)
        self._server: Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: the service's answer to an anonymous caller, asked before a tokenless socket's handshake.
        self._anonymous: weakref.WeakKeyDictionary[ServerConnection, resources_pb2.Session | UpstreamError] = (
            weakref.WeakKeyDictionary()
        )
        self.port = 0
        self._loopback = False
        self._allowed_hosts = {h.lower() for h in self.gs.allowed_hosts}
        #: "service unreachable" lines, at most refusal_log_per_minute a minute (``_close_for``).
        self._unreachable = ThrottledLog(log, per_minute=settings.refusal_log_per_minute)

    async def start(self, listen: str) -> int:
        host, _, port = listen.rpartition(":")
        self._server = await serve(
            self._handle,
            host.strip("[]"),
            int(port),
            process_request=self._process_request,
            ssl=self.tls.context if self.tls is not None else None,
            max_size=self.gs.max_frame_bytes,
            compression="deflate" if self.gs.compression else None,
            ping_interval=self.gs.ping_interval_seconds,
            ping_timeout=self.gs.ping_timeout_seconds,
            close_timeout=self.gs.close_timeout_seconds,
            # The query string may carry a token: the handshake is never logged by the library.
            logger=_ws_log,
        )
        sockets = list(self._server.sockets)
        self.port = sockets[0].getsockname()[1] if sockets else 0
        self._loopback = is_loopback(listen_host(listen))
        return self.port

    def _host_allowed(self, host: str) -> bool:
        """Whether a loopback listener answers this Host header: a loopback name, or one listed."""
        try:
            name = urlsplit(f"//{host}").hostname or ""
        except ValueError:  # an unclosed bracket: no name at all
            return False
        return is_loopback(name) or name in self._allowed_hosts

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def reload_certificates(self) -> None:
        """SIGHUP: reread the listener's certificate pair (the upstream channel keeps its own)."""
        if self.tls is not None:
            self.tls.reload()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self.hubs.close()
        await self.upstream.close()

    # ---- HTTP: the inspector page and its JSON reads -------------------------------------------------

    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        try:
            url = urlsplit(request.path)
        except ValueError:  # "//[::1/…": an unclosed IPv6 bracket where a host would be
            return connection.respond(http.HTTPStatus.BAD_REQUEST, "the request target does not parse\n")
        try:
            origin, host = _header(request.headers, "Origin"), _header(request.headers, "Host")
        except _Repeated as exc:
            return connection.respond(http.HTTPStatus.FORBIDDEN, f"several {exc} headers are refused\n")
        if host is not None and self._loopback and not self._host_allowed(host):
            return connection.respond(
                http.HTTPStatus.FORBIDDEN,
                "this gateway listens on loopback and answers loopback host names only; "
                "list another name in gateway.allowed_hosts\n",
            )
        if origin is not None and _netloc(origin) != (host or ""):
            # Cookies ride along on cross-site sockets too: only pages served by this gateway may connect.
            return connection.respond(http.HTTPStatus.FORBIDDEN, "cross-origin requests are refused\n")
        socket_path = _WS_PATH.match(url.path)
        if socket_path:
            await self._before_handshake(connection, request, socket_path.group(1), parse_qs(url.query))
            return None  # the WebSocket handshake proceeds
        if url.path == "/api/sessions":
            return await self._api_sessions(request, parse_qs(url.query))
        if url.path == "/favicon.ico":
            return Response(204, "No Content", Headers(), b"")
        if url.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "ok\n")
        static = _STATIC_PATH.match(url.path)
        if _PAGE_PATH.match(url.path):
            return self._static("index.html")
        if static:
            return self._static(static.group(1))
        return connection.respond(http.HTTPStatus.NOT_FOUND, "not found\n")

    def _static(self, name: str) -> Response:
        try:
            data = resources.files("contextsvc.gateway").joinpath("static", name).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            status = http.HTTPStatus.NOT_FOUND
            return Response(status.value, status.phrase, Headers([("Content-Type", "text/plain")]), b"not found\n")
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if kind.startswith("text/") or kind.endswith("javascript"):
            kind += "; charset=utf-8"
        headers = Headers(
            [
                ("Content-Type", kind),
                ("Cache-Control", "no-cache"),
                ("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; connect-src 'self'"),
                ("X-Content-Type-Options", "nosniff"),
            ]
        )
        return Response(200, "OK", headers, data)

    async def _api_sessions(self, request: Request, query: dict[str, list[str]]) -> Response:
        try:
            token = _bearer(request.headers) or _cookie_token(request.headers, self.gs.cookie_name)
        except _Repeated:
            body = frames.error_frame(
                "UNAUTHENTICATED", "send one Authorization header, not several", reason="TOKEN_INVALID"
            )
            return _json_response(http.HTTPStatus.UNAUTHORIZED, body)
        try:
            page = await self.upstream.list_sessions(
                token,
                query=query.get("query", [""])[0],
                page_size=self.gs.list_page_size,
                page_token=query.get("page_token", [""])[0],
            )
        except UpstreamError as exc:
            status = {
                "UNAUTHENTICATED": http.HTTPStatus.UNAUTHORIZED,
                "PERMISSION_DENIED": http.HTTPStatus.FORBIDDEN,
                "INVALID_ARGUMENT": http.HTTPStatus.BAD_REQUEST,
                # A quota, or too many failed authentications from the gateway's address
                # (auth.failures_per_peer_per_minute): the caller should slow down, not a bad gateway.
                "RESOURCE_EXHAUSTED": http.HTTPStatus.TOO_MANY_REQUESTS,
            }.get(exc.code, http.HTTPStatus.BAD_GATEWAY)
            return _json_response(status, frames.error_frame(exc.code, exc.message, reason=exc.reason))
        return _json_response(
            http.HTTPStatus.OK,
            {
                "sessions": [frames.to_json(s) for s in page.sessions],
                "next_page_token": page.next_page_token,
                "total_size": page.total_size,
            },
        )

    # ---- WebSocket ----------------------------------------------------------------------------------

    async def _before_handshake(
        self, connection: ServerConnection, request: Request, session_id: str, query: dict[str, list[str]]
    ) -> None:
        """For a socket that offers no token (no cookie, no ``api_token``): ask the service whether it
        lets anonymous callers in, before the handshake, and keep the answer for ``_authenticate``.
        Refused, the socket's first message can only be its auth frame, so it is held to
        ``gateway.auth_frame_bytes`` rather than ``max_frame_bytes`` (decided here, before the client
        can send a byte of it)."""
        if "api_token" in query or _cookie_token(request.headers, self.gs.cookie_name):
            return
        try:
            self._anonymous[connection] = await self.upstream.get_session("", session_id)
        except UpstreamError as exc:
            self._anonymous[connection] = exc
            if exc.denied:
                _cap_first_message(connection.protocol, self.gs.auth_frame_bytes)

    async def _handle(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        url = urlsplit(ws.request.path)
        match = _WS_PATH.match(url.path)
        assert match is not None
        query = parse_qs(url.query)
        sock = _Socket(ws=ws, session_id=match.group(1), token="")
        hub: SessionHub | None = None
        sender: asyncio.Task[None] | None = None
        try:
            last_id = self._last_event_id(query)
            try:
                session = await self._authenticate(sock, query)
            except _Closed as closed:
                # Deleted while the client was away: it still gets what it missed, up to the
                # deletion, as StreamEvents gives it, then the close a deletion always brings.
                if closed.code == CLOSE_NOT_FOUND and last_id > 0 and await self._replay_deletion(sock, last_id):
                    raise _Closed(CLOSE_NOT_FOUND, "the session was deleted") from None
                raise
            sock.sub = Subscriber(
                self.gs.send_queue_frames,
                lambda code, reason: self._close_later(ws, code, reason),
                write_now=lambda data: _write_now(ws, data),
                max_bytes=self.gs.send_queue_bytes,
            )
            hub, arrived = await self.hubs.acquire(sock.token, sock.session_id, last_id)
            if hub.failed is not None:  # refused or deleted while it started: nothing will come
                raise _close_for(hub.failed)
            # The hub has read the session up to its newest event: an id past it was never given on
            # this session (a guess, an id from the future); events after the hub's newest are new to
            # this socket, or it would wait, deaf, for ids above its guess.
            last_id = min(last_id, hub.last_id)
            replay = hub.attach(sock.sub, last_id if last_id > 0 else arrived)
            if last_id <= 0:
                # Live only: the events since the socket arrived (e.g. the turn its page started
                # right after the handshake, while the hub was starting) are live, not lost.
                sock.sub.backfill(replay or [])
                replay = []
                # Read after attaching, so session_sync and the events after it leave no gap (an
                # event may show in both).
                session = await self._get_session(sock)
            await ws.send(frames.dumps({"type": "session_sync", "session": frames.to_json(session)}))
            after = 0
            if last_id > 0:
                if replay is None:
                    replay = await self._replay_from_service(sock, last_id)
                await ws.send(frames.dumps({"type": "replay_start", "count": len(replay)}))
                for _, data in replay:
                    await ws.send(data, text=True)
                await ws.send(frames.dumps({"type": "replay_end"}))
                after = max([last_id, *(i for i, _ in replay)])
            sock.sub.go_live(after)
            sender = asyncio.create_task(self._send_loop(sock))
            await self._read_loop(sock)
        except _Closed as closed:
            await ws.close(closed.code, closed.reason)
        except ConnectionClosed:
            pass
        finally:
            if sock.sub is not None:
                sock.sub.closed = True
                sock.sub.queue.put_nowait(None)
                if hub is not None:
                    hub.detach(sock.sub)
            if hub is not None:
                self.hubs.release(hub)
            if sender is not None:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sender

    def _last_event_id(self, query: dict[str, list[str]]) -> int:
        raw = query.get("last_event_id", ["0"])[0] or "0"
        # ASCII digits only, and few enough for int(): str.isdigit() also passes "²" (which int()
        # refuses) and "٣" (which it reads as 3). Event ids are 64-bit: 20 digits hold any.
        if not _EVENT_ID.fullmatch(raw):
            raise _Closed(1008, "last_event_id must be a non-negative integer")
        return int(raw)

    async def _authenticate(self, sock: _Socket, query: dict[str, list[str]]) -> resources_pb2.Session:
        """Find the caller's token (cookie, query if enabled, else an auth frame) and check the session."""
        ws = sock.ws
        assert ws.request is not None
        token = _cookie_token(ws.request.headers, self.gs.cookie_name)
        if "api_token" in query:
            if not self.gs.allow_query_token:
                raise _Closed(CLOSE_DENIED, "api_token in the URL is disabled; send an auth frame")
            token = query["api_token"][0]
        if token:
            sock.token = token
            return await self._get_session(sock)
        try:
            # No token offered: maybe the service lets anonymous callers in (auth disabled). Asked
            # before the handshake (``_before_handshake``); again if that answer is not there.
            asked = self._anonymous.pop(ws, None)
            if isinstance(asked, UpstreamError):
                raise asked
            return asked if asked is not None else await self.upstream.get_session("", sock.session_id)
        except UpstreamError as exc:
            if not exc.denied:
                raise _close_for(exc, self._unreachable) from None
        await ws.send(frames.dumps({"type": "auth_required", "timeout_seconds": self.gs.auth_timeout_seconds}))
        try:
            raw = await asyncio.wait_for(ws.recv(), self.gs.auth_timeout_seconds)
        except TimeoutError:
            raise _Closed(CLOSE_DENIED, "no auth frame in time") from None
        try:
            frame = frames.parse(raw)
        except frames.FrameError:
            raise _Closed(CLOSE_DENIED, "the first frame must be an auth frame") from None
        offered = frame.get("api_token")
        if frame["type"] != "auth" or not isinstance(offered, str) or not offered:
            raise _Closed(CLOSE_DENIED, "the first frame must be an auth frame with an api_token")
        sock.token = offered
        sock.auth_frame = True
        session = await self._get_session(sock)
        await ws.send(frames.dumps({"type": "auth_ok"}))
        return session

    async def _get_session(self, sock: _Socket) -> resources_pb2.Session:
        try:
            return await self.upstream.get_session(sock.token, sock.session_id)
        except UpstreamError as exc:
            raise _close_for(exc, self._unreachable) from None

    async def _replay_deletion(self, sock: _Socket, last_id: int) -> bool:
        """A session the service no longer has, resumed after ``last_id``: when it was deleted after
        that event and the service still retains the deletion, send ``replay_start``, the events the
        client missed ending with ``session_deleted``, and ``replay_end`` (no ``session_sync``: there is
        no session to sync). False, with nothing sent, when the service has nothing to replay (never
        existed, deleted before ``last_id``, not the caller's, or let go): the usual 4004."""
        out: list[bytes] = []
        held = 0
        stream = self.upstream.events(sock.token, sock.session_id, last_id)
        deleted = False
        try:
            # Bounded by time and bytes: the service replays its retained log and ends the stream
            # at the deletion; held whole first, since replay_start names the count.
            async with asyncio.timeout(self.gs.upstream_timeout_seconds):
                while not deleted and held <= self.gs.send_queue_bytes:
                    event = await anext(stream, None)
                    if event is None:
                        break
                    out.append(frames.dumps(frames.event_frame(event)).encode())
                    held += len(out[-1])
                    deleted = event.WhichOneof("payload") == "session_deleted"
        except (UpstreamError, TimeoutError):
            return False
        finally:
            await stream.aclose()
        if not deleted:
            return False
        if sock.auth_frame:  # the service took the token (it let the stream open)
            await sock.ws.send(frames.dumps({"type": "auth_ok"}))
        await sock.ws.send(frames.dumps({"type": "replay_start", "count": len(out)}))
        for data in out:
            await sock.ws.send(data, text=True)
        await sock.ws.send(frames.dumps({"type": "replay_end"}))
        return True

    async def _replay_from_service(self, sock: _Socket, last_id: int) -> list[Item]:
        """The hub's ring does not reach back to ``last_id``: read the service's retained log until it
        joins what the hub delivered since this socket attached (or goes quiet)."""
        assert sock.sub is not None
        out: list[Item] = []
        stream = self.upstream.events(sock.token, sock.session_id, last_id)
        try:
            while True:
                try:
                    event = await asyncio.wait_for(anext(stream), self.gs.replay_settle_seconds)
                except (TimeoutError, StopAsyncIteration):
                    break
                pending = sock.sub.pending
                if pending and event.event_id >= pending[0][0]:
                    break
                out.append((event.event_id, frames.dumps(frames.event_frame(event)).encode()))
        except UpstreamError as exc:
            raise _close_for(exc, self._unreachable) from None
        finally:
            await stream.aclose()
        return out

    def _close_later(self, ws: ServerConnection, code: int, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(ws.close(code, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_loop(self, sock: _Socket) -> None:
        assert sock.sub is not None
        while True:
            item = await sock.sub.next()
            if item is None:
                return
            try:
                await sock.ws.send(item[1], text=True)
            except ConnectionClosed:
                return

    def _reply(self, sock: _Socket, frame: dict[str, Any]) -> None:
        assert sock.sub is not None
        sock.sub.offer((0, frames.dumps(frame).encode()))

    async def _read_loop(self, sock: _Socket) -> None:
        tasks: set[asyncio.Task[None]] = set()
        # Frames served at once: past it the loop stops reading, and the client's further frames
        # wait in its socket (TCP flow control), not as tasks each holding a call and its answer.
        in_flight = asyncio.Semaphore(self.gs.frames_in_flight)

        def done(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            in_flight.release()

        try:
            async for raw in sock.ws:
                if sock.sub is not None and sock.sub.closed:
                    return
                try:
                    frame = frames.parse(raw)
                except frames.FrameError as exc:
                    self._reply(sock, frames.error_frame(exc.code, exc.message, frame_id=exc.frame_id))
                    continue
                if frame["type"] == "ping":
                    self._reply(sock, {"type": "pong", **({"id": frame["id"]} if "id" in frame else {})})
                    continue
                await in_flight.acquire()
                task = asyncio.create_task(self._serve_frame(sock, frame))
                tasks.add(task)
                task.add_done_callback(done)
        finally:
            for task in list(tasks):
                task.cancel()

    async def _serve_frame(self, sock: _Socket, frame: dict[str, Any]) -> None:
        frame_id = frame.get("id")
        try:
            reply = await self._dispatch(sock, frame)
            if reply is not None:
                if frame_id is not None:
                    reply["id"] = frame_id
                self._reply(sock, reply)
        except frames.FrameError as exc:
            self._reply(sock, frames.error_frame(exc.code, exc.message, frame_id=frame_id))
        except UpstreamError as exc:
            if exc.denied:
                self._close_later(sock.ws, CLOSE_DENIED, "access denied")
                return
            self._reply(sock, frames.error_frame(exc.code, exc.message, frame_id=frame_id, reason=exc.reason))
        except ConnectionClosed:
            pass
        except Exception:  # a defect of ours: the frame still gets its answer, the socket stays open
            log.exception("gateway: %s frame failed", frame.get("type"))
            self._reply(sock, frames.error_frame("INTERNAL", "the gateway failed on this frame", frame_id=frame_id))

    async def _dispatch(self, sock: _Socket, frame: dict[str, Any]) -> dict[str, Any] | None:
        kind = frame["type"]
        sid = sock.session_id
        if kind == "message":
            msg = frames.parse_message(
                frame,
                max_images=self.gs.max_images,
                max_image_bytes=self.gs.max_image_bytes,
                max_files=self.gs.max_files,
            )
            response = await self.upstream.append(
                sock.token,
                pb.AppendMessagesRequest(
                    session_id=sid,
                    messages=[
                        resources_pb2.Message(
                            role=resources_pb2.ROLE_USER,
                            content=msg.content,
                            images=[resources_pb2.Image(data=d) for d in msg.images],
                        )
                    ],
                    request_id=msg.request_id,
                    turn_complete=msg.turn_complete,
                ),
            )
            return {"type": "message_ack", **frames.to_json(response)}
        if kind == "compact":
            return await self._compact(sock, frame)
        if kind == "auth":
            token = frame.get("api_token")
            if not isinstance(token, str) or not token:
                raise frames.FrameError("INVALID_AUTH", "api_token must be a non-empty string")
            await self.upstream.get_session(token, sid)
            sock.token = token
            return {"type": "auth_ok"}
        if kind == "get_view":
            return await self._view(sock)
        if kind == "get_messages":
            return await self._messages_page(sock, frame)
        if kind == "search":
            query = frame.get("query")
            if not isinstance(query, str) or not query.strip():
                raise frames.FrameError("INVALID_SEARCH", "query must be a non-empty string")
            limit = frame.get("limit", self.gs.search_limit)
            if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 100:
                raise frames.FrameError("INVALID_SEARCH", "limit must be an integer from 1 to 100")
            found = await self.upstream.search_history(sock.token, sid, query=query, limit=limit)
            return {"type": "search_results", "query": query, "chunks": [frames.to_json(c) for c in found.chunks]}
        if kind == "expand":
            seq = frame.get("sequence_number")
            if not isinstance(seq, int) or isinstance(seq, bool) or not 0 < seq < 1 << 63:
                raise frames.FrameError("INVALID_EXPAND", "sequence_number must be a positive 64-bit integer")
            expanded = await self.upstream.expand_summary(sock.token, sid, seq)
            return {
                "type": "expanded",
                "sequence_number": seq,
                "messages": [frames.to_json(m) for m in expanded.messages],
            }
        raise frames.FrameError("UNKNOWN_TYPE", f"unknown frame type {kind!r}")

    async def _compact(self, sock: _Socket, frame: dict[str, Any]) -> dict[str, Any]:
        dry_run = frame.get("dry_run", False)
        reason = frame.get("reason", "")
        if not isinstance(dry_run, bool) or not isinstance(reason, str):
            raise frames.FrameError("INVALID_COMPACT", "dry_run must be a boolean and reason a string")
        sid = sock.session_id
        if dry_run:
            preview = await self.upstream.compress(sock.token, sid, dry_run=True, reason=reason)
            # compact_result's fields (compressed false): the plan, the method the run would commit
            # first, and a clearing's counts.
            return {"type": "compact_preview", **frames.to_json(preview)}
        if sid in self.hubs.compacting:
            raise frames.FrameError("COMPACTION_IN_PROGRESS", "a compaction of this session is already running")
        self.hubs.compacting.add(sid)
        try:
            result = await self.upstream.compress(sock.token, sid, dry_run=False, reason=reason or "websocket compact")
        finally:
            self.hubs.compacting.discard(sid)
        # compressed=false: the service started the compaction and refused to commit it; the
        # compression_refused event (already fanned out) says why.
        return {"type": "compact_result", **frames.to_json(result)}

    async def _messages_page(self, sock: _Socket, frame: dict[str, Any]) -> dict[str, Any]:
        """One page of a buffer: the rows before ``page_token`` (from a ``view`` or a previous page)."""
        buffer = frame.get("buffer")
        token = frame.get("page_token", "")
        size = frame.get("page_size", self.gs.view_messages)
        if buffer not in _BUFFERS:
            raise frames.FrameError("INVALID_GET_MESSAGES", 'buffer must be "display" or "context"')
        if not isinstance(token, str):
            raise frames.FrameError("INVALID_GET_MESSAGES", "page_token must be a string")
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= self.gs.view_messages:
            raise frames.FrameError(
                "INVALID_GET_MESSAGES", f"page_size must be an integer from 1 to {self.gs.view_messages}"
            )
        page = await self.upstream.list_messages(
            sock.token, sock.session_id, buffer=_BUFFERS[buffer], page_size=size, page_token=token
        )
        return {
            "type": "messages_page",
            "buffer": buffer,
            "page_token": token,
            "messages": [frames.to_json(m) for m in page.messages],
            "next_page_token": page.next_page_token,
        }

    async def _view(self, sock: _Socket) -> dict[str, Any]:
        sid, token, n = sock.session_id, sock.token, self.gs.view_messages
        session, display, context, view = await asyncio.gather(
            self.upstream.get_session(token, sid),
            self.upstream.list_messages(token, sid, buffer=pb.BUFFER_DISPLAY, page_size=n),
            self.upstream.list_messages(token, sid, buffer=pb.BUFFER_CONTEXT, page_size=n),
            self.upstream.build_context(token, sid),
        )
        profile = self.settings.profile(session.profile_id)
        compression = profile.compression if profile is not None else None
        return {
            "type": "view",
            "session": frames.to_json(session),
            "display": [frames.to_json(m) for m in display.messages],
            "display_more": bool(display.next_page_token),
            "display_page_token": display.next_page_token,
            "context": [frames.to_json(m) for m in context.messages],
            # The context buffer pages by token only (its order is not sequence order).
            "context_more": bool(context.next_page_token),
            "context_page_token": context.next_page_token,
            "view": {
                "view_id": view.view_id,
                "messages": [frames.to_json(m) for m in view.messages],
                "estimate": frames.to_json(view.estimate),
                "notices": list(view.notices),
            },
            "compression": (
                {"enabled": compression.enabled, "threshold": compression.threshold, "target": compression.target}
                if compression is not None
                else None
            ),
        }


class GatewayRefused(OSError):
    """The gateway cannot check, beyond loopback, that the service it would expose wants tokens."""


class GatewayExposed(TransportError):
    """The gateway would expose an open service beyond loopback, or tokens without TLS: refused
    as the server refuses the same settings (``transport.check_transport``, exit 2)."""


async def check_exposure(upstream: Upstream, settings: Settings, listen: str, *, tls: bool) -> None:
    """The loopback rule for the gateway, as for the service (``transport.check_transport``): beyond
    loopback it forwards whatever the service grants an anonymous caller, so it starts there only
    when the service wants tokens, and then only over TLS, since browsers send those tokens to it
    (or with --insecure, e.g. behind a TLS proxy)."""
    if settings.insecure or is_loopback(listen_host(listen)):
        return
    try:
        await upstream.list_sessions("", query="", page_size=1, page_token="")
    except UpstreamError as exc:
        if exc.code == "UNAUTHENTICATED":
            if not tls:
                raise GatewayExposed(
                    f"refusing to serve the gateway on {listen} without TLS: API tokens would cross the network "
                    "in clear; give it --tls-cert and --tls-key, or pass --insecure to allow it (e.g. behind a "
                    "TLS proxy)"
                ) from None
            return
        raise GatewayRefused(
            f"refusing to serve the gateway on {listen}: cannot check that the service at {upstream.target} "
            f"requires tokens ({exc.code}); start the service first, or pass --insecure"
        ) from None
    raise GatewayExposed(
        f"refusing to serve the gateway on {listen}: the service at {upstream.target} lets anonymous callers "
        "in, and beyond loopback the gateway would hand that to the network; turn tokens on (--auth tokens) "
        "or pass --insecure"
    )


async def start_gateway(settings: Settings, listen: str, target: str, *, bundled: bool = False) -> Gateway:
    """Start a gateway calling ``target``. ``bundled``: in the process of the server at ``target``,
    whose TLS settings it follows (gateway/tls.py)."""
    if bundled:
        upstream_tls = bundled_upstream_tls(settings, target.rpartition(":")[0])
    else:
        upstream_tls = standalone_upstream_tls(settings)
    gateway = Gateway(settings, target, upstream_tls=upstream_tls, tls=listener_tls(settings, bundled=bundled))
    try:
        await check_exposure(gateway.upstream, settings, listen, tls=gateway.tls is not None)
        try:
            await gateway.start(listen)
        except OSError as exc:
            # One line naming the setting, as the server's own port in use: not the event loop's
            # "error while attempting to bind on address (...)" with its errno.
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise OSError(f"cannot listen on {listen} (gateway): {reason}") from None
    except BaseException:
        await gateway.close()
        raise
    return gateway


def announce(listen: str, port: int, scheme: str = "http") -> None:
    host = listen.rpartition(":")[0]
    # Tests and scripts read this line to learn the port when listening on port 0.
    print(f"contextsvc gateway listening on {scheme}://{host}:{port}/", flush=True)


_DATA_OPCODES = frozenset((Opcode.TEXT, Opcode.BINARY, Opcode.CONT))


def _cap_first_message(protocol: Protocol, cap: int) -> None:
    """Refuse (1009) a first message over ``cap`` bytes on ``protocol``; every later one gets the
    configured limit again. Restored when the parser has the first message whole, before it reads the
    next frame's header (it reads the limit frame by frame), so frames pipelined right after the auth
    frame are held to the full limit, not to this one."""
    full = protocol.max_message_size
    if full is not None and full <= cap:
        return
    protocol.max_message_size = cap
    receive = protocol.recv_frame

    def recv_frame(frame: Frame) -> None:
        receive(frame)
        if frame.opcode in _DATA_OPCODES and frame.fin:
            protocol.max_message_size = full
            del protocol.recv_frame  # the class's own method again

    protocol.recv_frame = recv_frame  # type: ignore[method-assign]
