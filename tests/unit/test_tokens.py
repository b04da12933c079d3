"""Message sizing and view estimates (DESIGN §5.2, §5.3)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextsvc.config import TokenSettings
from contextsvc.core.calibration import Calibration
from contextsvc.core.messages import Flags, ImageRef, Message, Role, ToolCall
from contextsvc.core.priors import N_CLASSES, N_UNITS
from contextsvc.core.sizing import MESSAGE_FRAME_UNITS, TOOL_CALL_FRAME_UNITS, text_size
from contextsvc.core.tokens import (
    Baseline,
    CalibratedCounter,
    EstimateMethod,
    ExactCounter,
    TokenSegments,
    baseline_delta,
    counter_for,
    estimate,
    load_tokenizer,
    message_budget,
    message_chars,
    message_size,
    messages_chars,
    messages_size,
    output_reserve,
    text_chars,
    truncation_check,
)

#: The families' own Cyrillic columns, unpriced: these calibrations price the shared classes.
NO_FAMILY = (0.0,) * (N_UNITS - N_CLASSES)


S = TokenSettings()
# Uniform prices that reproduce the size-unit line these tests were written against: every class at
# one price per unit, the old framing allowance (8 units a message, 16 a tool call) per message.
FALLBACK = CalibratedCounter(
    Calibration((1 / 1.8,) * N_CLASSES + NO_FAMILY + (8 / 1.8, 16 / 1.8, 0.0), 0, fitted=False, margin=0.0)
)
LINE = CalibratedCounter(Calibration((0.3,) * N_CLASSES + NO_FAMILY + (2.4, 4.8, 100.0), 2, fitted=True, margin=0.0))


def msg(
    content: str = "",
    seq: int = 0,
    *,
    role: Role = Role.USER,
    flags: Flags | None = None,
    images: tuple[ImageRef, ...] = (),
) -> Message:
    return Message(role=role, content=content, sequence_number=seq, flags=flags or Flags(), images=images)


def units(text: str) -> int:
    """Size units of a one-field message holding ``text`` (its framing included)."""
    return MESSAGE_FRAME_UNITS + text_size(text)


def line(size: int) -> int:
    """Tokens LINE prices ``size`` units at, without its overhead."""
    return round(0.3 * size)


# --- message size --------------------------------------------------------------------------


def test_message_size_counts_what_reaches_the_model() -> None:
    m = Message(
        role=Role.ASSISTANT,
        content="abc",
        thinking="hmm",
        tool_calls=(ToolCall("call_1", "read", '{"p":1}'), ToolCall("c2", "ls")),
        tool_call_id="t1",
        name="bob",
        images=(ImageRef("x" * 64, width=10, height=10),),  # priced by pixels, not as text
        metadata={"source": "x" * 1000},  # never sent
    )
    parts = ("abc", "hmm", "call_1", "read", '{"p":1}', "c2", "ls", "t1", "bob")
    framing = MESSAGE_FRAME_UNITS + 2 * TOOL_CALL_FRAME_UNITS
    assert message_size(m) == framing + sum(text_size(p) for p in parts)
    assert text_chars(m) == 3 + 3 + 17 + 4 + 2 + 3
    bare = Message(role=m.role, content=m.content, thinking=m.thinking, tool_calls=m.tool_calls, tool_call_id="t1")
    assert message_size(m) == message_size(bare) + text_size("bob")  # metadata and images add nothing
    assert messages_size([m, msg("12345")]) == message_size(m) + units("12345")


def test_the_engine_facing_names_return_the_size() -> None:
    # The engine stores messages_chars(view) as the baseline observation's ``chars``: it must be
    # the very measure the counter prices, or the fitted line would be off by the ratio.
    m = msg('some text, with a JSON tail: {"ok": true}')
    assert message_chars(m) == message_size(m) and messages_chars([m, m]) == 2 * message_size(m)


def test_an_empty_message_weighs_only_its_framing() -> None:
    assert message_size(msg()) == MESSAGE_FRAME_UNITS > 0
    assert text_chars(msg()) == 0
    assert messages_size([]) == 0


def test_framing_is_pinned() -> None:
    assert (MESSAGE_FRAME_UNITS, TOOL_CALL_FRAME_UNITS) == (8, 16)  # 4 and 8 tokens


# --- counters ------------------------------------------------------------------------------


def test_calibrated_counter_methods() -> None:
    assert FALLBACK.method is EstimateMethod.FALLBACK and FALLBACK.overhead == 0
    assert LINE.method is EstimateMethod.CALIBRATED and LINE.overhead == 100
    text = "The quick brown fox jumps over the lazy dog. " * 20
    assert LINE.count_text(text) == line(text_size(text))
    assert FALLBACK.count_text(text) == round(text_size(text) / 1.8)
    assert LINE.count_messages([msg(text)]) == line(units(text))
    assert LINE.count_text("") == 0


def test_sizes_are_summed_before_rounding() -> None:
    # 3 messages of 10 units at 0.05 tokens/unit: 0.5 each rounds to 0, together 1.5 rounds to 2.
    counter = CalibratedCounter(
        Calibration((0.05,) * N_CLASSES + NO_FAMILY + (0.4, 0.8, 0.0), 2, fitted=True, margin=0.0)
    )
    three = [msg("a"), msg("b"), msg("c")]
    assert [message_size(m) for m in three] == [10, 10, 10]
    assert [counter.count_messages([m]) for m in three] == [0, 0, 0]
    assert counter.count_messages(three) == 2


def _word_tokenizer(tmp_path: Path) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "read": 3}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_exact_counter_from_a_tokenizer_file(tmp_path: Path) -> None:
    count = load_tokenizer(_word_tokenizer(tmp_path))
    assert count("hello world hello") == 3
    exact = ExactCounter(count)
    assert exact.method is EstimateMethod.EXACT
    m = Message(role=Role.ASSISTANT, content="hello world", tool_calls=(ToolCall("id1", "read", "x y"),))
    assert exact.count_messages([m]) == 2 + 1 + 1 + 2  # content, id, name, args


def test_counter_for_uses_the_configured_tokenizer(tmp_path: Path) -> None:
    settings = TokenSettings(tokenizer_files={"llama": _word_tokenizer(tmp_path)})
    assert counter_for("llama", FALLBACK.calibration, settings).method is EstimateMethod.EXACT
    assert counter_for("other", FALLBACK.calibration, settings).method is EstimateMethod.FALLBACK


def test_a_missing_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"nope\.json"):
        load_tokenizer(str(tmp_path / "nope.json"))


# --- window arithmetic ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "reserve", "expected"),
    [(32768, 2048, 2048), (4096, 2048, 1024), (1000, 2048, 250), (32768, 0, 0)],
)
def test_output_reserve_is_capped_at_a_quarter_of_the_window(window: int, reserve: int, expected: int) -> None:
    assert output_reserve(window, reserve) == expected


@pytest.mark.parametrize(("window", "budget", "expected"), [(32768, 0, 5461), (32768, 1000, 1000), (600, 0, 100)])
def test_message_budget(window: int, budget: int, expected: int) -> None:
    assert message_budget(window, budget) == expected


@pytest.mark.parametrize(
    ("reported", "estimated", "truncated"),
    [(699, 1000, True), (700, 1000, False), (1200, 1000, False), (0, 1000, True), (0, 0, False), (500, 0, False)],
)
def test_truncation_check(reported: int, estimated: int, truncated: bool) -> None:
    assert truncation_check(reported, estimated) is truncated
    assert S.truncation_ratio == 0.70


def test_truncation_ratio_is_a_parameter() -> None:
    assert truncation_check(850, 1000, ratio=0.9)
    assert not truncation_check(850, 1000, ratio=0.8)


# --- estimates -----------------------------------------------------------------------------


PROSE = "Compression keeps the newest turns and summarizes the older ones. "
JSON = '{"path": "src/app.py", "size": 1234, "ok": true}, '


def test_estimate_breaks_a_view_into_segments() -> None:
    img = ImageRef("b" * 64, width=1024, height=1024)  # 1026
    system, record, summary, pinned, other, incoming = (
        PROSE * 20,
        JSON * 2,
        PROSE * 4,
        "never push to main",
        JSON * 30,
        "and now?",
    )
    est = estimate(
        counter=LINE,
        window=10_000,
        reserve=2048,
        system=system,
        records=[msg(record, 1, role=Role.SYSTEM)],
        context=[
            msg(summary, 2, flags=Flags(is_summary=True, is_display=False)),
            msg(pinned, 3, flags=Flags(is_pinned=True)),
            msg(other, 4, images=(img,)),
        ],
        incoming=[msg(incoming, images=(ImageRef("c" * 64),))],  # + a 1024-token fallback image
    )
    assert est.segments == TokenSegments(
        system=100 + line(units(system)),  # the overhead, and the system prompt framed as a message
        records=line(units(record)),
        summaries=line(units(summary)),
        pinned=line(units(pinned)),
        messages=line(units(other)),
        images=1026 + 1024,
        incoming=line(units(incoming)),
    )
    assert est.total == est.segments.total
    assert (est.text, est.images) == (est.total - 2050, 2050)
    assert est.method is EstimateMethod.CALIBRATED
    assert (est.window, est.budget) == (10_000, 10_000 - 2048)
    assert est.fraction == pytest.approx(est.total / 10_000)
    assert not est.over_budget


def test_estimate_of_nothing_is_zero() -> None:
    est = estimate(counter=FALLBACK, window=1000, reserve=2048)
    assert (est.total, est.method, est.budget, est.fraction) == (0, EstimateMethod.FALLBACK, 750, 0.0)


def test_a_standalone_list_is_not_charged_the_view_overhead() -> None:
    est = estimate(counter=LINE, window=100_000, reserve=0, context=[msg(PROSE, 1)], view=False)
    assert est.segments.system == 0
    assert est.total == LINE.count_messages([msg(PROSE, 1)])
    as_view = estimate(counter=LINE, window=100_000, reserve=0, context=[msg(PROSE, 1)])
    assert as_view.total == est.total + 100  # the per-view overhead, once


def test_the_margin_is_the_rate_of_what_was_priced() -> None:
    cal = Calibration((0.3,) * N_CLASSES + NO_FAMILY + (2.4, 4.8, 0.0), 2, fitted=True, margin=0.05)
    est = estimate(counter=CalibratedCounter(cal), window=100_000, reserve=0, context=[msg(PROSE, 1)])
    assert est.margin == math.ceil(0.05 * est.total) and est.guarded == est.total + est.margin


def test_baseline_delta_adds_the_new_messages_to_the_real_count() -> None:
    since = [msg(PROSE * 10, 11), msg(JSON * 10, 12, images=(ImageRef("i", width=100, height=100),))]
    assert baseline_delta(5000, since, LINE) == 5000 + line(units(PROSE * 10) + units(JSON * 10)) + 258
    assert baseline_delta(5000, [], LINE) == 5000


def test_estimate_with_a_baseline_counts_only_what_came_after_it() -> None:
    a, b, c, d = PROSE * 100, JSON * 100, PROSE * 10, "what next?"
    context = [msg(a, 1), msg(b, 2), msg(c, 3)]
    incoming = [msg(d)]
    est = estimate(
        counter=LINE,
        window=100_000,
        reserve=2048,
        system=PROSE * 10,
        context=context,
        incoming=incoming,
        baseline=Baseline(tokens=7000, last_sequence=2),
    )
    assert est.method is EstimateMethod.BASELINE_DELTA
    assert est.total == 7000 + line(units(c) + units(d))
    # the breakdown keeps the calibrated proportions and sums to the baseline-based total
    assert est.segments.total == est.total
    raw = estimate(counter=LINE, window=100_000, reserve=2048, system=PROSE * 10, context=context, incoming=incoming)
    assert raw.total == 100 + line(units(PROSE * 10)) + line(units(a) + units(b) + units(c)) + line(units(d))
    assert est.segments.messages > est.segments.system > est.segments.incoming > 0


@given(
    st.lists(st.integers(0, 50_000), min_size=1, max_size=20),
    st.integers(0, 200_000),
    st.integers(0, 25),
)
def test_estimate_segments_always_sum_to_the_total(sizes: list[int], baseline: int, boundary: int) -> None:
    context = [msg("x" * n, i + 1, flags=Flags(is_pinned=i % 3 == 0)) for i, n in enumerate(sizes)]
    for base in (None, Baseline(baseline, boundary)):
        est = estimate(counter=LINE, window=50_000, reserve=1000, system="sys", context=context, baseline=base)
        assert est.segments.total == est.total == est.text + est.images
        assert min(vars_of(est.segments)) >= 0


def vars_of(seg: TokenSegments) -> list[int]:
    return [seg.system, seg.records, seg.summaries, seg.pinned, seg.messages, seg.images, seg.incoming]


def test_exact_method_is_reported(tmp_path: Path) -> None:
    exact = ExactCounter(load_tokenizer(_word_tokenizer(tmp_path)))
    est = estimate(counter=exact, window=1000, reserve=0, system="hello", context=[msg("hello world", 1)])
    assert (est.total, est.method) == (3, EstimateMethod.EXACT)


@pytest.mark.parametrize("anchored", [False, True])
def test_tokens_sent_beside_the_view_are_system_tokens_and_never_priced(anchored: bool) -> None:
    context = [msg(PROSE * 100, 1), msg(JSON * 100, 2), msg(PROSE * 10, 3)]
    common = {"counter": LINE, "window": 100_000, "reserve": 2048, "system": PROSE * 10, "context": context}
    baseline = Baseline(tokens=7000, last_sequence=2) if anchored else None
    plain = estimate(**common, baseline=baseline)
    held = estimate(**common, baseline=baseline, beside=3000)
    assert held.segments.total == held.total
    assert held.priced == plain.priced and held.margin == plain.margin  # the margin does not scale with them
    if anchored:
        # The count already holds them: the same total, the system segment holds them whole.
        assert held.total == plain.total
        assert held.segments.system >= 3000
    else:
        assert held.total == plain.total + 3000
        assert held.segments.system == plain.segments.system + 3000
    # A standalone list is no view: nothing is sent beside it.
    listed = estimate(**common, beside=3000, view=False)
    assert listed.total == estimate(**common, view=False).total
