"""The server process: health, reflection, sessions, appends, paging, errors, events."""

from __future__ import annotations

import base64
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from contextsvc.engine import paging
from tests.support.rpc import all_messages, assistant, error_details, tool, user
from tests.support.server import ServerProcess

EVERY_RPC = {
    "CreateSession",
    "GetSession",
    "ListSessions",
    "UpdateSession",
    "DeleteSession",
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
}


def test_health_serving_and_reflection_lists_every_rpc(tmp_path: Any) -> None:
    # How fast it gets there is a benchmark's business (bench/store/startup.py), not a test's.
    proc = ServerProcess(f"files:{tmp_path / 'd'}").start()
    try:
        with proc.channel() as ch:
            health = health_pb2_grpc.HealthStub(ch)
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=3, wait_for_ready=True)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            named = health.Check(health_pb2.HealthCheckRequest(service="contextsvc.v1.ContextService"), timeout=3)
            assert named.status == health_pb2.HealthCheckResponse.SERVING
            db = ProtoReflectionDescriptorDatabase(ch)
            assert "contextsvc.v1.ContextService" in set(db.get_services())
            from google.protobuf.descriptor_pool import DescriptorPool

            service = DescriptorPool(db).FindServiceByName("contextsvc.v1.ContextService")
            assert {m.name for m in service.methods} == EVERY_RPC
    finally:
        assert proc.terminate() == 0


def test_sigterm_stops_gracefully(server: ServerProcess) -> None:
    with server.channel() as ch:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5, wait_for_ready=True)
    started = time.monotonic()
    assert server.terminate(timeout=15) == 0
    assert time.monotonic() - started < 10
    assert '"event": "stopped"' in server.stderr_text


def test_session_lifecycle(stub: Any) -> None:
    created = stub.CreateSession(pb.CreateSessionRequest(name="first", profile_id="default"))
    assert created.id and created.user_id == "anonymous" and created.profile_id == "default"
    got = stub.GetSession(pb.GetSessionRequest(session_id=created.id))
    assert got.name == "first" and got.display_message_count == 0

    updated = stub.UpdateSession(
        pb.UpdateSessionRequest(
            session=r.Session(id=created.id, name="renamed", pinned=True),
            update_mask=field_mask_pb2.FieldMask(paths=["name", "pinned"]),
        )
    )
    assert (updated.name, updated.pinned) == ("renamed", True)

    stub.DeleteSession(pb.DeleteSessionRequest(session_id=created.id))
    with pytest.raises(grpc.RpcError) as err:
        stub.GetSession(pb.GetSessionRequest(session_id=created.id))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_details(err.value)["reason"] == "NOT_FOUND"


def test_list_sessions_pages_with_opaque_tokens_and_filters(stub: Any) -> None:
    ids = [stub.CreateSession(pb.CreateSessionRequest(name=f"s{i}")).id for i in range(7)]
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=ids[3], messages=[user("needle in a haystack")]))
    seen: list[str] = []
    token = ""
    while True:
        page = stub.ListSessions(pb.ListSessionsRequest(page_size=3, page_token=token))
        assert page.total_size == 7
        seen += [s.id for s in page.sessions]
        token = page.next_page_token
        if not token:
            break
    assert sorted(seen) == sorted(ids)
    found = stub.ListSessions(pb.ListSessionsRequest(query="NEEDLE"))
    assert [s.id for s in found.sessions] == [ids[3]] and found.total_size == 1
    assert "needle" in found.sessions[0].preview
    assert stub.ListSessions(pb.ListSessionsRequest(profile_id="nope")).total_size == 0


def test_list_sessions_pages_stay_exact_while_sessions_change(stub: Any) -> None:
    """An agent fleet keeps sessions moving while an inspector pages through them: a session
    created, updated or deleted ahead of the page reached must not make the next page repeat a
    session or skip one (offset paging did both)."""
    ids = [stub.CreateSession(pb.CreateSessionRequest(name=f"m{i}")).id for i in range(6)]

    def page(token: str) -> tuple[list[str], str]:
        got = stub.ListSessions(pb.ListSessionsRequest(page_size=2, page_token=token))
        return [s.id for s in got.sessions], got.next_page_token

    first, token = page("")
    assert first == [ids[5], ids[4]]
    newest = stub.CreateSession(pb.CreateSessionRequest(name="newest")).id  # ahead: offset 2 repeats ids[4]
    second, token = page(token)
    assert second == [ids[3], ids[2]]
    stub.DeleteSession(pb.DeleteSessionRequest(session_id=ids[5]))  # ahead: offset 4 would skip one
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=ids[1], messages=[user("moved to the top")]))
    third, token = page(token)
    # ids[1] moved ahead of the position: listed by a fresh listing, not again in this pass.
    assert third == [ids[0]] and not token
    assert page("")[0] == [ids[1], newest]


