"""The summarizer input, the prompts and the KEYS line (contextsvc.core.compression.formatting)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextsvc.config import SummarizerSettings
from contextsvc.core.compression import (
    DEFAULT_SUMMARY_PROMPT,
    META_SUMMARY_PROMPT,
    format_for_summary,
    format_meta_summary_input,
    is_refusal,
    needs_meta_summary,
    split_keys,
    summary_instructions,
    summary_parts,
    unfence,
)
from contextsvc.core.compression.formatting import (
    CUT_MARKER,
    cap_result,
    cap_text,
    cut_summary_text,
    head_tail,
    preview,
    preview_args,
)
from contextsvc.core.facts import carried_facts, facts_block
from contextsvc.core.messages import Flags, ImageRef, Message, Role, ToolCall
from tests.support.message_strategies import assistant, numbered, record, summary, tool, user

S = SummarizerSettings()


def test_the_caps_come_from_settings() -> None:
    assert (S.args_preview_chars, S.result_preview_chars, S.critical_result_chars) == (120, 800, 4000)
    assert (S.input_cap_chars, S.input_head_share, S.meta_summary_chars) == (32_000, 0.75, 10_600)
    assert S.image_budget_fraction == 0.25


def only_block(rows: list[Message], **kw: object) -> str:
    """The body of the last block of the formatted input (header line removed)."""
    text = format_for_summary(numbered(rows), window=32768, **kw).text  # type: ignore[arg-type]
    return text.split("\n\n")[-1].split("\n", 1)[1]


# --- tool calls ------------------------------------------------------------------------------


@pytest.mark.parametrize(("length", "expected"), [(10, 10), (120, 120), (121, 120), (5000, 120)])
def test_call_arguments_are_previewed_in_at_most_120_chars(length: int, expected: int) -> None:
    args = '{"q": "' + "a" * (length - 9) + '"}'
    assert len(args) == length
    out = preview_args(args)
    assert len(out) == expected
    assert out == args if length <= 120 else out == args[:119] + "…"
    call = Message(role=Role.ASSISTANT, tool_calls=(ToolCall(id="c1", name="search", arguments_json=args),))
    line = format_for_summary([call], window=32768).text.splitlines()[-1]
    assert line == f"→ search({out})"


def test_call_arguments_are_put_on_one_line() -> None:
    assert preview_args('{\n  "a": 1,\n  "b": 2\n}') == '{ "a": 1, "b": 2 }'


# --- tool results ----------------------------------------------------------------------------


@pytest.mark.parametrize(("length", "expected"), [(10, 10), (800, 800), (801, 800), (100_000, 800)])
def test_ordinary_results_are_cut_to_800_chars(length: int, expected: int) -> None:
    text = "r" * length
    body = only_block([user(), assistant("", "c1"), tool("c1", text)])
    assert len(body) == expected
    if length > 800:
        assert body.startswith("r" * 700) and body.endswith(f" … [{length} chars]")


@pytest.mark.parametrize("length", [100, 3999, 4000])
def test_critical_results_up_to_4000_chars_are_verbatim(length: int) -> None:
    text = "".join(chr(97 + k % 26) for k in range(length))
    flagged = dataclasses.replace(tool("c1", text), flags=Flags(is_compression_critical=True))
    assert only_block([user(), assistant("", "c1"), flagged]) == text


@pytest.mark.parametrize("length", [4001, 10_000])
def test_longer_critical_results_keep_head_2000_and_tail_2000(length: int) -> None:
    text = "".join(chr(97 + k % 26) for k in range(length))
    flagged = dataclasses.replace(tool("c1", text), flags=Flags(is_compression_critical=True))
    body = only_block([user(), assistant("", "c1"), flagged])
    head, marker, tail = body.split("\n")
    assert head == text[:2000] and tail == text[-2000:]
    assert marker == f"[… {length - 4000} chars omitted …]"
    assert cap_result(text, critical=True) == body


def test_a_critical_tool_name_makes_a_result_critical_by_its_call() -> None:
    text = "z" * 3000
    rows = [user(), assistant("", "c1"), tool("c1", text)]  # the builders name the call tool_c1
    assert only_block(rows, critical_tool_names=("tool_c1",)) == text
    assert len(only_block(rows)) == 800
    named = dataclasses.replace(tool("c1", text), name="read_spec")
    assert only_block([user(), named], critical_tool_names=("read_spec",)) == text


def test_result_headers_say_what_they_are() -> None:
    rows = [user("do it"), assistant("", "c1"), tool("c1", "ok"), record("task_note", "deploy friday")]
    text = format_for_summary(numbered(rows), window=32768, critical_tool_names=("tool_c1",)).text
    blocks = text.split("\n\n")
    assert blocks[0] == "[#1 user]\ndo it"
    assert blocks[1] == "[#2 assistant]\n→ tool_c1({})"
    assert blocks[2] == "[#3 critical tool result: tool_c1]\nok"
    assert blocks[3] == "[#4 note: task_note]\ndeploy friday"


def test_thinking_is_left_out() -> None:
    m = dataclasses.replace(assistant("answer"), thinking="secret chain of thought")
    assert "secret" not in format_for_summary([m], window=32768).text


# --- summaries -------------------------------------------------------------------------------


def test_an_older_summary_is_labelled_with_its_range() -> None:
    old = dataclasses.replace(summary("facts so far"), replaces=(1, 40))
    text = format_for_summary(numbered([old, user("next")], first=41), window=32768).text
    assert text.startswith("[#41 earlier summary of #1-#40]\nfacts so far")


def test_merged_summaries_replace_the_old_ones_in_place() -> None:
    rows = numbered([summary("one"), summary("two"), user("next")])
    text = format_for_summary(rows, window=32768, merged_summary="one and two").text
    assert text == "[earlier summaries, merged]\none and two\n\n[#3 user]\nnext"


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ((5300, 5300), False),  # exactly 10,600: not more than the threshold
        ((5300, 5301), True),
        ((20_000,), False),  # one summary is not "several"
        ((4000, 4000, 2601), True),
        ((100, 100), False),
    ],
)
def test_meta_summary_is_needed_above_10600_chars_of_several_summaries(sizes: tuple[int, ...], expected: bool) -> None:
    assert needs_meta_summary([summary("s" * n) for n in sizes]) is expected


def test_the_meta_summary_request_labels_each_summary_oldest_first() -> None:
    rows = [dataclasses.replace(summary("first"), replaces=(1, 9)), summary("second")]
    text = format_meta_summary_input(rows)
    assert text == "[summary 1 of 2 of #1-#9]\nfirst\n\n[summary 2 of 2]\nsecond"
    assert "KEYS:" in META_SUMMARY_PROMPT


# --- images ----------------------------------------------------------------------------------


def shot(n: int, side: int = 1024) -> ImageRef:
    return ImageRef(blob_id=f"{n:064x}", mime_type="image/png", width=side, height=side)  # 1026 tokens


def with_images(*refs: ImageRef, content: str = "look") -> Message:
    return dataclasses.replace(user(content), images=refs)


@pytest.mark.parametrize(("window", "attached"), [(8207, 1), (8208, 2), (4 * 3078, 3), (1000, 0)])
def test_images_fit_a_quarter_of_the_window_newest_first(window: int, attached: int) -> None:
    rows = numbered([with_images(shot(1)), with_images(shot(2)), with_images(shot(3))])
    out = format_for_summary(rows, window=window, vision=True)
    expected = [f"{n:064x}" for n in (1, 2, 3)][3 - attached :]
    assert list(out.image_blob_ids) == expected
    assert out.images_omitted == 3 - attached
    assert out.text.count("[1 image(s) attached]") == attached
    assert out.text.count("[+1 image(s)]") == 3 - attached


def test_a_small_image_may_still_fit_after_a_big_one_did_not() -> None:
    rows = numbered([with_images(shot(1, side=100)), with_images(shot(2, side=2048))])  # 258 and 4098 tokens
    out = format_for_summary(rows, window=4 * 1000, vision=True)
    assert list(out.image_blob_ids) == [f"{1:064x}"]


def test_an_image_no_reader_recognized_is_only_noted_never_sent() -> None:
    """Unreadable bytes (stored 0x0, application/octet-stream, priced at the fallback) were sent to
    a vision summarizer as a PNG data URL; the endpoint refused the whole request (HTTP 400) and
    the compaction fell back to dropping turns instead of summarizing them."""
    unreadable = ImageRef(blob_id=f"{9:064x}", mime_type="application/octet-stream", token_count=1024)
    rows = numbered([with_images(shot(1)), with_images(unreadable)])
    out = format_for_summary(rows, window=1_000_000, vision=True)
    assert list(out.image_blob_ids) == [f"{1:064x}"]
    assert out.images_omitted == 1
    assert out.text.count("[1 image(s) attached]") == 1 and out.text.count("[+1 image(s)]") == 1


@pytest.mark.parametrize("mime", ["image/bmp", "image/tiff", "image/x-icon"])
def test_an_image_of_a_type_vision_endpoints_refuse_is_only_noted(mime: str) -> None:
    """A BMP (a Windows clipboard screenshot) was sent as a PNG data URL, and refused (HTTP 400)."""
    other = ImageRef(blob_id=f"{8:064x}", mime_type=mime, width=64, height=48)
    rows = numbered([with_images(shot(1)), with_images(other)])
    out = format_for_summary(rows, window=1_000_000, vision=True)
    assert list(out.image_blob_ids) == [f"{1:064x}"] and out.images_omitted == 1


def test_without_vision_images_are_only_noted() -> None:
    rows = numbered([with_images(shot(1), shot(2), shot(3))])
    out = format_for_summary(rows, window=1_000_000, vision=False)
    assert out.image_blob_ids == () and out.images_omitted == 3
    assert out.text == "[#1 user]\nlook\n[+3 image(s)]"


# --- the whole input -------------------------------------------------------------------------


def test_the_whole_input_is_capped_at_32000_chars_keeping_head_and_tail() -> None:
    rows = numbered([user(f"{k:05d} " + "w" * 994) for k in range(60)])  # ~60,000 chars
    out = format_for_summary(rows, window=32768)
    full = "\n\n".join(f"[#{m.sequence_number} user]\n{m.content}" for m in rows)
    assert out.uncapped_chars == len(full) and out.capped
    assert len(out.text) == 32_000
    assert out.text.startswith(full[:24_000])
    marker = re.search(r"\n\n\[… (\d+) chars of the middle omitted …\]\n\n", out.text)
    assert marker is not None and marker.start() == 24_000
    tail = 32_000 - 24_000 - len(marker.group(0))
    assert out.text.endswith(full[-tail:])
    assert int(marker.group(1)) == len(full) - 24_000 - tail


def test_an_appendix_counts_within_the_cap() -> None:
    """The fact lines a model summarizer gets after the rows once went past the 32,000 chars."""
    rows = numbered([user(f"{k:05d} " + "w" * 994) for k in range(60)])
    appendix = "\n\nKeep these facts:\n" + "\n".join(f"- fact {k} " + "f" * 180 for k in range(24))
    out = format_for_summary(rows, window=32768, appendix=appendix)
    assert len(out.text) == 32_000 and out.text.endswith(appendix)
    assert out.text.startswith(format_for_summary(rows, window=32768).text[: 24_000 - len(appendix)])
    assert out.uncapped_chars > 60_000 + len(appendix) - 1
    # Small enough inputs keep rows and appendix whole; a huge appendix takes at most a quarter.
    assert format_for_summary(numbered([user("short")]), window=32768, appendix="\nF").text == "[#1 user]\nshort\nF"
    huge = format_for_summary(rows, window=32768, appendix="z" * 50_000)
    assert len(huge.text) == 32_000 and huge.text.count("z") <= 8000


def test_an_input_within_the_cap_is_untouched() -> None:
    rows = numbered([user("short")])
    out = format_for_summary(rows, window=32768)
    assert out.text == "[#1 user]\nshort" and not out.capped


@given(st.text(min_size=0, max_size=5000), st.integers(1000, 3000), st.floats(0.1, 0.9))
def test_cap_text_is_exact(text: str, limit: int, share: float) -> None:
    out = cap_text(text, limit, share)
    if len(text) <= limit:
        assert out == text
    else:
        head = int(limit * share)
        marker = re.match(r"\n\n\[… (\d+) chars of the middle omitted …\]\n\n", out[head:])
        assert marker is not None
        tail = len(text) - head - int(marker.group(1))
        assert len(out) == limit
        assert out == text[:head] + marker.group(0) + text[len(text) - tail :]


def test_long_user_text_keeps_head_and_tail() -> None:
    text = "u" * 2000 + "v" * 6000 + "w" * 2000
    body = only_block([user(text)])
    assert body.startswith("u" * 2000) and body.endswith("w" * 2000) and len(body) < 4100


@pytest.mark.parametrize(("text", "limit"), [("x" * 50, 50), ("x" * 51, 50), ("x" * 10, 12)])
def test_preview_never_exceeds_its_limit(text: str, limit: int) -> None:
    out = preview(text, limit)
    assert len(out) <= limit and out.startswith(text[: limit // 2])
    assert head_tail(text, 4000) == text


# --- prompt and KEYS -------------------------------------------------------------------------


def test_the_default_prompt_asks_for_what_must_survive_and_a_keys_line() -> None:
    lowered = DEFAULT_SUMMARY_PROMPT.lower()
    for word in ("decisions", "facts", "names", "paths", "numbers", "tasks still open", "corrections"):
        assert word in lowered, word
    assert "KEYS:" in DEFAULT_SUMMARY_PROMPT and "semicolons" in lowered


def test_summary_instructions_add_the_keys_request_to_a_custom_prompt() -> None:
    assert summary_instructions() == DEFAULT_SUMMARY_PROMPT
    assert summary_instructions("   ") == DEFAULT_SUMMARY_PROMPT
    custom = summary_instructions("Summarize briefly.")
    assert custom.startswith("Summarize briefly.\n") and "'KEYS:'" in custom
    assert summary_instructions("Summarize; end with KEYS: a; b") == "Summarize; end with KEYS: a; b"


@given(st.text(max_size=300))
def test_split_keys_never_fails_and_keeps_text_without_keys(text: str) -> None:
    body, keys = split_keys(text)
    if not keys and "keys" not in text.lower():
        assert body == text
    assert all(k and k == k.strip() for k in keys)


# --- a model's answer ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        "```markdown\n- did X in src/a.py\n- open: Y\nKEYS: src/a.py; Y\n```",
        "```\n- did X in src/a.py\n- open: Y\nKEYS: src/a.py; Y\n```\n",
        "  ```md\n- did X in src/a.py\n- open: Y\n```\nKEYS: src/a.py; Y",
        "- did X in src/a.py\n- open: Y\nKEYS: src/a.py; Y",
    ],
)
def test_a_fence_around_the_answer_is_not_stored(answer: str) -> None:
    assert summary_parts(answer) == ("- did X in src/a.py\n- open: Y", ["src/a.py", "Y"])


def test_a_fence_inside_the_summary_stays() -> None:
    text = "- ran:\n```\nmake deploy\n```\n- then tests"
    assert unfence(text) == text
    assert unfence("```\na\n```\nb\n```\nc\n```") == "```\na\n```\nb\n```\nc\n```"
    assert unfence("``` not a fence") == "``` not a fence"


@pytest.mark.parametrize(
    "answer",
    [
        "I'm sorry, but I can't help with that.",
        "I\u2019m sorry, I cannot assist with this request.",
        "Sorry, I can't summarize this conversation.",
        "I cannot help with that.",
        "I can't provide a summary of this content.",
        "As an AI language model, I am unable to do that.",
        "Unfortunately, I can't help with this.",
    ],
)
def test_a_refusal_is_no_summary(answer: str) -> None:
    assert is_refusal(*summary_parts(answer))


@pytest.mark.parametrize(
    "answer",
    [
        "- The user asked for a refund; I'm sorry was the reply.\nKEYS: refund",
        "- I can't reproduce bug OPS-1 was the last finding",
        "I cannot reproduce the crash on 3.12; the fix in src/a.py stays.\nKEYS: src/a.py",
        "Sorry for the delay was all the user said. " + "Then the work went on. " * 40,
        "The assistant fixed src/a.py.",
    ],
)
def test_a_summary_is_not_taken_for_a_refusal(answer: str) -> None:
    assert not is_refusal(*summary_parts(answer))


# --- an answer cut at the output cap ------------------------------------------------------------


def test_a_cut_summary_is_marked_and_carries_the_facts_it_was_sent_once() -> None:
    facts = facts_block(["ticket OPS-4411 is the incident", "config at /srv/app/prod.yaml"])
    # cut inside its own Facts section: that part goes, the whole section sent comes instead
    text = cut_summary_text("- We fixed the parser.\n\nFacts:\n- ticket OPS-44", facts)
    assert text.startswith("- We fixed the parser. " + CUT_MARKER)
    assert carried_facts(text) == ["ticket OPS-4411 is the incident", "config at /srv/app/prod.yaml"]
    assert cut_summary_text("- We fixed the pa", "") == "- We fixed the pa " + CUT_MARKER
