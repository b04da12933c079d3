"""Recall into the view over the real server (issue 14 item 7): excerpts of compacted history
added to BuildContext as ``is_recall`` records, with their segment, notice and chunk ids."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.rpc import assistant, error_details, tool, user

FACT = "replica listening on 10.0.3.7 port 5433 accepted the connection"
QUESTION = "What is the IP address of the replica that accepted the connection?"


def _profile(**recall: Any) -> r.Profile:
    return r.Profile(
        model="recall-e2e",
        context_window=8192,
        system_prompt="You are a coding agent.",
        compression=r.CompressionSettings(keep_recent=2),
        recall=r.RecallSettings(**recall),
    )


def _log(turn: int, fact: str = "") -> str:
    lines = [f"12:{turn % 60:02d}:{i % 60:02d} worker ok batch {turn * 100 + i}" for i in range(50)]
    if fact:
        lines.insert(31, fact)
    return "\n".join(lines)


def _compacted_session(stub: Any) -> str:
    """Ten agent turns, the fact inside the first one's long tool output, then a compaction."""
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    batch: list[r.Message] = []
    for t in range(10):
        batch += [
            user(f"turn {t}: check the workers of module_{t}"),
            assistant("", [(f"c{t}", "run_command")]),
            tool(f"c{t}", _log(t, FACT if t == 0 else "")),
            assistant(f"module_{t} workers are fine"),
        ]
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=batch))
    done = stub.Compress(pb.CompressRequest(session_id=sid, profile=_profile()))
    assert done.compressed
    return sid


def _build(stub: Any, sid: str, question: str = QUESTION, **recall: Any) -> Any:
    return stub.BuildContext(
        pb.BuildContextRequest(session_id=sid, profile=_profile(**recall), incoming=user(question), auto_compress=False)
    )


def _recalled(view: Any) -> list[Any]:
    return [m for m in view.messages if m.flags.is_recall]


def test_a_fact_of_compacted_history_is_recalled_into_the_view(stub: Any) -> None:
    sid = _compacted_session(stub)
    # The fact is no longer in the context: only recall can bring it back.
    plain = _build(stub, sid, enabled=False)
    assert not any("10.0.3.7" in m.content for m in plain.messages)

    view = _build(stub, sid)
    recalled = _recalled(view)
    assert recalled and any(FACT in m.content for m in recalled)
    assert len(recalled) <= 2  # recall.max_excerpts default
    for m in recalled:
        assert m.role == r.ROLE_SYSTEM and m.sequence_number == 0
        assert not m.flags.is_context and not m.flags.is_display
        assert m.content.startswith("Recalled from earlier in this conversation")
    # After the system prompt, before the conversation; the incoming message stays last.
    roles = [(m.role, m.flags.is_recall) for m in view.messages]
    assert roles[0] == (r.ROLE_SYSTEM, False)
    assert roles[1 : 1 + len(recalled)] == [(r.ROLE_SYSTEM, True)] * len(recalled)
    assert view.messages[-1].content == QUESTION

    # Its own estimate segment, included in the total; a notice; the chunk ids.
    seg = view.estimate.segments
    assert seg.recall > 0
    total = seg.system + seg.records + seg.summaries + seg.pinned + seg.messages + seg.images + seg.incoming
    assert total + seg.recall == view.estimate.total
    assert view.estimate.total > plain.estimate.total
    assert any(n.startswith("recalled ") and "excerpt" in n for n in view.notices)
    assert len(view.injected_chunk_ids) == len(recalled)
    # The ids are SearchHistory's chunk ids: a client can look up what was added.
    found = stub.SearchHistory(pb.SearchHistoryRequest(session_id=sid, query=QUESTION, limit=10))
    assert set(view.injected_chunk_ids) <= {c.chunk_id for c in found.chunks}
    fact_chunk = next(c for c in found.chunks if FACT in c.text)
    assert fact_chunk.chunk_id in view.injected_chunk_ids
    # The fact's chunk is a window of the long tool output, not the whole 50-line log.
    assert fact_chunk.first_sequence == fact_chunk.last_sequence == 3
    assert len(fact_chunk.text) <= 800