def test_a_page_token_of_the_offset_kind_is_still_honoured(stub: Any) -> None:
    """Tokens a server before positional paging gave out (an offset) still page during an
    upgrade of a fleet's replicas."""
    ids = [stub.CreateSession(pb.CreateSessionRequest(name=f"o{i}")).id for i in range(3)]
    raw = json.dumps({"o": 1, "f": paging._filter_hash("sessions", "", "")}, separators=(",", ":")).encode()
    old = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    page = stub.ListSessions(pb.ListSessionsRequest(page_size=10, page_token=old))
    assert [s.id for s in page.sessions] == [ids[1], ids[0]] and not page.next_page_token


def test_append_is_idempotent_by_request_id(stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    req = pb.AppendMessagesRequest(session_id=sid, messages=[user("a"), user("b")], request_id="req-1")
    first = stub.AppendMessages(req)
    again = stub.AppendMessages(req)
    assert list(first.sequence_numbers) == [1, 2] == list(again.sequence_numbers)
    assert stub.GetSession(pb.GetSessionRequest(session_id=sid)).display_message_count == 2
    # A retry after other appends is still answered as the first call was (DESIGN §4).
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("c " * 200)]))
    late = stub.AppendMessages(req)
    assert late == first
    assert stub.GetSession(pb.GetSessionRequest(session_id=sid)).context_tokens > first.context_tokens


def test_concurrent_appends_get_distinct_contiguous_sequence_numbers(server: ServerProcess) -> None:
    with server.channel() as ch:
        stub = server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id

        def append(i: int) -> list[int]:
            resp = stub.AppendMessages(
                pb.AppendMessagesRequest(session_id=sid, messages=[user(f"c{i}-a"), user(f"c{i}-b")])
            )
            return list(resp.sequence_numbers)

        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(append, range(40)))
        flat = sorted(n for seqs in results for n in seqs)
        assert flat == list(range(1, 81))
        assert all(seqs[1] == seqs[0] + 1 for seqs in results)  # one append stays contiguous


def test_list_messages_pages_backwards_through_both_buffers(stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user(f"m{i}") for i in range(25)]))
    page = stub.ListMessages(pb.ListMessagesRequest(session_id=sid, page_size=10))
    assert [m.sequence_number for m in page.messages] == list(range(16, 26))
    assert page.next_before_sequence == 16
    msgs = all_messages(stub, sid, page_size=7)
    assert [m.content for m in msgs] == [f"m{i}" for i in range(25)]
    ctx = all_messages(stub, sid, buffer=pb.BUFFER_CONTEXT, page_size=7)
    assert [m.sequence_number for m in ctx] == list(range(1, 26))


def test_pages_of_big_messages_fit_a_default_grpc_client(stub: Any) -> None:
    """Four 2 MiB messages (each well inside the content limit) are 8 MiB: a page stops before the
    row that would take it past ``limits.max_page_bytes``, so a client with gRPC's default 4 MiB
    receive limit (this stub) reads every page, and the pages are still exactly the buffer."""
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    contents = [f"{i}" + "\u00e9" * (1024 * 1024) for i in range(4)]  # 2 MiB of UTF-8 each
    for content in contents:
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user(content)]))
    page = stub.ListMessages(pb.ListMessagesRequest(session_id=sid))
    assert [m.sequence_number for m in page.messages] == [4] and page.next_page_token
    assert [m.content for m in all_messages(stub, sid)] == contents
    assert [m.content for m in all_messages(stub, sid, buffer=pb.BUFFER_CONTEXT)] == contents


def test_pages_of_metadata_heavy_messages_fit_a_default_grpc_client(stub: Any) -> None:
    """Metadata within its 64 KiB limit as JSON weighs more as a protobuf Struct (a list of numbers:
    ``0.0,`` is 4 JSON bytes and 11 on the wire): 40 such rows are ~6.6 MB, over gRPC's default
    4 MiB, and the page's byte bound counts them so."""
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    for i in range(40):
        message = user(f"row {i}")
        message.metadata.update({"samples": [0] * 15_000})  # 60 KB of JSON, ~165 KB on the wire
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[message]))
    page = stub.ListMessages(pb.ListMessagesRequest(session_id=sid))
    assert page.next_page_token and 0 < len(page.messages) < 40
    listed = all_messages(stub, sid)
    assert [m.content for m in listed] == [f"row {i}" for i in range(40)]
    assert all(len(m.metadata["samples"]) == 15_000 for m in listed)


