"""The load suite's fresh copy of a context (bench/load/workload.fresh_copy): what the service
assigned is cleared and a stored record becomes a user message, so the copy can be appended to a
new session as the same conversation."""

from __future__ import annotations

import sys
from pathlib import Path

from contextsvc._gen.v1 import resources_pb2 as r

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "load"))
from workload import fresh_copy, provider_tokens  # (bench/load is not a package)


def test_a_fresh_copy_keeps_the_conversation_and_drops_what_the_service_assigned() -> None:
    summary = r.Message(
        role=r.ROLE_SYSTEM,
        content="[summary of #1-#40]",
        sequence_number=41,
        token_count=120,
        flags=r.MessageFlags(is_summary=True),
        replaces=r.SequenceRange(first=1, last=40),
    )
    summary.create_time.FromSeconds(1_700_000_000)
    call = r.Message(
        role=r.ROLE_ASSISTANT,
        content="",
        sequence_number=42,
        tool_calls=[r.ToolCall(id="c1", name="grep", arguments_json='{"q": "x"}')],
    )
    copied = fresh_copy([summary, call])

    assert [m.role for m in copied] == [r.ROLE_USER, r.ROLE_ASSISTANT]
    assert copied[0].content == "[summary of #1-#40]"
    for m in copied:
        assert m.sequence_number == 0 and m.token_count == 0
        assert not m.HasField("create_time") and not m.HasField("flags") and not m.HasField("replaces")
    assert list(copied[1].tool_calls) == list(call.tool_calls)
    # The rows given are left as they were (the source session's listing).
    assert summary.role == r.ROLE_SYSTEM and summary.sequence_number == 41 and summary.HasField("replaces")


def test_the_drivers_provider_count_is_a_function_of_the_text_alone() -> None:
    """The load suite's baselines (``provider_tokens``, the Go driver's ``providerTokens``): a
    token per 4 bytes of UTF-8, 4 per message, 3 more; what the service assigned or estimated
    plays no part, so a run cannot feed the service's estimate back to it."""
    plain = [r.Message(role=r.ROLE_USER, content="a" * 10), r.Message(role=r.ROLE_ASSISTANT, content="é" * 6)]
    assert provider_tokens(plain) == 3 + (10 // 4 + 4) + (12 // 4 + 4)  # "é" is 2 bytes
    assert provider_tokens([]) == 3
    priced = [r.Message(role=m.role, content=m.content, token_count=999, sequence_number=7) for m in plain]
    assert provider_tokens(priced) == provider_tokens(plain)


def test_the_suite_reads_the_langchain_comparisons_table() -> None:
    import run  # bench/load/run.py: the whole suite adds these figures to its notes

    table = "\n".join(
        [
            "| what | µs per call | / LangChain trim_messages |",
            "|---|---|---|",
            "| LangChain 1.8.3 `trim_messages` + `count_tokens_approximately` (201 kept) | 1,250 | 1.00 |",
            "| contextsvc `assemble`, cold (201 rows) | 1,271 | 5.08 |",
            "| contextsvc `assemble`, warm (201 rows) | 301 | 1.20 |",
            "| contextsvc `assemble`, extended (201 rows) | 57 | 0.23 |",
        ]
    )
    assert run.langchain_micros(table) == {"langchain": 1250.0, "cold": 1271.0, "warm": 301.0, "extended": 57.0}
    assert run.langchain_micros("Traceback (most recent call last):\n  pip failed") == {}
