"""Run the gRPC servicer in process under grpcio-testing, with the real edge (decode guard,
admissions) and a real engine on a memory store: status mappings tested without sockets.

grpcio-testing drives synchronous servicers; ours is asyncio. The bridge runs each call's
coroutine on an event loop in a background thread and gives it an asyncio-style context whose
``abort_with_status`` records code, details and trailing metadata (the ``google.rpc.Status``
details travel there) on the grpcio-testing context, so ``termination()`` returns them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import grpc_testing
from google.rpc import error_details_pb2, status_pb2

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc.api.decoding import Admission, DecodeGuard

SERVICE = pb.DESCRIPTOR.services_by_name["ContextService"]
T = TypeVar("T")


class _Aborted(Exception):
    """The call ended with a status set on the context."""


class AioContextBridge:
    """What our handlers use of ``grpc.aio.ServicerContext``, over a grpcio-testing context."""

    def __init__(self, context: Any):
        self._context = context

    async def abort_with_status(self, status: grpc.Status) -> None:
        await self.abort(status.code, status.details, status.trailing_metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self._context.set_trailing_metadata(tuple(trailing_metadata or ()))
        self._context.set_code(code)
        self._context.set_details(details)
        raise _Aborted

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()

    def peer(self) -> str:
        return "in-process"


class EventLoopThread:
    """An event loop running in a daemon thread; ``run`` executes a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class Outcome:
    """How one call ended, with the AIP-193 details unpacked."""

    def __init__(self, response: Any, trailing: Any, code: grpc.StatusCode, details: str):
        self.response = response
        self.code = code
        self.message = details
        self.reason = ""
        self.domain = ""
        self.metadata: dict[str, str] = {}
        self.fields: list[str] = []
        self.quota: list[tuple[str, str]] = []
        self.retry_seconds: float | None = None
        for key, value in trailing or ():
            if key != "grpc-status-details-bin":
                continue
            status = status_pb2.Status.FromString(value)
            assert status.code == code.value[0] and status.message == details
            for any_detail in status.details:
                if any_detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    any_detail.Unpack(info)
                    self.reason, self.domain, self.metadata = info.reason, info.domain, dict(info.metadata)
                elif any_detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    bad = error_details_pb2.BadRequest()
                    any_detail.Unpack(bad)
                    self.fields = [v.field for v in bad.field_violations]
                elif any_detail.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
                    quota = error_details_pb2.QuotaFailure()
                    any_detail.Unpack(quota)
                    self.quota = [(v.subject, v.description) for v in quota.violations]
                elif any_detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    retry = error_details_pb2.RetryInfo()
                    any_detail.Unpack(retry)
                    self.retry_seconds = retry.retry_delay.ToNanoseconds() / 1e9

    def __repr__(self) -> str:
        return f"Outcome({self.code}, {self.reason!r}, {self.message!r})"


class ServicerHarness:
    """``servicer`` (a ContextServicer) behind the edge, served by grpcio-testing."""

    def __init__(self, servicer: Any, loop: EventLoopThread, admissions: Sequence[Admission] = ()):
        self._loop = loop
        guard = DecodeGuard(log_per_minute=10, admissions=admissions)
        methods: dict[str, Callable[..., Any]] = {}
        for method in SERVICE.methods:
            path = f"/{SERVICE.full_name}/{method.name}"
            behaviour = getattr(servicer, method.name)
            if method.server_streaming:
                handler = guard.wrap(grpc.unary_stream_rpc_method_handler(behaviour), path)
                methods[method.name] = self._streaming(handler.unary_stream)
            else:
                handler = guard.wrap(grpc.unary_unary_rpc_method_handler(behaviour), path)
                methods[method.name] = self._unary(handler.unary_unary)
        sync_servicer = type("SyncServicer", (), {k: staticmethod(v) for k, v in methods.items()})()
        self.server = grpc_testing.server_from_dictionary({SERVICE: sync_servicer}, grpc_testing.strict_real_time())

    def _unary(self, behaviour: Callable[..., Any]) -> Callable[[Any, Any], Any]:
        def call(request: Any, context: Any) -> Any:
            try:
                return self._loop.run(behaviour(request, AioContextBridge(context)))
            except _Aborted:
                return None

        return call

    def _streaming(self, behaviour: Callable[..., AsyncIterator[Any]]) -> Callable[[Any, Any], Iterator[Any]]:
        def call(request: Any, context: Any) -> Iterator[Any]:
            async def collect() -> list[Any]:
                items = []
                try:
                    async for item in behaviour(request, AioContextBridge(context)):
                        items.append(item)
                except _Aborted:
                    pass
                return items

            yield from self._loop.run(collect())

        return call

    def unary(self, name: str, request: Any, metadata: Sequence[tuple[str, str]] = ()) -> Outcome:
        rpc = self.server.invoke_unary_unary(SERVICE.methods_by_name[name], tuple(metadata), request, None)
        response, trailing, code, details = rpc.termination()
        return Outcome(response, trailing, code, details)

    def stream(self, name: str, request: Any) -> tuple[list[Any], Outcome]:
        rpc = self.server.invoke_unary_stream(SERVICE.methods_by_name[name], (), request, None)
        items = []
        while True:
            try:
                items.append(rpc.take_response())
            except ValueError:  # "No more responses!": the stream is over
                break
        trailing, code, details = rpc.termination()
        return items, Outcome(None, trailing, code, details)
