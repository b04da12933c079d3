"""The HTTP summarizers against a real fake-LLM process over loopback (DESIGN §5.5, §8).

Both protocols (OpenAI-compatible and Ollama) on the same scripts: a good answer, a 500 then a
good answer, a hang, garbage, a summary without KEYS; and the request bodies they send.
"""

from __future__ import annotations

import base64
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from contextsvc.config import OllamaSummarizerConfig, OpenAISummarizerConfig, Settings, SummarizerSettings
from contextsvc.core.breadcrumbs import split_keys_line
from contextsvc.ports import Summarizer, SummarizerError, SummarizerUnavailable, SummaryRequest
from contextsvc.summarizers import SummarizerSet, build_summarizers
from contextsvc.summarizers._http import streamed_events
from tests.support.fake_llm import FakeLLM
from tests.support.server import closed_port

pytestmark = pytest.mark.e2e

PROTOCOLS = ["openai", "ollama"]
PATHS = {"openai": "/v1/chat/completions", "ollama": "/api/chat"}
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 24
JPEG = b"\xff\xd8\xff\xe0" + b"\x01" * 24
TEXT = "[user] Please fix src/app/calc.py for ticket PROJ-42\n[assistant] Fixed it in CalcEngine."


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeLLM]:
    with FakeLLM(max_lifetime=300) as server:
        yield server


@pytest.fixture(autouse=True)
def _fresh(fake: FakeLLM) -> None:
    fake.reset()


def _settings(base_url: str, **endpoint: Any) -> Settings:
    """Short timeouts so failure tests stay fast; ``endpoint`` overrides both protocols' configs."""
    common: dict[str, Any] = {
        "base_url": base_url,
        "model": "summary-model",
        "timeout_seconds": 2.0,
        "connect_timeout_seconds": 1.0,
        "total_timeout_seconds": 8.0,
        "max_retries": 1,
        "retry_backoff_seconds": 0.01,
        **endpoint,
    }
    openai_only = {k: common.pop(k) for k in ("api_key",) if k in common}
    ollama_only = {k: common.pop(k) for k in ("num_ctx",) if k in common}
    return Settings(
        summarizer=SummarizerSettings(
            openai=OpenAISummarizerConfig(**common, **openai_only),
            ollama=OllamaSummarizerConfig(**common, **ollama_only),
        )
    )


@pytest.fixture
async def make_set(fake: FakeLLM) -> AsyncIterator[Any]:
    built: list[SummarizerSet] = []

    def make(**endpoint: Any) -> SummarizerSet:
        summarizers = build_summarizers(_settings(endpoint.pop("base_url", fake.base_url), **endpoint))
        built.append(summarizers)
        return summarizers

    yield make
    for summarizers in built:
        await summarizers.close()


def _request(*, images: tuple[bytes, ...] = (), max_tokens: int = 321, temperature: float = 0.25) -> SummaryRequest:
    return SummaryRequest(
        messages=(),
        text=TEXT,
        instructions="Summarize. End with a KEYS: line.",
        max_tokens=max_tokens,
        temperature=temperature,
        images=images,
    )


def _only_request(fake: FakeLLM, protocol: str) -> dict[str, Any]:
    recorded = fake.requests()
    assert [r["path"] for r in recorded] == [PATHS[protocol]]
    body: dict[str, Any] = recorded[0]["body"]
    return body


# --- good answers and what was sent ---------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_ok_returns_the_summary_with_keys(fake: FakeLLM, make_set: Any, protocol: str) -> None:
    summarizer: Summarizer = make_set().get(protocol)
    summary = await summarizer.summarize(_request())
    text, keys = split_keys_line(summary)
    assert "It began with: [user] Please fix src/app/calc.py for ticket PROJ-42" in text
    assert keys == ["src/app/calc.py", "PROJ-42", "CalcEngine"]
    assert len(fake.requests()) == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_summary_that_is_no_valid_text_is_made_storable(fake: FakeLLM, make_set: Any, protocol: str) -> None:
    """A lone surrogate (valid JSON, no UTF-8) once committed as a summary failed every later read
    of its session as INTERNAL; it becomes U+FFFD, and a NUL (PostgreSQL's text refuses it) goes, as
    do a model's terminal escapes and control characters."""
    fake.set_mode("surrogate")
    summary = await make_set().get(protocol).summarize(_request())
    assert "Odd \ufffd bytes here." in summary and "\x00" not in summary
    # Terminal escapes and other control characters go; line breaks stay.
    assert "- Tty red text.\n" in summary
    summary.encode("utf-8")  # raises on a lone surrogate
    assert split_keys_line(summary)[1] == ["src/app/calc.py", "PROJ-42", "CalcEngine"]


