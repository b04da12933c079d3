"""The extractive summarizer: deterministic, readable, bounded, with a KEYS line (DESIGN §5.5)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from contextsvc.config import ExtractiveSummarizerConfig, Settings
from contextsvc.core.breadcrumbs import split_keys_line
from contextsvc.core.messages import Flags, ImageRef, Message, Role, ToolCall
from contextsvc.ports import Summarizer, SummarizerError, SummaryRequest
from contextsvc.summarizers.extractive import ExtractiveSummarizer


def _shell(call_id: str, command: str) -> ToolCall:
    return ToolCall(call_id, "shell", json.dumps({"command": command}))


def _session() -> list[Message]:
    rows = [
        Message(Role.USER, "Please fix the failing test in tests/unit/test_calc.py (ticket PROJ-42)."),
        Message(Role.ASSISTANT, "Running the tests first.", tool_calls=(_shell("c1", "pytest tests/unit -q"),)),
        Message(
            Role.TOOL,
            "collected 12 items\nFAILED tests/unit/test_calc.py::test_add - AssertionError: 3 != 4\n1 failed",
            tool_call_id="c1",
        ),
        Message(Role.ASSISTANT, "", tool_calls=(ToolCall("c2", "read_file", json.dumps({"path": "src/calc.py"})),)),
        Message(Role.TOOL, "def add(a, b):\n    return a + b + 1", tool_call_id="c2"),
        Message(Role.ASSISTANT, "", tool_calls=(ToolCall("c3", "read_file", json.dumps({"path": "src/util.py"})),)),
        Message(Role.TOOL, "No such file or directory: src/util.py", tool_call_id="c3"),
        Message(Role.ASSISTANT, "The root cause is an off-by-one in add(). Fixed src/calc.py; all 12 tests pass."),
        Message(Role.USER, "Thanks. What's the weather like?"),
        Message(Role.ASSISTANT, "I cannot check the weather from here."),
        Message(Role.USER, "Then bump the version to v1.4.0 and deploy it to https://staging.example.com"),
        Message(Role.ASSISTANT, "", tool_calls=(_shell("c4", "make release VERSION=1.4.0"),)),
        Message(Role.TOOL, "released", tool_call_id="c4"),
        Message(Role.ASSISTANT, "Done: v1.4.0 is deployed to staging."),
    ]
    return [_seq(m, i + 10) for i, m in enumerate(rows)]


def _seq(message: Message, sequence: int) -> Message:
    return Message(
        message.role,
        message.content,
        images=message.images,
        tool_calls=message.tool_calls,
        tool_call_id=message.tool_call_id,
        flags=message.flags,
        metadata=message.metadata,
        sequence_number=sequence,
    )


def _request(messages: list[Message], *, max_tokens: int = 6000, text: str = "") -> SummaryRequest:
    return SummaryRequest(messages=messages, text=text, instructions="ignored", max_tokens=max_tokens, temperature=0.3)


@pytest.fixture
def summarizer() -> ExtractiveSummarizer:
    return ExtractiveSummarizer.from_settings(Settings())


async def test_summary_tells_what_happened(summarizer: ExtractiveSummarizer) -> None:
    summary = await summarizer.summarize(_request(_session()))
    body, keys = split_keys_line(summary)
    lines = body.splitlines()
    assert lines[0] == "Summary of 14 earlier messages, #10..#23, 3 turns (extracted without a model)."
    assert "First request: Please fix the failing test in tests/unit/test_calc.py (ticket PROJ-42)." in lines
    assert "Latest request: Then bump the version to v1.4.0 and deploy it to https://staging.example.com" in lines
    assert "Other requests (1): Thanks. What's the weather like?" in lines
    # Final answers of every turn, and the decision-like sentence of a non-final one.
    assert "- The root cause is an off-by-one in add(). Fixed src/calc.py; all 12 tests pass." in lines
    assert "- I cannot check the weather from here." in lines
    assert "- Done: v1.4.0 is deployed to staging." in lines
    assert "Tools used: shell \u00d72, read_file \u00d72" in lines  # ties: first used first
    errors = lines[lines.index("Errors seen:") + 1 : lines.index("Errors seen:") + 3]
    assert errors == [
        "- shell: FAILED tests/unit/test_calc.py::test_add - AssertionError: 3 != 4",
        "- read_file: No such file or directory: src/util.py",
    ]
    assert "Files: tests/unit/test_calc.py, src/calc.py, src/util.py" in lines
    assert "Commands run: `pytest tests/unit -q`; `make release VERSION=1.4.0`" in lines
    # The last line is the KEYS line, and it names the facts.
    assert summary.splitlines()[-1].startswith("KEYS: ")
    for fact in ("PROJ-42", "src/calc.py", "pytest tests/unit -q", "v1.4.0", "https://staging.example.com"):
        assert fact in keys


async def test_same_input_same_summary(summarizer: ExtractiveSummarizer) -> None:
    first = await summarizer.summarize(_request(_session()))
    assert await summarizer.summarize(_request(_session())) == first
    assert await ExtractiveSummarizer.from_settings(Settings()).summarize(_request(_session())) == first


@pytest.mark.parametrize("max_tokens", [1, 64, 100, 300, 1000])
async def test_summary_fits_the_token_budget(summarizer: ExtractiveSummarizer, max_tokens: int) -> None:
    rows = _session() * 20  # plenty to say
    summary = await summarizer.summarize(_request(rows, max_tokens=max_tokens))
    budget = max(160, int(max_tokens * Settings().tokens.fallback_chars_per_token))
    assert len(summary) <= budget
    assert summary.splitlines()[0].startswith("Summary of 280 earlier messages")
    assert summary.splitlines()[-1].startswith("KEYS:")


async def test_a_bigger_budget_says_more(summarizer: ExtractiveSummarizer) -> None:
    rows = _session() * 20
    small = await summarizer.summarize(_request(rows, max_tokens=200))
    large = await summarizer.summarize(_request(rows, max_tokens=6000))
    assert len(large) > len(small)


async def test_an_earlier_summary_is_carried_with_its_keys(summarizer: ExtractiveSummarizer) -> None:
    old = Message(
        Role.USER,
        "- The team chose PostgreSQL for the archive.\nKEYS: archive-db; Aurora",
        flags=Flags(is_display=False, is_summary=True),
        metadata={"breadcrumbs": ["archive-db", "Aurora"]},
        sequence_number=3,
    )
    summary = await summarizer.summarize(_request([old, *_session()]))
    body, keys = split_keys_line(summary)
    assert "Earlier summary: - The team chose PostgreSQL for the archive." in body.splitlines()
    assert "KEYS: archive-db" not in body  # the old KEYS line is not repeated in the body
    assert keys[:2] == ["archive-db", "Aurora"]


async def test_limits_from_config_apply() -> None:
    config = ExtractiveSummarizerConfig(max_outcomes=1, max_errors=1, max_files=1, max_commands=1, quote_chars=40)
    summarizer = ExtractiveSummarizer(config)
    lines = (await summarizer.summarize(_request(_session()))).splitlines()
    outcomes = lines.index("Answers and decisions (newest first):")
    assert lines[outcomes + 1] == "- Done: v1.4.0 is deployed to staging."
    assert lines[outcomes + 2].startswith("Tools used:")
    errors = lines.index("Errors seen:")
    assert lines[errors + 1 : errors + 3] == ["- shell: FAILED tests…", "- … and 1 more"]  # quote_chars // 2
    assert "Files: tests/unit/test_calc.py" in lines
    assert "Commands run: `pytest tests/unit -q`" in lines
    first = next(line for line in lines if line.startswith("First request: "))
    assert len(first.removeprefix("First request: ")) == 40


async def test_images_are_counted(summarizer: ExtractiveSummarizer) -> None:
    shot = ImageRef(blob_id="b" * 64, mime_type="image/png", width=10, height=10)
    rows = [Message(Role.USER, "look at these", images=(shot, shot), sequence_number=1)]
    assert "Images shared: 2" in (await summarizer.summarize(_request(rows))).splitlines()


async def test_text_only_request_is_summarized(summarizer: ExtractiveSummarizer) -> None:
    summary = await summarizer.summarize(_request([], text="Two older summaries about src/a.py and ABC-9."))
    assert summary.splitlines()[0] == "Summary of earlier text (extracted without a model)."
    assert split_keys_line(summary)[1] == ["src/a.py", "ABC-9"]


async def test_nothing_to_summarize_is_a_summarizer_error(summarizer: ExtractiveSummarizer) -> None:
    with pytest.raises(SummarizerError, match="nothing to summarize"):
        await summarizer.summarize(_request([], text="   "))


async def test_summarizing_leaves_the_event_loop_free(
    summarizer: ExtractiveSummarizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A summary is CPU work (~0.1 s for a few hundred rows): other sessions' calls go on
    meanwhile. The summary here cannot finish until another task on the loop has run."""
    other_ran = threading.Event()
    plain = summarizer.summarize_sync

    def needs_the_loop(request: SummaryRequest) -> str:
        assert other_ran.wait(5), "nothing else ran on the event loop while summarizing"
        return plain(request)

    monkeypatch.setattr(summarizer, "summarize_sync", needs_the_loop)

    async def other() -> None:
        other_ran.set()

    summary, _ = await asyncio.gather(summarizer.summarize(_request(_session())), other())
    assert summary == plain(_request(_session()))


