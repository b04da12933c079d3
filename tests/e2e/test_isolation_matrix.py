"""Tenant isolation (DESIGN §5.7, §5.10): every RPC x {owner, other user, admin, no token, bad
token}, over a real ``contextsvc serve --auth tokens`` process, on every store.

The owner is ``alice``; ``bob`` is another user; ``root`` holds an admin token. The table
``EXPECTED`` is the whole contract: without a valid token every call is ``UNAUTHENTICATED``;
another user's session is ``NOT_FOUND`` on every RPC that names one (and is left untouched);
listings and event streams hold only one's own sessions; an admin reaches everything, and each
such access to another user's session is an audit line. The server's output never contains a
token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
from contextsvc.config import Settings
from contextsvc.core.credentials import issue
from contextsvc.stores.token_access import token_store_at
from tests.support.postgres import create_database, drop_database, postgres_dsn
from tests.support.rpc import assistant, error_details, tool, user
from tests.support.server import ServerProcess

__all__ = ["postgres_dsn"]

pytestmark = pytest.mark.e2e

CALL_S = 30.0
OK = grpc.StatusCode.OK
NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
PROFILE = r.Profile(
    model="iso", context_window=4096, compression=r.CompressionSettings(strategies=["summarize"], keep_recent=1)
)

IDENTITIES = ("owner", "other", "admin", "none", "bad")
#: RPCs that name alice's session; the other user must get NOT_FOUND on each.
SESSION_RPCS = (
    "GetSession",
    "UpdateSession",
    "AppendMessages",
    "ListMessages",
    "BuildContext",
    "EstimateTokens",
    "RecordBaseline",
    "Compress",
    "StreamEvents",
    "SearchHistory",
    "ExpandSummary",
    "ForkSession",
    "DeleteSession",
)
OPEN_RPCS = ("CreateSession", "ListSessions", "ListSessionsQuery", "StreamEventsAll")


def _expected(identity: str, rpc: str) -> grpc.StatusCode:
    if identity in ("none", "bad"):
        return UNAUTH
    if identity == "other" and rpc in SESSION_RPCS:
        return NOT_FOUND
    return OK


EXPECTED = {(i, rpc): _expected(i, rpc) for i in IDENTITIES for rpc in SESSION_RPCS + OPEN_RPCS}


# -- servers on each store -----------------------------------------------------------------------


@dataclass
class Tokens:
    alice: str
    bob: str
    root: str


async def _make_tokens(url: str) -> Tokens:
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    async with token_store_at(url, Settings()) as store:
        made = {}
        for name, admin in (("alice", False), ("bob", False), ("root", True)):
            issued = issue(user=name, is_admin=admin, now=now, expire_time=None)
            await store.add_api_token(issued.record)
            made[name] = issued.secret
    return Tokens(**made)


@pytest.fixture(params=["memory", "files", "postgres"])
def secured(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ServerProcess, Tokens]]:
    """A server requiring tokens on one store kind, and the three users' tokens."""
    env: dict[str, str] = {"CONTEXTSVC_AUTH__CACHE_SECONDS": "0"}
    cleanup: Callable[[], None] = lambda: None  # noqa: E731
    if request.param == "memory":
        token_url = f"files:{tmp_path / 'tokens'}"
        store_url = "memory"
        env["CONTEXTSVC_AUTH__TOKEN_STORE"] = token_url
    elif request.param == "files":
        store_url = token_url = f"files:{tmp_path / 'data'}"
    else:
        admin_dsn = request.getfixturevalue("postgres_dsn")
        store_url = token_url = asyncio.run(create_database(admin_dsn))
        cleanup = lambda: asyncio.run(drop_database(admin_dsn, store_url))  # noqa: E731
    try:
        tokens = asyncio.run(_make_tokens(token_url))
        proc = ServerProcess(store_url, extra_args=["--auth", "tokens"], env=env).start()
        try:
            yield proc, tokens
        finally:
            proc.kill()
    finally:
        cleanup()


