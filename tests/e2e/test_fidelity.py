# ruff: noqa: RUF001  (Russian and Chinese text, kept readable)
"""Calibration fidelity over the real server: the truncation rule, margins, EstimateTokens(session_id)."""

from __future__ import annotations

from typing import Any

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.rpc import assistant, user

RUSSIAN = "Сервер базы данных перезапущен, журнал показывает ошибку подключения к реплике. " * 30
CHINESE = "数据库服务器已经重新启动，日志显示连接副本时出现错误。" * 30


def _session(stub: Any) -> str:
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    stub.AppendMessages(
        pb.AppendMessagesRequest(
            session_id=sid, messages=[user(RUSSIAN), assistant(CHINESE), user("Что дальше? 下一步是什么？")]
        )
    )
    return sid


def test_an_honest_count_below_70_percent_of_a_cold_estimate_is_recorded(stub: Any) -> None:
    sid = _session(stub)
    profile = r.Profile(model="my-local-model", context_window=32768)  # unknown: the default family
    first = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile, auto_compress=False))
    assert first.estimate.margin > 0  # cold: the prior's own margin

    # A count no tokenizer could produce for this text is refused, and the response says why.
    cut = stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id=first.view_id, prompt_tokens=5))
    assert cut.truncated and not cut.recorded
    assert "below" in cut.truncation_reason and str(cut.lower_bound) in cut.truncation_reason
    assert 5 < cut.lower_bound < first.estimate.total
    assert stub.GetSession(pb.GetSessionRequest(session_id=sid)).context_truncated

    # The cheapest honest count (a vocabulary that spends few tokens on these scripts) sits under
    # 70% of the cold estimate: the first version refused it; now it is held against the bound.
    second = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile, auto_compress=False))
    honest = cut.lower_bound
    assert honest < 0.7 * second.estimate.total
    ok = stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id=second.view_id, prompt_tokens=honest))
    assert ok.recorded and not ok.truncated and ok.truncation_reason == ""
    assert ok.calibration.fitted and ok.calibration.family == "default"
    assert ok.calibration.margin > 0 and set(ok.calibration.class_ratios) >= {"cyrillic", "cjk", "word"}
    assert not stub.GetSession(pb.GetSessionRequest(session_id=sid)).context_truncated


def test_estimate_tokens_of_a_session_prices_what_build_context_sends(stub: Any) -> None:
    sid = _session(stub)
    profile = r.Profile(model="gpt-4o", context_window=32768, system_prompt="You are terse. Answer in one line.")
    view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile, auto_compress=False))
    # No profile given: the one BuildContext remembered, system prompt included.
    est = stub.EstimateTokens(pb.EstimateTokensRequest(session_id=sid))
    assert est.estimate.total == view.estimate.total
    assert est.estimate.segments.system == view.estimate.segments.system > 0


def test_a_standalone_list_is_not_charged_a_view_overhead(stub: Any) -> None:
    one = stub.EstimateTokens(pb.EstimateTokensRequest(model="gpt-4o", messages=[user("hello there")]))
    assert one.estimate.segments.system == 0
    assert 0 < one.estimate.total < 20