def test_implements_the_port() -> None:
    summarizer: Summarizer = ExtractiveSummarizer()
    assert (summarizer.name, summarizer.vision) == ("extractive", False)


def test_a_small_budget_keeps_the_newest_decision_rather_than_long_requests_alone() -> None:
    """On a small window the quoted requests filled the budget and the decisions after them were
    all cut: quotes shrink first, and the newest decision comes first."""
    messages: list[Message] = []
    for k in range(8):
        messages += [
            Message(Role.USER, f"Turn {k}: please look into the ingest lag on shard {k}. " + "Some context. " * 30),
            Message(Role.ASSISTANT, "", tool_calls=(_shell(f"c{k}", f"lagcheck --shard {k}"),)),
            Message(Role.TOOL, "lag within bounds", tool_call_id=f"c{k}"),
            Message(Role.ASSISTANT, f"We agreed to switch shard {k} to backend Q{k}. Done."),
        ]
    messages = [_seq(m, i + 1) for i, m in enumerate(messages)]
    summary = ExtractiveSummarizer.from_settings(Settings()).summarize_sync(_request(messages, max_tokens=300))
    assert len(summary) <= 300 * 1.8 + 1
    assert "First request: Turn 0" in summary
    assert "Answers and decisions (newest first):\n- We agreed to switch shard 7 to backend Q7." in summary