def test_a_fork_of_a_compacted_session_recalls_from_the_history_it_inherits(stub: Any) -> None:
    """A fork inherits its parent's demoted rows in its history index; its builds recall from them
    as the parent's do (recall once skipped every fork as a session that never compacted)."""
    sid = _compacted_session(stub)
    fork = stub.ForkSession(pb.ForkSessionRequest(session_id=sid)).id
    view = _build(stub, fork)
    assert any(FACT in m.content for m in _recalled(view)), [m.content[:80] for m in view.messages]


def test_the_same_turn_never_gets_a_second_injection(stub: Any) -> None:
    sid = _compacted_session(stub)
    first = _build(stub, sid)
    again = _build(stub, sid)  # a retried build of the same turn
    assert first.injected_chunk_ids and list(again.injected_chunk_ids) == list(first.injected_chunk_ids)
    contents = [m.content for m in _recalled(again)]
    assert len(contents) == len(set(contents)) == len(again.injected_chunk_ids)
    # Nothing was stored: the display history has no recall rows, and a build without an
    # incoming user message (mid-turn, a tool result, or none) adds none.
    listed = stub.ListMessages(pb.ListMessagesRequest(session_id=sid, page_size=1000))
    assert not any(m.flags.is_recall for m in listed.messages)
    bare = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=_profile(), auto_compress=False))
    assert not _recalled(bare) and not bare.injected_chunk_ids and bare.estimate.segments.recall == 0


def test_recall_stays_within_its_token_budget(stub: Any) -> None:
    sid = _compacted_session(stub)
    full = _build(stub, sid)
    small = _build(stub, sid, max_tokens=80)
    assert 0 < small.estimate.segments.recall <= 80 < full.estimate.segments.recall
    # Cut to the lines around the fact, which survives the cut.
    assert any("10.0.3.7" in m.content for m in _recalled(small))
    one = _build(stub, sid, max_excerpts=1)
    assert len(one.injected_chunk_ids) == 1 == len(_recalled(one))
    # Too little room for any excerpt: none, and no notice.
    none = _build(stub, sid, max_tokens=10)
    assert not _recalled(none) and not none.injected_chunk_ids
    assert not any(n.startswith("recalled ") for n in none.notices)


def test_the_profile_switch_and_the_minimum_score(stub: Any) -> None:
    sid = _compacted_session(stub)
    off = _build(stub, sid, enabled=False)
    assert not _recalled(off) and not off.injected_chunk_ids and off.estimate.segments.recall == 0
    # The fact's chunk holds 5 of this question's 7 terms: enough for the default minimum (0.5),
    # not for 1.0 (every term).
    question = QUESTION + " Was it the zygote cluster?"
    assert _build(stub, sid, question).injected_chunk_ids
    assert not _build(stub, sid, question, min_score=1.0).injected_chunk_ids
    # A question about nothing in the history recalls nothing.
    unrelated = _build(stub, sid, "Please write a haiku about autumn leaves")
    assert not unrelated.injected_chunk_ids


def test_a_bad_recall_setting_is_invalid_argument(stub: Any) -> None:
    sid = _compacted_session(stub)
    with pytest.raises(grpc.RpcError) as err:
        _build(stub, sid, min_score=1.5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error_details(err.value)
    assert "profile.recall" in str(details)


def test_a_recall_view_is_a_baseline_without_its_excerpts(stub: Any) -> None:
    sid = _compacted_session(stub)
    view = _build(stub, sid)
    assert view.estimate.segments.recall > 0
    recorded = stub.RecordBaseline(
        pb.RecordBaselineRequest(session_id=sid, view_id=view.view_id, prompt_tokens=view.estimate.total)
    )
    assert recorded.recorded
    # The anchor holds the stored context only: the incoming message and the excerpts are out.
    session = stub.GetSession(pb.GetSessionRequest(session_id=sid))
    stored = view.estimate.total - view.estimate.segments.incoming - view.estimate.segments.recall
    assert session.context_tokens == pytest.approx(stored, abs=2)