async def test_openai_request_body(fake: FakeLLM, make_set: Any) -> None:
    await make_set(api_key="sk-test").get("openai").summarize(_request())
    recorded = fake.requests()[0]
    assert recorded["headers"]["Authorization"] == "Bearer sk-test"
    assert recorded["body"] == {
        "model": "summary-model",
        "messages": [
            {"role": "system", "content": "Summarize. End with a KEYS: line."},
            {"role": "user", "content": TEXT},
        ],
        "max_tokens": 321,
        "temperature": 0.25,
        "stream": False,
    }


async def test_openai_without_key_sends_no_authorization(fake: FakeLLM, make_set: Any) -> None:
    await make_set().get("openai").summarize(_request())
    assert "Authorization" not in fake.requests()[0]["headers"]


async def test_ollama_request_body(fake: FakeLLM, make_set: Any) -> None:
    await make_set(num_ctx=16384).get("ollama").summarize(_request())
    assert _only_request(fake, "ollama") == {
        "model": "summary-model",
        "messages": [
            {"role": "system", "content": "Summarize. End with a KEYS: line."},
            {"role": "user", "content": TEXT},
        ],
        "stream": False,
        "think": False,
        "options": {"temperature": 0.25, "num_predict": 321, "num_ctx": 16384},
    }


async def test_ollama_num_ctx_zero_leaves_the_server_default(fake: FakeLLM, make_set: Any) -> None:
    await make_set(num_ctx=0).get("ollama").summarize(_request())
    assert _only_request(fake, "ollama")["options"] == {"temperature": 0.25, "num_predict": 321}


async def test_openai_vision_sends_images_as_data_urls(fake: FakeLLM, make_set: Any) -> None:
    summary = await make_set(vision=True).get("openai").summarize(_request(images=(PNG, JPEG)))
    assert "Images seen: 2" in summary
    content = _only_request(fake, "openai")["messages"][-1]["content"]
    assert content[0] == {"type": "text", "text": TEXT}
    urls = [part["image_url"]["url"] for part in content[1:]]
    assert urls == [
        "data:image/png;base64," + base64.b64encode(PNG).decode(),
        "data:image/jpeg;base64," + base64.b64encode(JPEG).decode(),
    ]


async def test_ollama_vision_sends_base64_images(fake: FakeLLM, make_set: Any) -> None:
    summary = await make_set(vision=True).get("ollama").summarize(_request(images=(PNG, JPEG)))
    assert "Images seen: 2" in summary
    user = _only_request(fake, "ollama")["messages"][-1]
    assert [base64.b64decode(i) for i in user["images"]] == [PNG, JPEG]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_without_vision_images_stay_home(fake: FakeLLM, make_set: Any, protocol: str) -> None:
    summarizer = make_set(vision=False).get(protocol)
    assert summarizer.vision is False
    summary = await summarizer.summarize(_request(images=(PNG,)))
    assert "Images seen: 0" in summary
    user = _only_request(fake, protocol)["messages"][-1]
    assert user == {"role": "user", "content": TEXT}


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_no_keys_still_returns_the_text(fake: FakeLLM, make_set: Any, protocol: str) -> None:
    fake.set_mode("no_keys")
    summary = await make_set().get(protocol).summarize(_request())
    text, keys = split_keys_line(summary)
    assert keys == [] and text == summary
    assert "It began with: [user] Please fix" in summary


