"""Compression through a real server, with a real HTTP summarizer process (OpenAI and Ollama)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import events_pb2
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.fake_llm import FakeLLM
from tests.support.rpc import all_messages, assistant, error_details, tool, user
from tests.support.server import ServerProcess

WINDOW = 8192


@pytest.fixture
def llm_server(tmp_path: Path, llm: FakeLLM) -> Iterator[ServerProcess]:
    llm.reset()
    env = {
        "CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL": llm.base_url,
        "CONTEXTSVC_SUMMARIZER__OPENAI__TIMEOUT_SECONDS": "1",
        "CONTEXTSVC_SUMMARIZER__OPENAI__TOTAL_TIMEOUT_SECONDS": "3",
        "CONTEXTSVC_SUMMARIZER__OPENAI__MAX_RETRIES": "1",
        "CONTEXTSVC_SUMMARIZER__OPENAI__RETRY_BACKOFF_SECONDS": "0.05",
        "CONTEXTSVC_SUMMARIZER__OLLAMA__BASE_URL": llm.base_url,
        "CONTEXTSVC_SUMMARIZER__OLLAMA__TIMEOUT_SECONDS": "1",
        "CONTEXTSVC_SUMMARIZER__OLLAMA__TOTAL_TIMEOUT_SECONDS": "3",
        "CONTEXTSVC_SUMMARIZER__OLLAMA__MAX_RETRIES": "1",
    }
    with ServerProcess(f"files:{tmp_path / 'data'}", env=env).start() as proc:
        yield proc


def _profile(summarizer: str = "extractive", **compression: Any) -> r.Profile:
    """A small-window profile that summarizes (the cheap stage has its own test)."""
    compression.setdefault("strategies", ["summarize"])
    return r.Profile(
        model="m",
        context_window=WINDOW,
        system_prompt="You are a coding agent.",
        compression=r.CompressionSettings(summarizer=summarizer, **compression),
    )


def _fill(stub: Any, sid: str, turns: int, *, planted: str = "") -> None:
    """Agent turns with tool calls and sizeable outputs; a fact planted in the first turn."""
    batch: list[r.Message] = []
    for t in range(turns):
        ask = f"turn {t}: inspect module_{t}.py" + (f" — remember {planted}" if t == 0 and planted else "")
        batch += [
            user(ask),
            assistant("", [(f"c{t}", "read_file")]),
            tool(f"c{t}", f"def handler_{t}():\n    return {t}\n" * 30),
            assistant(f"module_{t}.py defines handler_{t}"),
        ]
    for i in range(0, len(batch), 40):
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=batch[i : i + 40]))


def _display_bytes(stub: Any, sid: str) -> list[bytes]:
    """The display history as bytes, without the one flag compression may change (is_context)."""
    out = []
    for m in all_messages(stub, sid):
        m.flags.ClearField("is_context")
        out.append(m.SerializeToString(deterministic=True))
    return out


def _legal(messages: list[r.Message]) -> bool:
    pending: set[str] = set()
    for m in messages:
        if m.role == r.ROLE_TOOL:
            if m.tool_call_id not in pending:
                return False
            pending.discard(m.tool_call_id)
        else:
            if pending:
                return False
            pending = {c.id for c in m.tool_calls}
    return True


def _watch(stub: Any, sid: str, out: list[Any], stop_kind: str = "session_deleted") -> threading.Thread:
    stream = stub.StreamEvents(pb.StreamEventsRequest(session_id=sid))

    def run() -> None:
        try:
            for event in stream:
                out.append(event)
                if event.WhichOneof("payload") == stop_kind:
                    return
        except grpc.RpcError:
            return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.3)
    t.stream = stream  # type: ignore[attr-defined]
    return t


def test_nothing_to_compact_and_no_compression_started(llm_server: ServerProcess) -> None:
    with llm_server.channel() as ch:
        stub = llm_server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        events: list[Any] = []
        t = _watch(stub, sid, events)
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as err:
                stub.Compress(pb.CompressRequest(session_id=sid, profile=_profile()))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert error_details(err.value)["reason"] == "NOTHING_TO_COMPACT"
            stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("just one question")]))
        stub.DeleteSession(pb.DeleteSessionRequest(session_id=sid))
        t.join(10)
        kinds = {e.WhichOneof("payload") for e in events}
        assert "compression_started" not in kinds and "context_compressed" not in kinds


def test_forced_compress_keeps_display_history_and_indexes_every_dropped_message(llm_server: ServerProcess) -> None:
    with llm_server.channel() as ch:
        stub = llm_server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        _fill(stub, sid, 30, planted="the deploy key is KX-4417")
        display_before = _display_bytes(stub, sid)
        dry = stub.Compress(pb.CompressRequest(session_id=sid, profile=_profile(), dry_run=True))
        assert not dry.compressed and dry.plan.would_compress and dry.plan.messages_to_drop > 0
        assert len(all_messages(stub, sid, pb.BUFFER_CONTEXT)) == 120  # the dry run changed nothing

        done = stub.Compress(pb.CompressRequest(session_id=sid, profile=_profile(), reason="test"))
        assert done.compressed and done.method == events_pb2.COMPRESSION_METHOD_SUMMARY
        assert done.plan.messages_to_drop == dry.plan.messages_to_drop  # prediction == action
        assert done.context_tokens_after < done.context_tokens_before
        assert any("KX-4417" in b for b in done.breadcrumbs)

        display_after = _display_bytes(stub, sid)
        # The display history is untouched; only a compression record is appended to it.
        assert display_after[: len(display_before)] == display_before
        extra = all_messages(stub, sid)[len(display_before) :]
        assert [m.flags.is_compression for m in extra] == [True]

        context = all_messages(stub, sid, pb.BUFFER_CONTEXT)
        assert context[0].flags.is_summary and not context[0].flags.is_display
        view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=_profile(), auto_compress=False))
        assert _legal(list(view.messages[1:]))
        assert view.estimate.total <= 0.65 * WINDOW

        # Every dropped message is recoverable: the summary expands to them, and search finds the fact.
        originals = stub.ExpandSummary(
            pb.ExpandSummaryRequest(session_id=sid, sequence_number=context[0].sequence_number)
        ).messages
        assert len(originals) == done.plan.messages_to_drop
        assert "KX-4417" in originals[0].content
        found = stub.SearchHistory(pb.SearchHistoryRequest(session_id=sid, query="deploy key KX-4417"))
        assert found.chunks and "KX-4417" in found.chunks[0].text
        assert found.chunks[0].first_sequence == 1


def test_cheap_stage_clears_old_tool_results_without_a_summary(llm_server: ServerProcess) -> None:
    with llm_server.channel() as ch:
        stub = llm_server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        # Sized so that clearing the old tool results alone reaches the aim under the cold prior: on
        # this window (8,192, 2,048 reserved: the trigger is the budget) the estimate is aimed a
        # band below the point where estimate + margin reaches the budget (docs/calibration.md).
        _fill(stub, sid, 10)
        profile = _profile(strategies=["clear_tool_results", "summarize"])
        done = stub.Compress(pb.CompressRequest(session_id=sid, profile=profile))
        assert done.compressed and done.method == events_pb2.COMPRESSION_METHOD_CLEAR_TOOL_RESULTS
        assert not done.summary and done.messages_after == done.messages_before
        context = all_messages(stub, sid, pb.BUFFER_CONTEXT)
        assert not any(m.flags.is_summary for m in context)
        cleared = [m for m in context if m.role == r.ROLE_TOOL and "cleared" in m.content]
        assert cleared and all(not m.flags.is_display for m in cleared)
        view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile, auto_compress=False))
        assert _legal(list(view.messages[1:]))  # placeholders keep every call answered
        # The originals are still in the display history, unchanged.
        assert sum("def handler_0" in m.content for m in all_messages(stub, sid)) == 1


def test_preturn_compression_inside_build_context(llm_server: ServerProcess) -> None:
    with llm_server.channel() as ch:
        stub = llm_server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        _fill(stub, sid, 40)
        view = stub.BuildContext(
            pb.BuildContextRequest(session_id=sid, profile=_profile(), incoming=user("next step?"))
        )
        assert view.compression.compressed
        assert view.compression.reason == events_pb2.COMPRESSION_REASON_PRETURN
        assert view.estimate.total <= 0.65 * WINDOW + 200
        assert view.messages[-1].content == "next step?"
        assert _legal(list(view.messages[1:]))


@pytest.mark.parametrize("summarizer", ["openai", "ollama"])
def test_llm_summarizer_up_gives_summary_with_breadcrumbs(
    llm_server: ServerProcess, llm: FakeLLM, summarizer: str
) -> None:
    with llm_server.channel() as ch:
        stub = llm_server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        _fill(stub, sid, 30, planted="invoice INV-2231")
        done = stub.Compress(pb.CompressRequest(session_id=sid, profile=_profile(summarizer)))
        assert done.method == events_pb2.COMPRESSION_METHOD_SUMMARY and done.summary
        assert "KEYS:" not in done.summary  # split off into breadcrumbs
        assert done.breadcrumbs
        path = "/api/chat" if summarizer == "ollama" else "/v1/chat/completions"
        assert any(req.get("path") == path for req in llm.requests())


@pytest.mark.parametrize("summarizer", ["openai", "ollama"])
def test_a_summary_cut_at_the_output_limit_still_carries_its_facts(
    llm_server: ServerProcess, llm: FakeLLM, summarizer: str
) -> None:
    """finish_reason / done_reason "length": the model's output cap cut the answer before the fact
    lines it was asked to carry (and its KEYS line). The cut text is kept, marked as cut, and the
    facts the service sent it are added back: stored as it came, the planted fact was gone from
    the context."""
    llm.control(mode="length")
    with llm_server.channel() as ch:
        stub = llm_server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        _fill(stub, sid, 30, planted="invoice INV-2231")
        done = stub.Compress(pb.CompressRequest(session_id=sid, profile=_profile(summarizer)))
        assert done.method == events_pb2.COMPRESSION_METHOD_SUMMARY
        assert done.summary.startswith("- The conversation covered")  # the cut answer is kept
        assert "cut" in done.summary and "Facts:" in done.summary and "INV-2231" in done.summary
        assert "INV-2231" in done.breadcrumbs
        summary = next(m for m in all_messages(stub, sid, pb.BUFFER_CONTEXT) if m.flags.is_summary)
        assert summary.content == done.summary


@pytest.mark.parametrize("mode", ["fail", "hang", "garbage", "unknown_model"])
def test_llm_summarizer_down_slow_or_garbage_falls_back_to_hard_truncate(
    llm_server: ServerProcess, llm: FakeLLM, mode: str
) -> None:
    llm.control(mode=mode, hang_seconds=5)
    with llm_server.channel() as ch:
        stub = llm_server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        _fill(stub, sid, 40)
        events: list[Any] = []
        t = _watch(stub, sid, events, stop_kind="context_compressed")
        started = time.monotonic()
        view = stub.BuildContext(
            pb.BuildContextRequest(session_id=sid, profile=_profile("openai"), incoming=user("go on")), timeout=30
        )
        assert time.monotonic() - started < 20
        if mode == "hang":
            # The build waits for its compaction's summarizer hot_path.build_wait_seconds at most:
            # it serves a hard-truncated view it does not commit, and the compaction goes on.
            assert any("still running" in n for n in view.notices), list(view.notices)
            assert not view.compression.compressed
        else:
            assert view.compression.compressed  # the caller's turn succeeds
            assert view.compression.method == events_pb2.COMPRESSION_METHOD_HARD_TRUNCATE
        assert view.estimate.total <= 0.5 * WINDOW + 300
        t.join(20)
        compressed = [e for e in events if e.WhichOneof("payload") == "context_compressed"]
        assert compressed and compressed[0].context_compressed.method == events_pb2.COMPRESSION_METHOD_HARD_TRUNCATE
        # Nothing was lost: the dropped turns are in the index.
        found = stub.SearchHistory(pb.SearchHistoryRequest(session_id=sid, query="handler_0"))
        assert found.chunks


def test_a_hung_summarizer_is_waited_for_once_per_compaction(llm_server: ServerProcess, llm: FakeLLM) -> None:
    """A forced compaction whose summarizer hangs: one call (its own retry included, bounded by
    total_timeout_seconds = 3 s here), then hard truncation. The second call with a wider keep
    window waited the whole bound again (2 x 3 s here, 2 x 150 s by default)."""
    llm.control(mode="hang", hang_seconds=10)
    with llm_server.channel() as ch:
        stub = llm_server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        for t in range(0, 40, 10):  # short turns: a wider keep window still leaves turns to summarize
            batch = []
            for k in range(t, t + 10):
                batch += [user(f"ask {k}"), assistant("", [(f"c{k}", "grep")]), tool(f"c{k}", f"hit {k}\n" * 60)]
                batch.append(assistant(f"answer {k}"))
            stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=batch))
        started = time.monotonic()
        report = stub.Compress(pb.CompressRequest(session_id=sid, profile=_profile("openai")), timeout=30)
        assert report.method == events_pb2.COMPRESSION_METHOD_HARD_TRUNCATE
        assert len(llm.requests()) == 2  # max_retries = 1: two attempts of one call
        assert time.monotonic() - started < 5


def test_post_turn_worker_compresses_after_turn_complete(llm_server: ServerProcess) -> None:
    with llm_server.channel() as ch:
        stub = llm_server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=_profile(), auto_compress=False))
        events: list[Any] = []
        t = _watch(stub, sid, events, stop_kind="context_compressed")
        _fill(stub, sid, 40)
        stub.AppendMessages(
            pb.AppendMessagesRequest(session_id=sid, messages=[assistant("turn done")], turn_complete=True)
        )
        t.join(15)
        kinds = [e.WhichOneof("payload") for e in events]
        assert "compression_started" in kinds and "context_compressed" in kinds
        assert kinds.index("compression_started") < kinds.index("context_compressed")
        done = next(e.context_compressed for e in events if e.WhichOneof("payload") == "context_compressed")
        assert done.reason == events_pb2.COMPRESSION_REASON_POSTTURN
        assert done.context_tokens_after <= 0.65 * WINDOW


def test_bad_compression_requests(llm_server: ServerProcess) -> None:
    with llm_server.channel() as ch:
        stub = llm_server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("hello")]))
        cases = [
            (lambda: stub.SearchHistory(pb.SearchHistoryRequest(session_id=sid, query="  the ")), "query"),
            (lambda: stub.SearchHistory(pb.SearchHistoryRequest(session_id=sid, query="x", limit=-1)), "limit"),
            (lambda: stub.ExpandSummary(pb.ExpandSummaryRequest(session_id=sid, sequence_number=1)), "sequence_number"),
            (
                lambda: stub.Compress(pb.CompressRequest(session_id=sid, profile=_profile("nope"))),
                "profile.compression.summarizer",
            ),
        ]
        for call, field in cases:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in error_details(err.value)["fields"], field
        with pytest.raises(grpc.RpcError) as err:
            stub.ExpandSummary(pb.ExpandSummaryRequest(session_id=sid, sequence_number=99))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_context_buffer_pages_by_token_after_compactions(llm_server: ServerProcess) -> None:
    """Issue #8 item 1 over the wire: after compactions the context buffer is not in sequence
    order (summary first, placeholders at their results' places); pages joined by
    next_page_token equal the one-page listing for every page size, and a bad token is
    INVALID_ARGUMENT naming page_token."""
    with llm_server.channel() as ch:
        stub = llm_server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        _fill(stub, sid, 20)
        profile = _profile(strategies=["clear_tool_results", "summarize"])
        assert stub.Compress(pb.CompressRequest(session_id=sid, profile=profile)).compressed
        _fill(stub, sid, 6)
        whole = stub.ListMessages(pb.ListMessagesRequest(session_id=sid, buffer=pb.BUFFER_CONTEXT, page_size=1000))
        expected = [m.sequence_number for m in whole.messages]
        assert not whole.next_page_token
        assert expected != sorted(expected)  # the summary stands before rows with smaller numbers
        for size in range(1, len(expected) + 1):
            got = [m.sequence_number for m in all_messages(stub, sid, pb.BUFFER_CONTEXT, page_size=size)]
            assert got == expected, size
        first = stub.ListMessages(pb.ListMessagesRequest(session_id=sid, buffer=pb.BUFFER_CONTEXT, page_size=5))
        assert first.next_page_token and first.next_before_sequence == 0
        for token in ("%%%", first.next_page_token[:-3] + "AAA"):
            with pytest.raises(grpc.RpcError) as err:
                stub.ListMessages(
                    pb.ListMessagesRequest(session_id=sid, buffer=pb.BUFFER_CONTEXT, page_size=5, page_token=token)
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_details(err.value)["fields"] == ["page_token"]


def test_clearing_then_truncation_names_both_stages_and_closes_the_start(llm_server: ServerProcess) -> None:
    """Issue #8 items 2 and 3 over the wire: a clearing-only profile whose clearing cannot reach
    the target reports clear_tool_results then hard_truncate (response and event); with
    hard_truncate_fallback=false it drops no turn; every compression_started is closed."""
    with llm_server.channel() as ch:
        stub = llm_server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        events: list[Any] = []
        watcher = _watch(stub, sid, events)
        batch: list[r.Message] = []
        for t in range(14):  # conversation-heavy turns: results are a small share
            batch += [
                user(f"turn {t}: " + "please look at the retry policy and explain it " * 12),
                assistant("", [(f"c{t}", "read_file")]),
                tool(f"c{t}", f"def handler_{t}():\n    return {t}\n" * 6),
                assistant(f"handler_{t} " + "retries with backoff and a jittered delay " * 12),
            ]
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=batch))
        users_before = sum(m.role == r.ROLE_USER for m in all_messages(stub, sid, pb.BUFFER_CONTEXT))

        no_fallback = _profile(strategies=["clear_tool_results"], hard_truncate_fallback=False)
        kept = stub.Compress(pb.CompressRequest(session_id=sid, profile=no_fallback))
        assert kept.compressed and kept.method == events_pb2.COMPRESSION_METHOD_CLEAR_TOOL_RESULTS
        assert [s.method for s in kept.stages] == [events_pb2.COMPRESSION_METHOD_CLEAR_TOOL_RESULTS]
        context = all_messages(stub, sid, pb.BUFFER_CONTEXT)
        assert sum(m.role == r.ROLE_USER for m in context) == users_before

        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=batch[:20]))
        both = stub.Compress(pb.CompressRequest(session_id=sid, profile=_profile(strategies=["clear_tool_results"])))
        assert both.compressed and both.method == events_pb2.COMPRESSION_METHOD_HARD_TRUNCATE
        assert [s.method for s in both.stages] == [
            events_pb2.COMPRESSION_METHOD_CLEAR_TOOL_RESULTS,
            events_pb2.COMPRESSION_METHOD_HARD_TRUNCATE,
        ]
        assert both.stages[0].messages_removed > 0 and both.stages[1].messages_removed > 0
        assert both.stages[0].tokens_before == both.context_tokens_before
        assert both.stages[-1].tokens_after == both.context_tokens_after

        stub.DeleteSession(pb.DeleteSessionRequest(session_id=sid))
        watcher.join(10)
        kinds = [e.WhichOneof("payload") for e in events]
        kinds = [k for k in kinds if k in ("compression_started", "context_compressed", "compression_refused")]
        assert kinds == ["compression_started", "context_compressed"] * 2
        compressed = [e.context_compressed for e in events if e.WhichOneof("payload") == "context_compressed"]
        assert [len(c.stages) for c in compressed] == [1, 2]