def _with_metadata(request: Any, value: float) -> Any:
    request.metadata.update({"x": value})
    return request


def _code_and_fields(call: Any) -> tuple[grpc.StatusCode, list[str], str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    details = error_details(err.value)
    return err.value.code(), details["fields"], details["reason"]


def test_nul_in_profile_text_model_or_request_id_is_refused_naming_the_field(stub: Any) -> None:
    """PostgreSQL cannot store NUL and refused these with a message naming no field, while the files
    store took them: every store now refuses them alike, before the store is asked."""
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("hello")]))
    nul = "a\x00b"
    cases: list[tuple[Any, str]] = [
        (
            lambda: stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=r.Profile(model=nul))),
            "profile.model",
        ),
        (
            lambda: stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=r.Profile(system_prompt=nul))),
            "profile.system_prompt",
        ),
        (
            lambda: stub.Compress(
                pb.CompressRequest(
                    session_id=sid,
                    dry_run=True,
                    profile=r.Profile(compression=r.CompressionSettings(summary_prompt=nul)),
                )
            ),
            "profile.compression.summary_prompt",
        ),
        (lambda: stub.EstimateTokens(pb.EstimateTokensRequest(model=nul, messages=[user("x")])), "model"),
        (
            lambda: stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("x")], request_id=nul)),
            "request_id",
        ),
        (lambda: stub.ListSessions(pb.ListSessionsRequest(query=nul)), "query"),
        (lambda: stub.ListSessions(pb.ListSessionsRequest(profile_id=nul)), "profile_id"),
    ]
    for call, field in cases:
        code, fields, _ = _code_and_fields(call)
        assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, [field])
    assert len(all_messages(stub, sid)) == 1


def test_malformed_requests_are_invalid_argument_with_field_named(stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    cases: list[tuple[Any, str]] = [
        (
            lambda: stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[r.Message(content="x")])),
            "messages[0].role",
        ),
        (
            lambda: stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[r.Message(role=42)])),
            "messages[0].role",
        ),
        (lambda: stub.AppendMessages(pb.AppendMessagesRequest(session_id="", messages=[user("x")])), "session_id"),
        (lambda: stub.GetSession(pb.GetSessionRequest(session_id="../../etc/passwd")), "session_id"),
        (
            lambda: stub.AppendMessages(
                pb.AppendMessagesRequest(session_id=sid, messages=[user("x" * (4 * 1024 * 1024 + 1))])
            ),
            "messages[0].content",
        ),
        (
            lambda: stub.AppendMessages(
                pb.AppendMessagesRequest(
                    session_id=sid,
                    messages=[
                        r.Message(role=r.ROLE_USER, content="pics", images=[r.Image(data=b"\x89PNG") for _ in range(9)])
                    ],
                )
            ),
            "messages[0].images",
        ),
        (lambda: stub.ListSessions(pb.ListSessionsRequest(page_size=-1)), "page_size"),
        (lambda: stub.ListSessions(pb.ListSessionsRequest(page_token="not-a-token")), "page_token"),
        (lambda: stub.ListMessages(pb.ListMessagesRequest(session_id=sid, page_size=-5)), "page_size"),
        (
            lambda: stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[tool("", "x")])),
            "messages[0].tool_call_id",
        ),
        (lambda: stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid)), "messages"),
        (
            lambda: stub.UpdateSession(
                pb.UpdateSessionRequest(
                    session=r.Session(id=sid), update_mask=field_mask_pb2.FieldMask(paths=["user_id"])
                )
            ),
            "update_mask",
        ),
        (lambda: stub.CreateSession(pb.CreateSessionRequest(profile_id="no-such-profile")), "profile_id"),
        (
            lambda: stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("nul \x00 here")])),
            "messages[0].content",
        ),
        (lambda: stub.CreateSession(pb.CreateSessionRequest(name="a\x00b")), "name"),
        (lambda: stub.CreateSession(_with_metadata(pb.CreateSessionRequest(), float("nan"))), "metadata"),
        (lambda: stub.EstimateTokens(pb.EstimateTokensRequest(model="m" * 201, messages=[user("x")])), "model"),
        (lambda: stub.BuildContext(pb.BuildContextRequest(session_id=sid, phase=7)), "phase"),
        (
            lambda: stub.BuildContext(
                pb.BuildContextRequest(session_id=sid, incoming=user("x" * (4 * 1024 * 1024 + 1)))
            ),
            "incoming.content",  # one message, named without an index
        ),
        (lambda: stub.BuildContext(pb.BuildContextRequest(session_id=sid, phase=-1)), "phase"),
        (lambda: stub.ListMessages(pb.ListMessagesRequest(session_id=sid, buffer=9)), "buffer"),
    ]
    for call, field in cases:
        code, fields, reason = _code_and_fields(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field in fields, (field, fields)
        assert reason
    # Nothing was stored by any of them.
    assert stub.GetSession(pb.GetSessionRequest(session_id=sid)).display_message_count == 0


def test_errors_about_very_long_client_values_stay_readable(stub: Any) -> None:
    """An error message that repeated a client's value whole (an id of 9,000 characters) overflowed
    the status trailers a default client accepts (8 KiB): the client saw its own RESOURCE_EXHAUSTED
    and no reason. The value is quoted cut, and a view id longer than any is refused unread."""
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    long = "Z" * 9000
    twins = assistant("", [(long, "read_file"), (long, "read_file")])
    odd_profile = r.Profile(compression=r.CompressionSettings(summarizer=long))
    cases: list[tuple[Any, str]] = [
        (lambda: stub.CreateSession(pb.CreateSessionRequest(profile_id=long)), "profile_id"),
        (
            lambda: stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id=long, prompt_tokens=5)),
            "view_id",
        ),
        (
            lambda: stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[twins])),
            "messages[0].tool_calls[1].id",
        ),
        (
            lambda: stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=odd_profile)),
            "profile.compression.summarizer",
        ),
    ]
    for call, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            call()
        details = error_details(err.value)
        assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT, (field, details["code"], details["message"][:200])
        assert field in details["fields"] and details["reason"], (field, details)
        assert len(details["message"]) < 1000
    assert stub.GetSession(pb.GetSessionRequest(session_id=sid)).display_message_count == 0