# --- failures -------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_500_is_retried_then_succeeds(fake: FakeLLM, make_set: Any, protocol: str) -> None:
    fake.set_mode("fail", then="ok")
    summary = await make_set(max_retries=1).get(protocol).summarize(_request())
    assert "KEYS: src/app/calc.py" in summary
    assert [r["path"] for r in fake.requests()] == [PATHS[protocol]] * 2


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_retries_are_bounded(fake: FakeLLM, make_set: Any, protocol: str) -> None:
    fake.set_mode("fail")
    with pytest.raises(SummarizerError, match=r"failed after 3 attempts; last: HTTP 500: .*scripted failure"):
        await make_set(max_retries=2).get(protocol).summarize(_request())
    assert len(fake.requests()) == 3


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_429_is_retried_after_the_pause_its_retry_after_asks(
    fake: FakeLLM, make_set: Any, protocol: str
) -> None:
    fake.set_mode("rate_limited", then="ok")  # 429 with Retry-After: 1
    started = time.monotonic()
    summary = await make_set(max_retries=1, retry_backoff_seconds=0.01).get(protocol).summarize(_request())
    assert "KEYS: src/app/calc.py" in summary
    assert len(fake.requests()) == 2
    assert time.monotonic() - started >= 0.95  # the endpoint's pause, not the 0.01 s backoff


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_retry_after_past_the_whole_call_fails_at_once(fake: FakeLLM, make_set: Any, protocol: str) -> None:
    fake.set_mode("rate_limited")
    summarizer = make_set(max_retries=3, total_timeout_seconds=0.8).get(protocol)
    started = time.monotonic()
    with pytest.raises(SummarizerError, match=r"HTTP 429: .*Retry-After 1s runs past the call's 0.8s"):
        await summarizer.summarize(_request())
    assert time.monotonic() - started < 0.7  # not slept into the timeout
    assert len(fake.requests()) == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_4xx_is_not_retried(fake: FakeLLM, make_set: Any, protocol: str) -> None:
    fake.set_mode("bad_request")
    with pytest.raises(SummarizerError, match=r"HTTP 400 \(not retried\): .*scripted bad request"):
        await make_set(max_retries=3).get(protocol).summarize(_request())
    assert len(fake.requests()) == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_hang_times_out(fake: FakeLLM, make_set: Any, protocol: str) -> None:
    fake.set_mode("hang", hang_seconds=10)
    summarizer = make_set(timeout_seconds=0.5, max_retries=0).get(protocol)
    started = time.monotonic()
    with pytest.raises(SummarizerError, match=r"failed after 1 attempt; last: timed out \(ReadTimeout, 0.5s"):
        await summarizer.summarize(_request())
    assert time.monotonic() - started < 5  # the 10 s hang was not waited out


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_total_timeout_bounds_all_retries(fake: FakeLLM, make_set: Any, protocol: str) -> None:
    fake.set_mode("hang", hang_seconds=10)
    summarizer = make_set(timeout_seconds=0.4, total_timeout_seconds=1.0, max_retries=10).get(protocol)
    started = time.monotonic()
    with pytest.raises(SummarizerError, match=r"no answer within 1s \(the whole call, retries included\)"):
        await summarizer.summarize(_request())
    assert time.monotonic() - started < 5
    assert 2 <= len(fake.requests()) <= 4  # retried, but only inside the total budget


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_no_answer_at_all_is_unavailable_any_answer_is_not(fake: FakeLLM, make_set: Any, protocol: str) -> None:
    """A hang (per attempt or the whole call) and nobody listening say the endpoint is unavailable,
    so the engine does not call it again at once; an answer that was wrong (a 500 to the last
    retry, a 400, garbage) is a plain failure, which a second try with another input may mend."""
    fake.set_mode("hang", hang_seconds=10)
    for bounds in ({"timeout_seconds": 0.3, "max_retries": 1}, {"timeout_seconds": 5, "total_timeout_seconds": 0.5}):
        with pytest.raises(SummarizerUnavailable):
            await make_set(**bounds).get(protocol).summarize(_request())
    with pytest.raises(SummarizerUnavailable, match="connection failed"):
        await make_set(base_url=f"http://127.0.0.1:{closed_port()}", max_retries=1).get(protocol).summarize(_request())
    for mode in ("fail", "bad_request", "garbage"):
        fake.set_mode(mode)
        with pytest.raises(SummarizerError) as failed:
            await make_set(max_retries=1).get(protocol).summarize(_request())
        assert not isinstance(failed.value, SummarizerUnavailable), mode


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_answer_past_max_answer_bytes_fails_without_being_read_whole(
    fake: FakeLLM, make_set: Any, protocol: str
) -> None:
    """A runaway answer (4 MB here; an endless body alike) was read whole into memory before anything
    looked at it. Past ``max_answer_bytes`` the call fails at once, and is not asked again."""
    fake.set_mode("huge")
    summarizer = make_set(max_answer_bytes=64 * 1024, max_retries=2).get(protocol)
    with pytest.raises(SummarizerError, match=r"the answer is longer than 65536 bytes \(max_answer_bytes\)"):
        await summarizer.summarize(_request())
    assert len(fake.requests()) == 1
    fake.set_mode("ok")  # an answer under the cap is read as before
    assert "KEYS: src/app/calc.py" in await summarizer.summarize(_request())


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("mode", ["chunked", "text_plain", "dribble"])
async def test_an_answer_chunked_mislabelled_or_dribbled_is_read(
    fake: FakeLLM, make_set: Any, protocol: str, mode: str
) -> None:
    fake.set_mode(mode, hang_seconds=0.5)
    assert "KEYS: src/app/calc.py" in await make_set().get(protocol).summarize(_request())


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_answer_streamed_although_stream_false_was_asked_is_assembled(
    fake: FakeLLM, make_set: Any, protocol: str
) -> None:
    """Some servers and proxies always stream (SSE chunks; Ollama's JSON lines): the answer was
    refused as "not JSON" and every compaction fell back to dropping whole turns."""
    fake.set_mode("sse")
    summary = await make_set().get(protocol).summarize(_request())
    assert summary.startswith("- The conversation covered ")
    assert "KEYS: src/app/calc.py" in summary