# -- the walk ----------------------------------------------------------------------------------


class Caller:
    def __init__(self, stub: ContextServiceStub, token: str | None) -> None:
        self.stub = stub
        self.md = [("authorization", f"Bearer {token}")] if token else []

    def __call__(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, metadata=self.md, timeout=CALL_S)

    def outcome(self, method: str, request: Any) -> tuple[grpc.StatusCode, Any]:
        try:
            return OK, self(method, request)
        except grpc.RpcError as err:
            return err.code(), error_details(err)

    def stream(self, session_id: str = "", after: int = 1, seconds: float = 2.0) -> tuple[grpc.StatusCode, list[Any]]:
        """Every retained event after ``after`` that this caller may see (read until the deadline)."""
        events: list[Any] = []
        call = self.stub.StreamEvents(
            pb.StreamEventsRequest(session_id=session_id, after_event_id=after), metadata=self.md, timeout=seconds
        )
        try:
            events.extend(call)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                return err.code(), events
        return OK, events


def _fill(alice: Caller, sid: str, turns: int) -> None:
    batch: list[r.Message] = []
    for t in range(turns):
        batch += [
            user(f"turn {t}: look at file_{t}.py for the zebra-{t} bug"),
            assistant("", [(f"c{t}", "read_file")]),
            tool(f"c{t}", f"def zebra_{t}():\n    return {t}\n" * 20),
            assistant(f"file_{t}.py defines zebra_{t}"),
        ]
    alice("AppendMessages", pb.AppendMessagesRequest(session_id=sid, messages=batch))


def _requests(sid: str, view_id: str, summary_seq: int, victim: str) -> dict[str, Any]:
    return {
        "GetSession": pb.GetSessionRequest(session_id=sid),
        "UpdateSession": pb.UpdateSessionRequest(
            session=r.Session(id=sid, pinned=True), update_mask={"paths": ["pinned"]}
        ),
        "AppendMessages": pb.AppendMessagesRequest(session_id=sid, messages=[user("one more zebra question")]),
        "ListMessages": pb.ListMessagesRequest(session_id=sid),
        "BuildContext": pb.BuildContextRequest(session_id=sid, profile=PROFILE, auto_compress=False),
        "EstimateTokens": pb.EstimateTokensRequest(session_id=sid, profile=PROFILE),
        "RecordBaseline": pb.RecordBaselineRequest(session_id=sid, view_id=view_id, prompt_tokens=900),
        "Compress": pb.CompressRequest(session_id=sid, profile=PROFILE, dry_run=True),
        "SearchHistory": pb.SearchHistoryRequest(session_id=sid, query="zebra"),
        "ExpandSummary": pb.ExpandSummaryRequest(session_id=sid, sequence_number=summary_seq),
        "ForkSession": pb.ForkSessionRequest(session_id=sid, at_sequence=4),
        "DeleteSession": pb.DeleteSessionRequest(session_id=victim),
        "CreateSession": pb.CreateSessionRequest(name="mine"),
        "ListSessions": pb.ListSessionsRequest(page_size=1000),
        "ListSessionsQuery": pb.ListSessionsRequest(page_size=1000, query="zebra"),
    }