def test_page_token_is_bound_to_its_filter(stub: Any) -> None:
    for i in range(3):
        stub.CreateSession(pb.CreateSessionRequest(name=f"x{i}"))
    token = stub.ListSessions(pb.ListSessionsRequest(page_size=1)).next_page_token
    assert token
    code, fields, _ = _code_and_fields(
        lambda: stub.ListSessions(pb.ListSessionsRequest(page_size=1, page_token=token, query="x1"))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fields == ["page_token"]


def test_page_size_over_maximum_is_clamped(stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("a")]))
    page = stub.ListMessages(pb.ListMessagesRequest(session_id=sid, page_size=10**9))
    assert len(page.messages) == 1


def test_stream_events_delivers_appends_and_deletion_and_resumes(server: ServerProcess) -> None:
    with server.channel() as ch:
        stub = server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        received: list[Any] = []
        ready = threading.Event()

        stream = stub.StreamEvents(pb.StreamEventsRequest(session_id=sid))

        def consume() -> None:
            ready.set()
            for event in stream:  # ends by itself after session_deleted: nothing more can come
                received.append(event)

        t = threading.Thread(target=consume)
        t.start()
        ready.wait(5)
        # The subscription is live once a probe event comes through (bounded wait, no sleep-and-hope).
        for i in range(100):
            stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("probe")], request_id=f"p{i}"))
            if received:
                break
            time.sleep(0.05)
        assert received, "the stream never delivered an event"
        probes = stub.GetSession(pb.GetSessionRequest(session_id=sid)).display_message_count
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("one")], request_id="r1"))
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("two"), user("three")]))
        stub.DeleteSession(pb.DeleteSessionRequest(session_id=sid))
        t.join(10)
        assert not t.is_alive(), "the stream of a deleted session stayed open"
        assert stream.code() == grpc.StatusCode.OK
        ids_all = [e.event_id for e in received]
        assert ids_all == sorted(ids_all) and len(set(ids_all)) == len(ids_all)
        received = [e for e in received if not e.messages_appended.request_id.startswith("p")]
        kinds = [e.WhichOneof("payload") for e in received]
        assert kinds == ["messages_appended", "messages_appended", "session_deleted"]
        assert list(received[0].messages_appended.sequence_numbers) == [probes + 1]
        assert received[0].messages_appended.request_id == "r1"
        assert list(received[1].messages_appended.sequence_numbers) == [probes + 2, probes + 3]
        ids = [e.event_id for e in received]

        # Resume after the first event: the rest is replayed, nothing twice.
        replay = stub.StreamEvents(pb.StreamEventsRequest(after_event_id=ids[0]))
        got: list[int] = []
        for event in replay:
            if event.session_id == sid:
                got.append(event.event_id)
            if len(got) == 2:
                break
        replay.cancel()
        assert got == ids[1:]