@pytest.mark.parametrize(
    ("protocol", "events", "problem"),
    [
        ("openai", 'data: {"choices": [{"index": 0, "delta": {"content": "- half"}}]}\n\n', "without a finish_reason"),
        ("ollama", '{"message": {"content": "- half"}, "done": false}\n', "ended before done: true"),
        ("openai", 'data: {"error": {"message": "overloaded"}}\n\n', "reported an error: .*overloaded"),
    ],
)
async def test_a_streamed_answer_cut_before_its_end_is_a_summarizer_error(
    make_set: Any, protocol: str, events: str, problem: str
) -> None:
    summarizer = make_set().get(protocol)
    streamed = streamed_events(events)
    assert streamed is not None
    with pytest.raises(SummarizerError, match=problem):
        summarizer._content(summarizer._assembled(streamed))


def test_what_is_no_stream_stays_no_json() -> None:
    assert streamed_events("<html>this is not JSON {") is None
    assert streamed_events("data: [DONE]\n\n") is None  # no event at all
    assert streamed_events('[1, 2]\n{"a": 1}') is None  # a line that is no JSON object


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_reasoning_before_the_summary_is_left_out_and_reasoning_alone_is_no_summary(
    fake: FakeLLM, make_set: Any, protocol: str
) -> None:
    """A reasoning model served without a reasoning parser puts ``<think>…</think>`` before its
    answer; when its output cap runs out while it still thinks, only the unclosed block comes
    back, and was stored as the summary (sent in every later view)."""
    summarizer = make_set().get(protocol)
    fake.set_mode("think")
    summary = await summarizer.summarize(_request())
    assert summary.startswith("- The conversation covered ") and "<think>" not in summary
    fake.set_mode("think_cut")
    with pytest.raises(
        SummarizerError, match=r"reasoning only \(a <think> block never closed\) \((finish|done)_reason"
    ):
        await summarizer.summarize(_request())


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_body_cut_off_by_a_closed_connection_is_retried(fake: FakeLLM, make_set: Any, protocol: str) -> None:
    fake.set_mode("cut_body", then="ok")
    assert "KEYS: src/app/calc.py" in await make_set(max_retries=1).get(protocol).summarize(_request())
    assert len(fake.requests()) == 2


