"""Every status the API maps, at the servicer level: in process, no sockets, fast.

The servicer runs behind the real edge (decode guard, serving gate, quotas) under grpcio-testing
with a real engine on a memory store. Each google.rpc detail is checked as a client decodes it:
ErrorInfo (reason, domain, metadata), BadRequest field violations, QuotaFailure, RetryInfo.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from contextsvc import errors
from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from contextsvc.api.decoding import Undecodable
from contextsvc.api.errors import DOMAIN
from contextsvc.api.gate import ServingGate, ServingState
from contextsvc.api.quotas import Quotas
from contextsvc.api.servicer import ContextServicer
from contextsvc.config import Limits, QuotaSettings, Settings, TokenSettings
from contextsvc.core.session import Principal
from contextsvc.engine.engine import Engine
from contextsvc.stores.memory import MemoryStore
from tests.support.engines import make_engine
from tests.support.servicer_harness import EventLoopThread, Outcome, ServicerHarness

MISSING = "00000000-0000-4000-8000-000000000000"


class World:
    """A servicer on a fresh engine, behind a gate and quotas, under grpcio-testing."""

    def __init__(
        self,
        loop: EventLoopThread,
        quotas: QuotaSettings | None = None,
        tokens: TokenSettings | None = None,
        limits: Limits | None = None,
    ):
        self.loop = loop
        settings = Settings(
            quotas=quotas or QuotaSettings(), tokens=tokens or TokenSettings(), limits=limits or Limits()
        )

        async def build() -> tuple[Engine, asyncio.Event]:
            store = MemoryStore(settings)
            await store.open()
            engine = make_engine(store, settings)
            return engine, asyncio.Event()

        self.engine, self.stopping = loop.run(build())
        self.gate = ServingGate(ServingState.SERVING)

        async def owned(caller: Principal) -> int:
            owner = Principal(user_id=caller.user_id)
            return (await self.engine.sessions.list(owner, page_size=1, page_token="", profile_id="", query="")).total

        self.quotas = Quotas(settings.quotas, count_sessions=owned)
        servicer = ContextServicer(self.engine, stopping=self.stopping)
        self.harness = ServicerHarness(servicer, loop, admissions=[self.gate, self.quotas])

    def call(self, name: str, request: Any) -> Outcome:
        return self.harness.unary(name, request)

    def session(self, *messages: r.Message) -> str:
        out = self.call("CreateSession", pb.CreateSessionRequest(name="s"))
        assert out.code == grpc.StatusCode.OK, out
        sid: str = out.response.id
        if messages:
            assert self.call("AppendMessages", pb.AppendMessagesRequest(session_id=sid, messages=messages)).response
        return sid


@pytest.fixture(scope="module")
def loop() -> Iterator[EventLoopThread]:
    thread = EventLoopThread()
    yield thread
    thread.close()


@pytest.fixture
def world(loop: EventLoopThread) -> World:
    return World(loop)


def _user(text: str, **flags: bool) -> r.Message:
    return r.Message(role=r.ROLE_USER, content=text, flags=r.MessageFlags(is_context=True, is_display=True, **flags))


def _expect(out: Outcome, code: grpc.StatusCode, reason: str) -> Outcome:
    assert (out.code, out.reason) == (code, reason), out
    assert out.domain == DOMAIN
    return out


# -- reasons the engine raises, reached through real requests --------------------------------------


def test_not_found(world: World) -> None:
    out = _expect(
        world.call("GetSession", pb.GetSessionRequest(session_id=MISSING)), grpc.StatusCode.NOT_FOUND, "NOT_FOUND"
    )
    assert out.fields == [] and out.retry_seconds is None


def test_invalid_argument_names_the_field(world: World) -> None:
    out = _expect(
        world.call("GetSession", pb.GetSessionRequest(session_id="not-a-uuid")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
    )
    assert out.fields == ["session_id"]
    sid = world.session()
    bad = pb.AppendMessagesRequest(
        session_id=sid, messages=[r.Message(role=r.ROLE_TOOL, content="x"), r.Message(role=r.ROLE_USER)]
    )
    out = _expect(world.call("AppendMessages", bad), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    assert "messages[0].tool_call_id" in out.fields and "messages[1].flags" not in out.fields


def test_unknown_profile(world: World) -> None:
    sid = world.session(_user("hi"))
    out = world.call(
        "BuildContext", pb.BuildContextRequest(session_id=sid, profile=r.Profile(profile_id="no-such-profile"))
    )
    assert _expect(out, grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_PROFILE").fields == ["profile.profile_id"]


def test_request_id_reused(world: World) -> None:
    sid = world.session()
    first = pb.AppendMessagesRequest(session_id=sid, messages=[_user("a")], request_id="r")
    assert world.call("AppendMessages", first).code == grpc.StatusCode.OK
    assert list(world.call("AppendMessages", first).response.sequence_numbers) == [1]
    other = pb.AppendMessagesRequest(session_id=sid, messages=[_user("b")], request_id="r")
    out = _expect(world.call("AppendMessages", other), grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_REUSED")
    assert out.fields == ["request_id"] and out.metadata == {"request_id": "r"}


def test_nothing_to_compact(world: World) -> None:
    sid = world.session(_user("only one"))
    _expect(
        world.call("Compress", pb.CompressRequest(session_id=sid)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "NOTHING_TO_COMPACT",
    )


def test_context_too_large_carries_the_numbers(world: World) -> None:
    sid = world.session(_user("hi"))
    profile = r.Profile(context_window=1024, system_prompt="word " * 4000)
    out = world.call("BuildContext", pb.BuildContextRequest(session_id=sid, profile=profile))
    _expect(out, grpc.StatusCode.FAILED_PRECONDITION, "CONTEXT_TOO_LARGE")
    assert out.metadata and all(v.strip() for v in out.metadata.values())


def test_pinned_cap_exceeded(world: World) -> None:
    sid = world.session()
    pinned = pb.AppendMessagesRequest(session_id=sid, messages=[_user("fact " * 20000, is_pinned=True)])
    out = _expect(world.call("AppendMessages", pinned), grpc.StatusCode.FAILED_PRECONDITION, "PINNED_CAP_EXCEEDED")
    assert set(out.metadata) == {"pinned_tokens", "cap"}


def test_view_and_message_not_found(world: World) -> None:
    sid = world.session(_user("hi"))
    _expect(
        world.call("RecordBaseline", pb.RecordBaselineRequest(session_id=sid, view_id="v-none", prompt_tokens=10)),
        grpc.StatusCode.NOT_FOUND,
        "VIEW_NOT_FOUND",
    )
    _expect(
        world.call("ExpandSummary", pb.ExpandSummaryRequest(session_id=sid, sequence_number=99)),
        grpc.StatusCode.NOT_FOUND,
        "MESSAGE_NOT_FOUND",
    )


def test_a_summary_standing_for_more_than_one_response_carries_says_so(loop: EventLoopThread) -> None:
    """72 MB of history behind one summary: ExpandSummary failed in the transport with a bare
    RESOURCE_EXHAUSTED ("Sent message larger than max"), no reason, no way on."""
    world = World(loop, limits=Limits(grpc_max_send_bytes=1024 * 1024))
    rows = [_user(f"ask {k} " + "x" * 20_000) for k in range(80)]  # ~1.6 MB
    sid = world.session(*rows)
    done = world.call("Compress", pb.CompressRequest(session_id=sid, profile=r.Profile(context_window=1_000_000)))
    assert done.code == grpc.StatusCode.OK, done
    context = world.call("ListMessages", pb.ListMessagesRequest(session_id=sid, buffer=pb.BUFFER_CONTEXT))
    (summary,) = [m for m in context.response.messages if m.flags.is_summary]
    out = _expect(
        world.call("ExpandSummary", pb.ExpandSummaryRequest(session_id=sid, sequence_number=summary.sequence_number)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "SUMMARY_TOO_LARGE",
    )
    assert out.metadata["first_sequence"] == "1" and int(out.metadata["bytes"]) > 1024 * 1024
    assert "ListMessages" in out.message


# -- the edge: decode guard, serving gate, drain ----------------------------------------------------


def test_undecodable_request(world: World) -> None:
    out = world.call("AppendMessages", Undecodable("bad_utf8", "contextsvc.v1.AppendMessagesRequest", 12))
    _expect(out, grpc.StatusCode.INVALID_ARGUMENT, "UNDECODABLE_REQUEST")
    assert out.fields == ["request"] and out.metadata["cause"] == "bad_utf8"
    assert out.metadata["method"] == "/contextsvc.v1.ContextService/AppendMessages"


def test_gate_refuses_before_ready_and_while_draining(world: World) -> None:
    world.gate.state = ServingState.STARTING
    out = _expect(world.call("ListSessions", pb.ListSessionsRequest()), grpc.StatusCode.UNAVAILABLE, "STORE_NOT_READY")
    assert out.retry_seconds == 1.0
    world.gate.state = ServingState.DRAINING
    out = _expect(world.call("ListSessions", pb.ListSessionsRequest()), grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
    assert out.retry_seconds == 1.0
    assert world.gate.in_flight == 0


def test_stream_ends_with_where_to_resume_when_draining(world: World) -> None:
    sid = world.session(_user("hi"))
    world.loop.run(_set(world.stopping))
    # Resuming from event 1: the retained append event is delivered, then the stream ends naming it.
    events, out = world.harness.stream("StreamEvents", pb.StreamEventsRequest(session_id=sid, after_event_id=1))
    assert [e.WhichOneof("payload") for e in events] == ["messages_appended"]
    _expect(out, grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
    assert out.metadata == {"after_event_id": str(events[0].event_id)} and out.retry_seconds == 1.0


async def _set(event: asyncio.Event) -> None:
    event.set()


# -- every domain error class, as the engine might raise it ----------------------------------------

DOMAIN_ERRORS: list[tuple[errors.ContextError, grpc.StatusCode]] = [
    (errors.NotFound("gone"), grpc.StatusCode.NOT_FOUND),
    (errors.InvalidArgument.field("x", "bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.RequestIdReused("r"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.EventIdAhead(9, 7), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.FailedPrecondition("no"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.NothingToCompact("none"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ContextTooLarge("big", metadata={"estimate": "9", "budget": "8"}), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.SessionDamaged("read-only until repaired"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.EventsExpired(after_event_id=5, lost_event_id=6, oldest_event_id=9), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Conflict("raced", reason="COMPACTION_CONFLICT"), grpc.StatusCode.ABORTED),
    (errors.Unavailable("store down"), grpc.StatusCode.UNAVAILABLE),
    (
        errors.ResourceExhausted("slow down", limit="x", subject="user:u", retry_after_seconds=2.5),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ),
    (errors.Unimplemented("later"), grpc.StatusCode.UNIMPLEMENTED),
    (errors.Unauthenticated("who?"), grpc.StatusCode.UNAUTHENTICATED),
    (errors.Internal("store encoding error", reason="STORE_ERROR"), grpc.StatusCode.INTERNAL),
]


def test_every_error_class_is_mapped() -> None:
    classes = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.ContextError)}
    assert classes - {type(e) for e, _ in DOMAIN_ERRORS} == {errors.ContextError}


@pytest.mark.parametrize(
    ("error", "code"), DOMAIN_ERRORS, ids=lambda v: type(v).__name__ if isinstance(v, Exception) else ""
)
def test_domain_error_to_status(
    world: World, monkeypatch: pytest.MonkeyPatch, error: errors.ContextError, code: grpc.StatusCode
) -> None:
    async def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(world.engine.sessions, "get", fail)
    out = _expect(world.call("GetSession", pb.GetSessionRequest(session_id=MISSING)), code, error.reason)
    assert out.message == error.message
    assert out.metadata == error.metadata
    if isinstance(error, errors.InvalidArgument):
        assert out.fields == [v.field for v in error.violations]
    if isinstance(error, errors.Unavailable):
        assert out.retry_seconds == 1.0
    if isinstance(error, errors.ResourceExhausted):
        assert out.quota == [("user:u", "slow down")] and out.retry_seconds == 2.5
    if not isinstance(error, errors.Unavailable | errors.ResourceExhausted):
        assert out.retry_seconds is None


def test_a_tokenizer_file_gone_since_the_start_is_failed_precondition(
    loop: EventLoopThread, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The operator's file, not the call, is at fault: not INTERNAL, the path not shown, logged once.
    gone = tmp_path / "gone.json"
    world = World(loop, tokens=TokenSettings(tokenizer_files={"gpt-4o": str(gone)}))
    request = pb.EstimateTokensRequest(model="gpt-4o", messages=[_user("hello")])
    for _ in range(2):
        out = _expect(
            world.call("EstimateTokens", request), grpc.StatusCode.FAILED_PRECONDITION, "TOKENIZER_UNAVAILABLE"
        )
        assert out.metadata["model"] == "gpt-4o" and str(gone) not in out.message
    assert [r.getMessage() for r in caplog.records].count("tokenizer file does not load") == 1
    assert world.call("EstimateTokens", pb.EstimateTokensRequest(model="other", messages=[_user("hi")])).code == (
        grpc.StatusCode.OK
    )


def test_an_unexpected_exception_is_internal_without_details(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    async def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(world.engine.sessions, "get", crash)
    out = world.call("GetSession", pb.GetSessionRequest(session_id=MISSING))
    assert out.code == grpc.StatusCode.INTERNAL and "secret" not in out.message and out.reason == ""


# -- quotas ------------------------------------------------------------------------------------------


def _quota(out: Outcome, limit: str) -> Outcome:
    _expect(out, grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED")
    assert out.metadata["limit"] == limit
    assert [s for s, _ in out.quota] == ["user:anonymous"] and out.quota[0][1].startswith(limit)
    assert out.retry_seconds is not None and out.retry_seconds > 0
    return out


def test_calls_per_second(loop: EventLoopThread) -> None:
    world = World(loop, QuotaSettings(calls_per_second=0.5, calls_burst=3))
    codes = [world.call("ListSessions", pb.ListSessionsRequest()).code for _ in range(3)]
    assert codes == [grpc.StatusCode.OK] * 3
    out = _quota(world.call("ListSessions", pb.ListSessionsRequest()), "calls_per_second")
    assert 1.0 < out.retry_seconds <= 2.0  # type: ignore[operator]


def test_append_bytes_per_minute(loop: EventLoopThread) -> None:
    world = World(loop, QuotaSettings(append_bytes_per_minute=3000))
    sid = world.session()
    body = pb.AppendMessagesRequest(session_id=sid, messages=[_user("x" * 1000)])
    assert [world.call("AppendMessages", body).code for _ in range(2)] == [grpc.StatusCode.OK] * 2
    out = _quota(world.call("AppendMessages", body), "append_bytes_per_minute")
    assert out.retry_seconds < 30  # type: ignore[operator]
    listed = world.call("ListMessages", pb.ListMessagesRequest(session_id=sid))
    assert len(listed.response.messages) == 2  # nothing appended by the refused call


def test_sessions_per_user(loop: EventLoopThread) -> None:
    world = World(loop, QuotaSettings(sessions_per_user=2))
    first = world.session()
    world.session()
    _quota(world.call("CreateSession", pb.CreateSessionRequest()), "sessions_per_user")
    _quota(world.call("ForkSession", pb.ForkSessionRequest(session_id=first)), "sessions_per_user")
    assert world.call("DeleteSession", pb.DeleteSessionRequest(session_id=first)).code == grpc.StatusCode.OK
    assert world.call("CreateSession", pb.CreateSessionRequest()).code == grpc.StatusCode.OK


def test_streams_per_user(loop: EventLoopThread) -> None:
    world = World(loop, QuotaSettings(streams_per_user=1))
    method = "/contextsvc.v1.ContextService/StreamEvents"

    async def admit() -> Any:
        return await world.quotas(method, pb.StreamEventsRequest(), _FakeContext())

    release = loop.run(admit())
    assert release is not None
    with pytest.raises(errors.ResourceExhausted) as caught:
        loop.run(admit())
    assert caught.value.limit == "streams_per_user"
    release()
    assert loop.run(admit()) is not None


class _FakeContext:
    def invocation_metadata(self) -> tuple[()]:
        return ()


def test_unknown_session_still_not_found_under_quotas(loop: EventLoopThread) -> None:
    world = World(loop, QuotaSettings(calls_per_second=100, sessions_per_user=5, append_bytes_per_minute=10**6))
    _expect(
        world.call("GetSession", pb.GetSessionRequest(session_id=str(uuid.uuid4()))),
        grpc.StatusCode.NOT_FOUND,
        "NOT_FOUND",
    )
