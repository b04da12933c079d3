# ruff: noqa: RUF001  (Russian and Chinese text, kept readable)
"""Calibration fidelity over the real server: the truncation rule, margins, EstimateTokens(session_id)."""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.rpc import assistant, tool, user

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


def _marked_or_compressed(stub: Any, sid: str) -> bool:
    """A refused count marks the session truncated, and the post-turn check then compresses it in
    the background, clearing the mark: a read right after the refusal may see either."""
    got = stub.GetSession(pb.GetSessionRequest(session_id=sid))
    return bool(got.context_truncated or got.context_message_count < got.display_message_count)


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
    assert _marked_or_compressed(stub, sid)

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


def _turn(k: int) -> list[r.Message]:
    # A chatty tool loop: short messages, a tool call each, indented output — framing and
    # whitespace, where the vocabulary-free bound is loosest.
    return [
        user(f"step {k}: check it"),
        assistant("", calls=[(f"c{k}", "read_file")]),
        tool(f"c{k}", f"    ok {k}\n        done\n"),
        assistant(f"Step {k} is fine."),
    ]


def _bare_bound(messages: list[Any]) -> int:
    """The vocabulary-free bound of a view of these messages (what the first version held counts to)."""
    from contextsvc.api.mapping import incoming_from_pb
    from contextsvc.core.calibration import lower_bound
    from contextsvc.core.tokens import messages_features

    rows = [incoming_from_pb(m, "m").message for m in messages]
    return lower_bound(messages_features(rows, views=1))


def test_a_calibrated_model_catches_a_cut_prompt_the_bare_bound_lets_through(stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    profile = r.Profile(model=f"gpt-4o-e2e-floor-{sid[:8]}", context_window=65536)  # o200k, its own baselines
    for k in range(4):  # four honest baselines of this kind of view
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=_turn(k)))
        view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile, auto_compress=False))
        honest = round(view.estimate.total * 1.02)
        ok = stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id=view.view_id, prompt_tokens=honest))
        assert ok.recorded and not ok.truncated
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=_turn(9)))
    view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile, auto_compress=False))
    sent = list(view.messages)
    cut = int(0.6 * view.estimate.total)  # the provider dropped the head of the prompt
    # The first version held counts to the bare bound only: this cut count would have been recorded.
    assert cut > _bare_bound(sent)
    refused = stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id=view.view_id, prompt_tokens=cut))
    assert refused.truncated and not refused.recorded
    assert refused.lower_bound > cut and str(refused.lower_bound) in refused.truncation_reason
    assert "calibrated price" in refused.truncation_reason
    assert _marked_or_compressed(stub, sid)
    # An honest count of the same view, a little under the estimate, is recorded.
    again = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile, auto_compress=False))
    fine = round(again.estimate.total * 0.93)
    ok = stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id=again.view_id, prompt_tokens=fine))
    assert ok.recorded and not ok.truncated and ok.truncation_reason == ""


def test_estimates_that_ran_short_widen_the_margin(stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    profile = r.Profile(model=f"gpt-4o-e2e-margin-{sid[:8]}", context_window=65536)
    margins = []
    for k in range(4):
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=_turn(k)))
        view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile, auto_compress=False))
        # Every real count 12% above the estimate: the recorded residuals make the margin grow.
        short = round(view.estimate.total * 1.12)
        ok = stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id=view.view_id, prompt_tokens=short))
        assert ok.recorded
        margins.append(ok.calibration.margin)
    cold = margins[0]
    assert margins[-1] > cold
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=_turn(7)))
    view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile, auto_compress=False))
    assert view.estimate.margin > 0


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (30, 90, 160)).save(buf, format="PNG")
    return buf.getvalue()


def test_a_small_view_made_of_images_cut_to_half_is_caught(stub: Any) -> None:
    # Images are priced by the image rule, not a vocabulary: the floor holds 70% of their price, so
    # a two-screenshot view with one line of text, reported at half its size, is a cut prompt
    # (before, its floor was its text's alone and the count was recorded as honest).
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    shots = [r.Image(data=_png(1024, 1024)) for _ in range(2)]
    stub.AppendMessages(
        pb.AppendMessagesRequest(
            session_id=sid, messages=[r.Message(role=r.ROLE_USER, content="what changed here?", images=shots)]
        )
    )
    profile = r.Profile(model="gpt-4o", vision=True)
    view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile, auto_compress=False))
    assert view.estimate.images == 2 * 1026 and view.estimate.images > 0.95 * view.estimate.total
    half = view.estimate.total // 2
    cut = stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id=view.view_id, prompt_tokens=half))
    assert cut.truncated and not cut.recorded
    assert cut.lower_bound >= int(0.7 * view.estimate.images) > half
    assert "image pricing rule" in cut.truncation_reason and str(cut.lower_bound) in cut.truncation_reason
    assert _marked_or_compressed(stub, sid)
    # An honest count a little under the estimate is recorded (images are not fitted, so it is
    # only checked, and the view is no anchor: it carried images).
    again = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile, auto_compress=False))
    honest = round(again.estimate.total * 0.9)
    ok = stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id=again.view_id, prompt_tokens=honest))
    assert ok.recorded and not ok.truncated and ok.truncation_reason == ""