@pytest.mark.parametrize(
    ("mode", "problem"),
    [
        ("garbage", r"the answer is not JSON: <html>this is not JSON \{"),
        ("wrong_shape", r"the answer has no (choices|message)"),
        ("empty", r"the answer's content is empty \((finish|done)_reason=stop\)"),
    ],
)
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_garbage_is_a_summarizer_error(
    fake: FakeLLM, make_set: Any, protocol: str, mode: str, problem: str
) -> None:
    fake.set_mode(mode)
    who = rf"^{protocol} summarizer \(http://127\.0\.0\.1:\d+{PATHS[protocol]}\): "
    with pytest.raises(SummarizerError, match=who):
        await make_set(max_retries=2).get(protocol).summarize(_request())
    with pytest.raises(SummarizerError, match=problem):
        await make_set(max_retries=2).get(protocol).summarize(_request())
    assert len(fake.requests()) == 2  # garbage is final: no retries


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("mode", ["echo_key", "echo_key_ok"])
async def test_a_key_the_endpoint_echoes_never_reaches_the_error(
    fake: FakeLLM, make_set: Any, protocol: str, mode: str
) -> None:
    """Providers answer a wrong key with "Incorrect API key provided: sk-…"; the error message is
    logged ("summarizer failed; falling back") and once carried the key verbatim. The OpenAI key
    goes as a Bearer token, a password in ``base_url`` as httpx's Basic credential."""
    fake.set_mode(mode)
    if protocol == "openai":
        secret, summarizers = "sk-echo-secret-123456", make_set(api_key="sk-echo-secret-123456")
    else:
        host = fake.base_url.removeprefix("http://")
        secret, summarizers = "pw-echo-secret-7890", make_set(base_url=f"http://probe:pw-echo-secret-7890@{host}")
    with pytest.raises(SummarizerError) as caught:
        await summarizers.get(protocol).summarize(_request())
    message = str(caught.value)
    sent = fake.requests()[0]["headers"]["Authorization"]
    assert sent == f"Bearer {secret}" if protocol == "openai" else sent.startswith("Basic ")
    assert "Incorrect API key provided: ***" in message, message
    assert secret not in message and sent.split()[-1] not in message


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_nobody_listening_is_a_summarizer_error(make_set: Any, protocol: str) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    summarizer = make_set(base_url=f"http://127.0.0.1:{port}", max_retries=2).get(protocol)
    with pytest.raises(SummarizerError, match=r"failed after 3 attempts; last: connection failed \(ConnectError"):
        await summarizer.summarize(_request())


async def test_the_fake_can_script_a_sequence(fake: FakeLLM, make_set: Any) -> None:
    fake.control(modes=["fail", "fail"], mode="no_keys")
    summary = await make_set(max_retries=2).get("ollama").summarize(_request())
    assert split_keys_line(summary)[1] == []
    assert len(fake.requests()) == 3


async def test_one_client_shared_and_closed_once(fake: FakeLLM) -> None:
    summarizers = build_summarizers(_settings(fake.base_url))
    await summarizers.get("openai").summarize(_request())
    await summarizers.get("ollama").summarize(_request())
    client = summarizers._client
    assert client is not None and not client.is_closed
    await summarizers.close()
    assert client.is_closed
    await summarizers.close()  # idempotent
    with pytest.raises(SummarizerError, match="closed"):
        await summarizers.get("openai").summarize(_request())


async def test_the_http_client_is_made_on_the_first_http_summary(fake: FakeLLM) -> None:
    made: list[httpx.AsyncClient] = []
    real = httpx.AsyncClient

    class Counted(real):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(httpx, "AsyncClient", Counted)
        summarizers = build_summarizers(_settings(fake.base_url))
        await summarizers.get("extractive").summarize(_request())
        assert made == []  # starting, or summarizing without HTTP, makes no client
        await summarizers.get("openai").summarize(_request())
        await summarizers.get("ollama").summarize(_request())
        assert len(made) == 1  # one, shared
        await summarizers.close()
        assert made[0].is_closed


async def test_closed_before_any_http_summary_makes_no_client(fake: FakeLLM) -> None:
    summarizers = build_summarizers(_settings(fake.base_url))
    await summarizers.close()
    with pytest.raises(SummarizerError, match="closed"):
        await summarizers.get("openai").summarize(_request())
    assert summarizers._client is not None and summarizers._client._client is None
    assert fake.requests() == []


def test_a_compaction_whose_summary_is_no_valid_text_leaves_the_session_readable(fake: FakeLLM, tmp_path: Any) -> None:
    """Through a real server: the compaction commits the cleaned summary, and every read of the
    session (both buffers, a build, the session) answers, where each was INTERNAL for good."""
    from contextsvc._gen.v1 import context_service_pb2 as pb
    from contextsvc._gen.v1 import resources_pb2 as r
    from tests.support.rpc import all_messages, assistant, user
    from tests.support.server import ServerProcess

    fake.set_mode("surrogate")
    env = {"CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL": fake.base_url}
    profile = r.Profile(
        context_window=8192, compression=r.CompressionSettings(summarizer="openai", strategies=["summarize"])
    )
    with ServerProcess(f"files:{tmp_path / 'data'}", env=env).start() as server, server.channel() as ch:
        stub = server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        for t in range(12):
            stub.AppendMessages(
                pb.AppendMessagesRequest(
                    session_id=sid, messages=[user(f"question {t} about PROJ-{t} " + "w " * 200), assistant(f"ok {t}")]
                )
            )
        done = stub.Compress(pb.CompressRequest(session_id=sid, profile=profile), timeout=60)
        assert done.compressed and "\ufffd" in done.summary
        assert stub.GetSession(pb.GetSessionRequest(session_id=sid)).display_message_count == 24 + 1
        context = all_messages(stub, sid, buffer=pb.BUFFER_CONTEXT)
        assert any(m.flags.is_summary and "\ufffd" in m.content for m in context)
        assert len(all_messages(stub, sid)) == 25
        view = stub.BuildContext(pb.BuildContextRequest(session_id=sid, profile=profile))
        assert any("\ufffd" in m.content for m in view.messages)
    assert "Traceback" not in server.stderr_text