def test_stream_events_resumed_past_the_newest_event_is_invalid_argument(stub: Any) -> None:
    """A resume id past the newest event skipped every event up to it in silence."""
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("one")]))
    stream = stub.StreamEvents(pb.StreamEventsRequest(session_id=sid, after_event_id=1))
    newest = next(iter(stream)).event_id
    stream.cancel()
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stub.StreamEvents(pb.StreamEventsRequest(session_id=sid, after_event_id=newest + 3))))
    details = error_details(err.value)
    assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT and details["fields"] == ["after_event_id"]
    # The newest id itself is a resume point: live events follow.
    live = stub.StreamEvents(pb.StreamEventsRequest(session_id=sid, after_event_id=newest))
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("two")]))
    assert next(iter(live)).event_id > newest
    live.cancel()


def test_stream_events_of_unknown_session_is_not_found(stub: Any) -> None:
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stub.StreamEvents(pb.StreamEventsRequest(session_id="00000000-0000-0000-0000-000000000000"))))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_stream_of_a_session_deleted_while_away_resumes_to_the_deletion(stub: Any) -> None:
    """A watcher that reconnects after its session was deleted reads what it missed and the
    deletion, and its stream ends (OK); a resume past the deletion is NOT_FOUND."""
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("one")]))
    stream = stub.StreamEvents(pb.StreamEventsRequest(session_id=sid, after_event_id=1))
    seen = next(iter(stream)).event_id
    stream.cancel()
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("two")]))
    stub.DeleteSession(pb.DeleteSessionRequest(session_id=sid))
    resumed = stub.StreamEvents(pb.StreamEventsRequest(session_id=sid, after_event_id=seen), timeout=10)
    got = list(resumed)
    assert [e.WhichOneof("payload") for e in got] == ["messages_appended", "session_deleted"]
    assert resumed.code() == grpc.StatusCode.OK and seen < got[0].event_id < got[1].event_id
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stub.StreamEvents(pb.StreamEventsRequest(session_id=sid, after_event_id=got[1].event_id))))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_fork_copies_both_buffers_up_to_a_message(stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest(name="parent")).id
    stub.AppendMessages(
        pb.AppendMessagesRequest(
            session_id=sid,
            messages=[user("q1"), assistant("", [("c1", "ls")]), tool("c1", "out"), assistant("a1"), user("q2")],
        )
    )
    child = stub.ForkSession(pb.ForkSessionRequest(session_id=sid, at_sequence=4))
    assert child.id != sid and child.display_message_count == 4
    assert [m.content for m in all_messages(stub, child.id)] == ["q1", "", "out", "a1"]
    code, fields, _ = _code_and_fields(lambda: stub.ForkSession(pb.ForkSessionRequest(session_id=sid, at_sequence=99)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fields == ["at_sequence"]


def test_a_fork_of_a_compacted_session_is_a_state_it_had_and_keeps_its_history_searchable(stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest(name="parent")).id
    for t in range(8):
        stub.AppendMessages(
            pb.AppendMessagesRequest(
                session_id=sid, messages=[user(f"turn {t}: the alpha{t} deploy " + "w " * 40), assistant(f"ok {t}")]
            )
        )
    profile = r.Profile(compression=r.CompressionSettings(keep_recent=2, summarizer="extractive"))
    assert stub.Compress(pb.CompressRequest(session_id=sid, profile=profile)).compressed
    parent_context = all_messages(stub, sid, buffer=pb.BUFFER_CONTEXT)
    [summary] = [m for m in parent_context if m.flags.is_summary]
    record = summary.sequence_number + 1  # the compression record, committed with the summary
    # At the summary: the state the compaction left (never the summary beside its originals).
    at_summary = stub.ForkSession(pb.ForkSessionRequest(session_id=sid, at_sequence=summary.sequence_number))
    at_record = stub.ForkSession(pb.ForkSessionRequest(session_id=sid, at_sequence=record))
    for child in (at_summary, at_record):
        context = all_messages(stub, child.id, buffer=pb.BUFFER_CONTEXT)
        assert [m.content for m in context] == [m.content for m in parent_context]
        assert child.metadata["forked_at"] == record
    # The originals the fork inherits as demoted are in its history index: search finds them.
    whole = stub.ForkSession(pb.ForkSessionRequest(session_id=sid))
    for session_id in (sid, whole.id):
        found = stub.SearchHistory(pb.SearchHistoryRequest(session_id=session_id, query="alpha1 deploy", limit=3))
        assert found.chunks and any("alpha1" in c.text for c in found.chunks), session_id