def test_every_rpc_for_every_identity(secured: tuple[ServerProcess, Tokens]) -> None:
    proc, tokens = secured
    with grpc.insecure_channel(proc.address) as channel:
        stub = ContextServiceStub(channel)
        callers = {
            "owner": Caller(stub, tokens.alice),
            "other": Caller(stub, tokens.bob),
            "admin": Caller(stub, tokens.root),
            "none": Caller(stub, None),
            "bad": Caller(stub, "ctx_" + "A" * 43),
        }
        alice, bob = callers["owner"], callers["other"]

        # Alice's session: turns, a compaction (a summary to expand, chunks to search), a view.
        sid = alice("CreateSession", pb.CreateSessionRequest(name="zebra hunt")).id
        _fill(alice, sid, 8)
        done = alice("Compress", pb.CompressRequest(session_id=sid, profile=PROFILE))
        assert done.compressed
        context = alice("ListMessages", pb.ListMessagesRequest(session_id=sid, buffer=pb.BUFFER_CONTEXT))
        summary_seq = next(m.sequence_number for m in context.messages if m.flags.is_summary)
        view_id = alice("BuildContext", pb.BuildContextRequest(session_id=sid, profile=PROFILE)).view_id
        bobs = bob("CreateSession", pb.CreateSessionRequest(name="zebra too")).id
        bob("AppendMessages", pb.AppendMessagesRequest(session_id=bobs, messages=[user("bob's zebra")]))
        before = alice("ListMessages", pb.ListMessagesRequest(session_id=sid, page_size=1000))

        outcomes: dict[tuple[str, str], grpc.StatusCode] = {}
        listed: dict[str, set[str]] = {}
        # Strangers first, so the owner's session is still intact for them; then admin and owner.
        for identity in ("none", "bad", "other", "admin", "owner"):
            caller = callers[identity]
            victim = alice("CreateSession", pb.CreateSessionRequest(name=f"victim of {identity}")).id
            for rpc, request in _requests(sid, view_id, summary_seq, victim).items():
                method = "ListSessions" if rpc == "ListSessionsQuery" else rpc
                code, response = caller.outcome(method, request)
                outcomes[(identity, rpc)] = code
                if code == OK and rpc.startswith("ListSessions"):
                    listed[f"{identity}:{rpc}"] = {s.id for s in response.sessions}
                if code == OK and rpc == "ForkSession":
                    assert response.user_id == ("root" if identity == "admin" else "alice")
            code, _ = caller.stream(session_id=sid, seconds=0.5)
            outcomes[(identity, "StreamEvents")] = code
            code, _ = caller.stream(seconds=0.5)
            outcomes[(identity, "StreamEventsAll")] = code
            victim_left = alice.outcome("GetSession", pb.GetSessionRequest(session_id=victim))[0]
            assert victim_left == (OK if outcomes[(identity, "DeleteSession")] != OK else NOT_FOUND), identity
            if identity == "other":
                # Nothing a stranger did reached alice's session.
                after = alice("ListMessages", pb.ListMessagesRequest(session_id=sid, page_size=1000))
                assert after == before
                assert not alice("GetSession", pb.GetSessionRequest(session_id=sid)).pinned

        wrong = {k: (outcomes[k], EXPECTED[k]) for k in EXPECTED if outcomes[k] != EXPECTED[k]}
        assert not wrong, f"unexpected outcomes (got, expected): {wrong}"
        foreign = [k for k, code in outcomes.items() if k[0] in ("other", "none", "bad") and k[1] in SESSION_RPCS]
        assert all(outcomes[k] in (NOT_FOUND, UNAUTH) for k in foreign)

        # Listings: bob never sees alice's sessions, with or without a query matching them.
        for rpc in ("ListSessions", "ListSessionsQuery"):
            assert sid not in listed[f"other:{rpc}"] and bobs in listed[f"other:{rpc}"]
            assert sid in listed[f"owner:{rpc}"] and bobs not in listed[f"owner:{rpc}"]
            assert {sid, bobs} <= listed[f"admin:{rpc}"]

        # Events without a session id: one's own only; the admin sees everyone's.
        seen = {name: callers[name].stream(seconds=2.0)[1] for name in ("owner", "other", "admin")}
        owners = {name: {e.session_id for e in events} for name, events in seen.items()}
        assert sid in owners["owner"] and bobs not in owners["owner"]
        assert bobs in owners["other"] and sid not in owners["other"]
        assert {sid, bobs} <= owners["admin"]

        # Health and reflection stay open without a token.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CALL_S)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "contextsvc.v1.ContextService" in services

    log = proc.stderr_text
    assert "admin read of another user's session" in log and '"owner": "alice"' in log
    assert "admin read across users" in log
    for secret in (tokens.alice, tokens.bob, tokens.root, "A" * 43):
        assert secret not in log