def _compacted_session(fake: FakeLLM, tmp_path: Any, mode: str) -> Any:
    """A real server, one session of 12 long turns, one forced compaction with the fake in
    ``mode``; yields (stub, session id, the Compress response)."""
    from contextsvc._gen.v1 import context_service_pb2 as pb
    from contextsvc._gen.v1 import resources_pb2 as r
    from tests.support.rpc import assistant, user
    from tests.support.server import ServerProcess

    fake.set_mode(mode)
    env = {"CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL": fake.base_url}
    profile = r.Profile(context_window=8192, compression=r.CompressionSettings(summarizer="openai"))
    with ServerProcess(f"files:{tmp_path / 'data'}", env=env).start() as server, server.channel() as ch:
        stub = server.stub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest()).id
        for t in range(12):  # ~3,600 chars a turn: the formatted input is over the 32,000-char cap
            ask = f"question {t} about PROJ-{t} in src/mod{t}/main.py zqword{t} " + "w " * 1750
            stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user(ask), assistant(f"ok {t}")]))
        done = stub.Compress(pb.CompressRequest(session_id=sid, profile=profile), timeout=60)
        yield stub, sid, done
    assert "Traceback" not in server.stderr_text


def test_a_fenced_summary_is_stored_without_its_fence_and_the_input_keeps_its_cap(fake: FakeLLM, tmp_path: Any) -> None:
    """A model that wraps its answer in ```markdown … ``` once had the fence stored in the summary
    every later view sends; and the fact lines sent after the rows took the input past 32,000."""
    from contextsvc._gen.v1 import context_service_pb2 as pb
    from contextsvc._gen.v1 import events_pb2 as ev
    from tests.support.rpc import all_messages

    for stub, sid, done in _compacted_session(fake, tmp_path, "fenced"):
        assert done.compressed and done.method == ev.COMPRESSION_METHOD_SUMMARY
        assert "```" not in done.summary and done.summary.startswith("- The conversation covered")
        assert "PROJ-0" in done.breadcrumbs  # the KEYS line inside the fence was still split off
        summary = next(m for m in all_messages(stub, sid, buffer=pb.BUFFER_CONTEXT) if m.flags.is_summary)
        assert "```" not in summary.content and "KEYS:" not in summary.content
        sent = fake.requests()[0]["body"]["messages"][-1]["content"]
        assert "Keep these facts in the summary" in sent and "chars of the middle omitted" in sent
        assert len(sent) <= 32_000
        expanded = stub.ExpandSummary(pb.ExpandSummaryRequest(session_id=sid, sequence_number=summary.sequence_number))
        assert len(expanded.messages) == 22


def test_a_refusal_is_not_stored_as_the_summary(fake: FakeLLM, tmp_path: Any) -> None:
    """ "I'm sorry, but I can't help with that." once became the summary standing for every dropped
    turn; the documented fallback runs instead, and what was dropped stays searchable."""
    from contextsvc._gen.v1 import context_service_pb2 as pb
    from contextsvc._gen.v1 import events_pb2 as ev
    from tests.support.rpc import all_messages

    for stub, sid, done in _compacted_session(fake, tmp_path, "refusal"):
        assert done.compressed and done.method == ev.COMPRESSION_METHOD_HARD_TRUNCATE
        assert fake.requests(), "the summarizer was asked"
        context = all_messages(stub, sid, buffer=pb.BUFFER_CONTEXT)
        assert not any("sorry" in m.content.lower() for m in context)
        hits = stub.SearchHistory(pb.SearchHistoryRequest(session_id=sid, query="zqword0")).chunks
        assert hits and "zqword0" in hits[0].text
