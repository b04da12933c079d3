"""BuildContext never waits on a hanging summarizer past ``hot_path.build_wait_seconds`` (issue #15,
item 4): a post-turn compaction hangs in its summarizer call, and builds of that session still
answer within the bound, with a hard-truncated view that fits."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from tests.support.fake_llm import FakeLLM
from tests.support.rpc import assistant, tool, user
from tests.support.server import ServerProcess

WINDOW = 8192
BOUND_S = 0.5
#: What a loaded machine may add to the bound (one build of ~160 rows, the RPC, the scheduler).
SLACK_S = 2.5
HANG_S = 20.0


@pytest.fixture
def hanging(tmp_path: Path, llm: FakeLLM) -> Iterator[ServerProcess]:
    llm.reset()
    env = {
        "CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL": llm.base_url,
        "CONTEXTSVC_SUMMARIZER__OPENAI__TIMEOUT_SECONDS": "25",
        "CONTEXTSVC_SUMMARIZER__OPENAI__TOTAL_TIMEOUT_SECONDS": "30",
        "CONTEXTSVC_SUMMARIZER__OPENAI__MAX_RETRIES": "0",
        "CONTEXTSVC_HOT_PATH__BUILD_WAIT_SECONDS": str(BOUND_S),
    }
    with ServerProcess(f"files:{tmp_path / 'data'}", env=env).start() as proc:
        yield proc


def _profile() -> r.Profile:
    return r.Profile(
        model="m",
        context_window=WINDOW,
        compression=r.CompressionSettings(summarizer="openai", strategies=["summarize"]),
    )


def _fill(stub: object, sid: str, turns: int) -> None:
    batch: list[r.Message] = []
    for t in range(turns):
        batch += [
            user(f"turn {t}: inspect module_{t}.py"),
            assistant("", [(f"c{t}", "read_file")]),
            tool(f"c{t}", f"def handler_{t}():\n    return {t}\n" * 30),
            assistant(f"module_{t}.py defines handler_{t}"),
        ]
    for i in range(0, len(batch), 40):
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=batch[i : i + 40]))  # type: ignore[attr-defined]


def test_builds_do_not_wait_for_a_hanging_summarizer(hanging: ServerProcess, llm: FakeLLM) -> None:
    llm.control(mode="hang", hang_seconds=HANG_S)
    with hanging.channel() as ch:
        stub = hanging.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        # Remember the summarizing profile for the post-turn worker.
        stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=_profile(), auto_compress=False))
        _fill(stub, sid, 40)
        stub.AppendMessages(
            pb.AppendMessagesRequest(session_id=sid, messages=[assistant("turn done")], turn_complete=True)
        )
        # The post-turn compaction is now inside its summarizer call, which hangs.
        deadline = time.monotonic() + 15
        while not llm.requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llm.requests(), "the post-turn compaction never called the summarizer"
        hang_began = time.monotonic()

        for _ in range(3):
            started = time.monotonic()
            view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=_profile()), timeout=30)
            took = time.monotonic() - started
            assert took < BOUND_S + SLACK_S, f"BuildContext waited {took:.1f} s behind the summarizer"
            assert any("still running" in n for n in view.notices), list(view.notices)
            assert not view.compression.compressed  # this build committed nothing
            assert view.estimate.total <= WINDOW - min(2048, WINDOW // 4)
            # The fallback view is hard-truncated and legal: every tool result follows its call.
            pending: set[str] = set()
            for m in view.messages:
                if m.role == r.ROLE_TOOL:
                    assert m.tool_call_id in pending
                    pending.discard(m.tool_call_id)
                else:
                    pending = {c.id for c in m.tool_calls}

        # A build with a profile the session has not been built with yet remembers it, a state
        # write under the same lock: the bound covers that wait too (it once waited for the
        # whole summarizer call), and the whole build stays within it.
        for prompt in ("Be terse.", "Cite the log lines you rely on."):
            other = _profile()
            other.system_prompt = prompt
            started = time.monotonic()
            view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=other), timeout=30)
            took = time.monotonic() - started
            assert took < BOUND_S + SLACK_S, f"BuildContext with a new profile waited {took:.1f} s"
            assert any("still running" in n for n in view.notices), list(view.notices)

        # Appends are not held up either.
        started = time.monotonic()
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("next")]))
        assert time.monotonic() - started < SLACK_S
        # The summarizer is still hanging: the bound, not its end, released the builds.
        assert time.monotonic() - hang_began < HANG_S


def test_a_build_that_starts_the_compaction_waits_for_its_summarizer_only_up_to_the_bound(
    hanging: ServerProcess, llm: FakeLLM
) -> None:
    """No post-turn check runs here: the build itself finds the session over the threshold and
    starts the compaction (pre-turn). Its summarizer hangs a while, then answers: the build answers
    within the bound with a hard-truncated view, and the compaction, left running, commits its
    summary for the builds after it."""
    hang = 4.0
    llm.control(mode="hang", hang_seconds=hang)
    with hanging.channel() as ch:
        stub = hanging.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        _fill(stub, sid, 40)
        started = time.monotonic()
        view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=_profile()), timeout=30)
        took = time.monotonic() - started
        assert took < BOUND_S + SLACK_S, f"BuildContext waited {took:.1f} s for its own compaction's summarizer"
        assert llm.requests(), "the build did not start a compaction"
        assert any("still running" in n for n in view.notices), list(view.notices)
        assert not view.compression.compressed  # committed later, by the compaction itself
        assert view.estimate.total <= WINDOW - min(2048, WINDOW // 4)
        # The summarizer answers after its hang: the compaction it was part of commits its summary.
        deadline = time.monotonic() + hang + 20
        summarized = False
        while not summarized and time.monotonic() < deadline:
            time.sleep(0.2)
            later = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=_profile()), timeout=30)
            summarized = any(m.flags.is_summary for m in later.messages)
        assert summarized, "the compaction left running never committed its summary"
        assert not any("still running" in n for n in later.notices)
