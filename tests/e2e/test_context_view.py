"""BuildContext, EstimateTokens and RecordBaseline over real gRPC."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import grpc
import pytest
from PIL import Image

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.rpc import assistant, error_details, tool, user
from tests.support.server import ServerProcess


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h)).save(buf, format="PNG")
    return buf.getvalue()


def test_build_record_baseline_and_estimate_round_trip(stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    stub.AppendMessages(
        pb.AppendMessagesRequest(
            session_id=sid,
            messages=[
                user("find the config"),
                assistant("", [("c1", "grep")]),
                tool("c1", "config.toml:3: port = 8080\n" * 200),
                assistant("It is in config.toml"),
                r.Message(role=r.ROLE_SYSTEM, content="hidden audit", metadata=None),
            ],
        )
    )
    profile = r.Profile(model="e2e-model", context_window=16384, system_prompt="Be brief.")
    view = stub.BuildContext(
        pb.BuildContextRequest(session_id=sid, profile=profile, incoming=user("and the port?"), phase=pb.PHASE_PRE_TURN)
    )
    assert [m.role for m in view.messages] == [
        r.ROLE_SYSTEM,
        r.ROLE_USER,
        r.ROLE_ASSISTANT,
        r.ROLE_TOOL,
        r.ROLE_ASSISTANT,
        r.ROLE_USER,
    ]
    assert view.messages[0].content == "Be brief." and view.messages[-1].content == "and the port?"
    est = view.estimate
    assert est.window == 16384 and est.budget == 16384 - 2048
    assert est.method == r.ESTIMATE_METHOD_FALLBACK
    seg = est.segments
    assert seg.system > 0 and seg.messages > 0 and seg.incoming > 0
    assert seg.system + seg.records + seg.summaries + seg.pinned + seg.messages + seg.images + seg.incoming == est.total

    recorded = stub.RecordBaseline(
        pb.RecordBaselineRequest(session_id=sid, view_id=view.view_id, prompt_tokens=est.total)
    )
    assert recorded.recorded and not recorded.truncated
    assert recorded.calibration.model == "e2e-model" and recorded.calibration.observations == 1

    again = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile))
    assert again.estimate.method == r.ESTIMATE_METHOD_BASELINE_DELTA

    truncated = stub.RecordBaseline(
        pb.RecordBaselineRequest(session_id=sid, view_id=again.view_id, prompt_tokens=again.estimate.total // 2)
    )
    assert truncated.truncated and not truncated.recorded
    # Marked truncated, unless the post-turn check has already compressed it (which clears the mark).
    got = stub.GetSession(pb.GetSessionRequest(session_id=sid))
    assert got.context_truncated or got.context_message_count < got.display_message_count

    free = stub.EstimateTokens(pb.EstimateTokensRequest(model="other", messages=[user("hello " * 100)]))
    assert free.estimate.total > 0 and free.estimate.method == r.ESTIMATE_METHOD_FALLBACK
    of_session = stub.EstimateTokens(pb.EstimateTokensRequest(session_id=sid, profile=profile))
    assert of_session.estimate.total > 0


def test_view_carries_image_bytes_and_prices_them(stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    png = _png(1024, 1024)
    stub.AppendMessages(
        pb.AppendMessagesRequest(
            session_id=sid, messages=[r.Message(role=r.ROLE_USER, content="look", images=[r.Image(data=png)])]
        )
    )
    view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=r.Profile(vision=True)))
    image = view.messages[0].images[0]
    assert image.data == png and image.mime_type == "image/png" and image.token_count == 1026
    assert (image.width, image.height) == (1024, 1024)
    assert view.estimate.images == 1026


def test_images_past_the_response_size_limit_are_left_out_with_a_notice(tmp_path: Path) -> None:
    """Three 3 MB screenshots fit the token budget (~1,000 tokens each) but not one 8 MiB response:
    the newest that fit the server's send limit are kept, the oldest is named in a notice (the
    view used to fail with RESOURCE_EXHAUSTED, 'Sent message larger than max', on every build)."""
    env = {"CONTEXTSVC_LIMITS__GRPC_MAX_SEND_BYTES": str(8 * 1024 * 1024)}
    shots = [_png(1024, 1024) + bytes([i]) * (3 * 1024 * 1024) for i in range(3)]  # header read, rest not
    with ServerProcess(f"files:{tmp_path / 'data'}", env=env).start() as server:
        opts = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        with grpc.insecure_channel(server.address, options=opts) as ch:
            stub = server.stub(ch)
            sid = stub.CreateSession(pb.CreateSessionRequest()).id
            for i, shot in enumerate(shots):
                image = r.Image(data=shot)
                stub.AppendMessages(
                    pb.AppendMessagesRequest(
                        session_id=sid, messages=[r.Message(role=r.ROLE_USER, content=f"screen {i}", images=[image])]
                    )
                )
            view = stub.BuildContext(
                pb.BuildContextRequest(session_id=sid, profile=r.Profile(vision=True, context_window=65536))
            )
    assert [len(m.images) for m in view.messages] == [0, 1, 1]  # no system prompt in the default profile
    assert [m.images[0].data for m in view.messages[1:]] == shots[1:]
    assert "response size limit" in view.messages[0].content and len(view.notices) == 1


def _ruled_log() -> str:
    lines: list[str] = []
    for i in range(300):
        lines += ["=" * 80, f"INFO step {i} completed in 0.{i} s"]
    return "\n".join(lines)


def test_an_honest_count_of_a_log_with_ruler_lines_is_not_taken_for_a_truncation(stub: Any) -> None:
    """A tool's log with 300 ruler lines of 80 ``=``: o200k, cl100k and Llama 3 all count its text
    as 4199 tokens (a ruler is one token in each; Claude's too). The truncation floor priced each
    ruler at ~7 tokens and put the fewest an honest count could be at 4724, so the real count was
    refused as a truncated prompt (and the session compacted regardless of its threshold)."""
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user(_ruled_log())]))
    profile = r.Profile(model="gpt-4o", context_window=131072)  # the log is not cut to a message budget
    view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile))
    honest = 4199 + 7  # the text's tokens and the chat framing of one message
    rec = stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id=view.view_id, prompt_tokens=honest))
    assert rec.recorded and not rec.truncated, rec.truncation_reason
    assert rec.lower_bound < honest


def test_context_too_large_is_failed_precondition_with_numbers(stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    pinned = r.Message(role=r.ROLE_USER, content="rule " * 2000, flags=r.MessageFlags(is_pinned=True))
    with pytest.raises(grpc.RpcError) as err:
        stub.BuildContext(
            pb.BuildContextRequest(session_id=sid, profile=r.Profile(context_window=1024), incoming=pinned)
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = error_details(err.value)
    assert details["reason"] == "CONTEXT_TOO_LARGE"
    assert int(details["metadata"]["estimate"]) > int(details["metadata"]["budget"]) == 1024 - 256


def test_bad_token_requests_are_invalid_argument(stub: Any) -> None:
    sid = stub.CreateSession(pb.CreateSessionRequest()).id
    cases = [
        (
            lambda: stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id="v", prompt_tokens=-1)),
            "prompt_tokens",
        ),
        (lambda: stub.EstimateTokens(pb.EstimateTokensRequest()), "messages"),
        (
            lambda: stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=r.Profile(context_window=10))),
            "profile.context_window",
        ),
        (
            lambda: stub.BuildContext(
                pb.BuildContextRequest(
                    session_id=sid, profile=r.Profile(compression=r.CompressionSettings(threshold=0.5, target=0.9))
                )
            ),
            "profile.compression",
        ),
        (
            lambda: stub.BuildContext(pb.BuildContextRequest(session_id=sid, incoming=r.Message(content="x"))),
            "incoming.role",
        ),
    ]
    for call, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field in error_details(err.value)["fields"], field
    with pytest.raises(grpc.RpcError) as err:
        stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id="unknown", prompt_tokens=5))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_details(err.value)["reason"] == "VIEW_NOT_FOUND"
