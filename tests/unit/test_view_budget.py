"""The view's size rules (DESIGN §5.2): per-message cuts, image budget, size guard."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextsvc.config import TokenSettings
from contextsvc.core.calibration import Calibration
from contextsvc.core.messages import Flags, ImageRef, Message, Role, ToolCall
from contextsvc.core.priors import N_CLASSES, N_UNITS
from contextsvc.core.tokens import (
    CalibratedCounter,
    ExactCounter,
    estimate,
    load_tokenizer,
    message_budget,
    message_size,
    text_chars,
)
from contextsvc.core.view_budget import (
    budget_images,
    check_fits,
    cut_marker,
    image_budget,
    too_large,
    truncate_for_view,
    truncate_view,
)
from contextsvc.errors import ContextTooLarge

S = TokenSettings()
#: The families' own Cyrillic columns, unpriced: these calibrations price the shared classes.
NO_FAMILY = (0.0,) * (N_UNITS - N_CLASSES)
# Uniform prices that reproduce the size-unit line these tests were written against: every class at
# one price per unit, the old framing allowance (8 units a message, 16 a tool call) per message.
FALLBACK = CalibratedCounter(
    Calibration((1 / 1.8,) * N_CLASSES + NO_FAMILY + (8 / 1.8, 16 / 1.8, 0.0), 0, fitted=False, margin=0.0)
)
LINE = CalibratedCounter(Calibration((0.3,) * N_CLASSES + NO_FAMILY + (2.4, 4.8, 100.0), 2, fitted=True, margin=0.0))
WINDOW = 32_768
BUDGET = message_budget(WINDOW, 0)  # 5461 tokens
MARKER = re.compile(r"\[… ([\d,]+) chars cut …\]")


def tool_result(content: str, seq: int = 7, **flags: bool) -> Message:
    return Message(role=Role.TOOL, content=content, tool_call_id="call_1", sequence_number=seq, flags=Flags(**flags))


def test_marker_format() -> None:
    assert cut_marker(812_345).strip() == "[… 812,345 chars cut …]"


def test_a_megabyte_tool_result_is_cut_in_the_view_only() -> None:
    content = "HEAD" + "q" * 1_000_000 + "TAIL"
    original = tool_result(content)
    snapshot = copy.deepcopy(original)

    cut = truncate_for_view(original, BUDGET, FALLBACK)

    assert original == snapshot and original.content is content  # the stored message is untouched
    assert cut is not original
    assert cut.content.startswith("HEAD") and cut.content.endswith("TAIL")
    (cut_chars,) = (int(n.replace(",", "")) for n in MARKER.findall(cut.content))
    kept = len(cut.content) - len(cut_marker(cut_chars))
    assert kept + cut_chars == len(content)  # the marker says exactly how much went
    assert FALLBACK.count_messages([cut]) <= BUDGET
    assert FALLBACK.count_messages([cut]) >= BUDGET * 0.95  # and not much more than needed
    assert (cut.role, cut.tool_call_id, cut.sequence_number) == (original.role, "call_1", 7)

    # the estimate counts the cut view, not the stored megabyte
    small = tool_result("hi", 6)
    view = truncate_view([small, original], BUDGET, FALLBACK)
    assert view[0] is small and view[1] == cut
    est = estimate(counter=FALLBACK, window=WINDOW, reserve=2048, context=view)
    assert est.total == FALLBACK.count_messages(view) <= BUDGET + FALLBACK.count_messages([small])
    assert est.total < WINDOW - 2048
    raw = estimate(counter=FALLBACK, window=WINDOW, reserve=2048, context=[original])
    assert raw.total == FALLBACK.count_messages([original]) > 50 * BUDGET


def test_small_and_pinned_messages_are_returned_as_is() -> None:
    small = tool_result("short")
    pinned = tool_result("p" * 1_000_000, is_pinned=True)
    assert truncate_for_view(small, BUDGET, FALLBACK) is small
    assert truncate_for_view(pinned, BUDGET, FALLBACK) is pinned


def test_the_larger_field_is_cut_first() -> None:
    m = Message(role=Role.ASSISTANT, content="c" * 2000, thinking="t" * 200_000)
    cut = truncate_for_view(m, 2000, FALLBACK)
    assert cut.content == m.content
    assert MARKER.search(cut.thinking)
    assert FALLBACK.count_messages([cut]) <= 2000


def test_both_fields_are_cut_when_one_is_not_enough() -> None:
    m = Message(role=Role.ASSISTANT, content="c" * 50_000, thinking="t" * 60_000)
    cut = truncate_for_view(m, 1000, FALLBACK)
    assert MARKER.search(cut.content) and MARKER.search(cut.thinking)
    assert FALLBACK.count_messages([cut]) <= 1000


def test_tool_call_arguments_are_never_cut() -> None:
    args = '{"path": "a.txt", "text": "' + "z" * 100_000 + '"}'
    m = Message(role=Role.ASSISTANT, content="writing", tool_calls=(ToolCall("c1", "write", args),))
    cut = truncate_for_view(m, 1000, FALLBACK)
    assert cut.tool_calls[0].arguments_json == args  # still valid JSON for the runtime


@given(st.integers(0, 300_000), st.integers(50, 20_000))
def test_a_cut_message_fits_its_budget(size: int, budget: int) -> None:
    m = tool_result("y" * size)
    cut = truncate_for_view(m, budget, LINE)
    if LINE.count_messages([m]) <= budget:
        assert cut is m
    else:
        assert LINE.count_messages([cut]) <= budget
        assert MARKER.search(cut.content)


_KINDS = {
    "prose": "The build failed because the database tests timed out again. ",
    "json": '{"id": "9f86d081884c", "status": "failed", "ms": 812.5}, ',
    "code": '    if not items:\n        raise ValueError(f"bad {name!r}")\n',
    "cyrillic": "Сборка завершилась с ошибкой, тесты не прошли. ",  # noqa: RUF001
    "digits": "4471 9302 1187 5540 ",
}


@settings(deadline=None)  # the first measure of a long text fills the class-units memo
@given(st.lists(st.tuples(st.sampled_from(sorted(_KINDS)), st.integers(1, 3000)), min_size=1, max_size=6))
def test_a_cut_message_of_mixed_density_fits_its_budget(segments: list[tuple[str, int]]) -> None:
    # Size per char varies along the message (dense JSON head, sparse prose tail, ...): the cut
    # aims by the average and re-measures until the view copy fits.
    content = "".join(_KINDS[kind] * repeat for kind, repeat in segments)
    m = tool_result(content)
    cut = truncate_for_view(m, 2000, LINE)
    if LINE.count_messages([m]) <= 2000:
        assert cut is m
    else:
        assert LINE.count_messages([cut]) <= 2000
        (cut_chars,) = (int(n.replace(",", "")) for n in MARKER.findall(cut.content))
        assert len(cut.content) - len(cut_marker(cut_chars)) + cut_chars == len(content)


def test_cutting_with_an_exact_tokenizer_fits(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "t.json"))
    exact = ExactCounter(load_tokenizer(str(tmp_path / "t.json")))
    # Uneven density: a dense half (1 token per 2 chars) and a sparse half (1 per 41 chars).
    text = "a " * 50_000 + ("b" * 40 + " ") * 2_000
    cut = truncate_for_view(tool_result(text), 3000, exact)
    assert exact.count_messages([cut]) <= 3000


# --- images --------------------------------------------------------------------------------


def img(blob: str, side: int) -> ImageRef:
    return ImageRef(blob, mime_type="image/png", width=side, height=side)


def with_images(seq: int, *refs: ImageRef, content: str = "look") -> Message:
    return Message(role=Role.USER, content=content, images=refs, sequence_number=seq)


def test_image_budget_formula() -> None:
    assert image_budget(10_000, 3000) == 5000  # 0.8 x 10,000 - 3000
    assert image_budget(10_000, 9000) == 0
    assert S.view_image_budget_fraction == 0.8


def test_newest_images_are_kept_and_the_rest_named_in_a_notice() -> None:
    msgs = [
        with_images(3, img("old", 1024)),  # 1026
        with_images(5, img("mid", 1024)),  # 1026
        with_images(9, img("new", 1024)),  # 1026
    ]
    plan = budget_images(msgs, window=5000, text_tokens=1500, vision=True)  # budget 2500: two fit
    assert plan.budget == 2500
    assert [s.blob_id for s in plan.kept] == ["mid", "new"]
    assert [(s.sequence_number, s.blob_id) for s in plan.left_out] == [(3, "old")]
    assert plan.tokens == 2052
    assert plan.messages[0].images == ()
    assert plan.messages[0].content.startswith("look\n\n[1 image(s) of message #3 not in this view")
    assert "blob old" in plan.messages[0].content
    assert plan.notices == (plan.messages[0].content.split("\n\n")[1],)
    assert plan.messages[1] is msgs[1] and plan.messages[2] is msgs[2]
    assert msgs[0].images == (img("old", 1024),)  # the input is untouched


def test_each_image_is_priced_by_its_own_size() -> None:
    # a big screenshot does not fit, but an older thumbnail still does
    msgs = [with_images(1, img("thumb", 100)), with_images(2, img("huge", 4096))]
    plan = budget_images(msgs, window=5000, text_tokens=1000, vision=True)  # budget 3000
    assert [s.blob_id for s in plan.kept] == ["thumb"]
    assert [s.blob_id for s in plan.left_out] == ["huge"]
    assert [s.tokens for s in plan.left_out] == [4098]


def test_vision_less_profiles_get_notices_only() -> None:
    msgs = [with_images(4, img("a", 100), img("b", 100)), Message(role=Role.USER, content="hi", sequence_number=5)]
    plan = budget_images(msgs, window=100_000, text_tokens=0, vision=False)
    assert plan.kept == () and plan.budget == 0
    assert [s.blob_id for s in plan.left_out] == ["a", "b"]
    assert all(not m.images for m in plan.messages)
    assert plan.notices == ("[2 image(s) of message #4 not in this view (this model has no vision): blob a, blob b]",)


def test_incoming_images_are_named_as_incoming() -> None:
    incoming = Message(role=Role.USER, content="", images=(img("z", 2048),))
    plan = budget_images([incoming], window=1000, text_tokens=0, vision=True)
    assert plan.messages[0].content.startswith("[1 image(s) of the incoming message")


@given(st.lists(st.lists(st.sampled_from([64, 512, 1024, 2048, 3000]), max_size=3), max_size=8), st.integers(0, 30_000))
def test_kept_images_never_exceed_the_budget(sides: list[list[int]], text: int) -> None:
    msgs = [with_images(i + 1, *(img(f"{i}-{j}", s) for j, s in enumerate(row))) for i, row in enumerate(sides)]
    plan = budget_images(msgs, window=32_768, text_tokens=text, vision=True)
    assert plan.tokens <= plan.budget
    assert len(plan.kept) + len(plan.left_out) == sum(len(r) for r in sides)
    assert sum(len(m.images) for m in plan.messages) == len(plan.kept)
    assert len(plan.notices) == len({s.sequence_number for s in plan.left_out})


@given(st.lists(st.lists(st.sampled_from([64, 512, 1024, 2048, 3000]), max_size=3), max_size=8), st.integers(0, 30_000))
def test_kept_images_and_their_notices_never_exceed_the_budget(sides: list[list[int]], text: int) -> None:
    """The notices naming left-out images are text the image budget has to make room for."""
    msgs = [with_images(i + 1, *(img(f"{i}-{j}", s) for j, s in enumerate(row))) for i, row in enumerate(sides)]

    def price(notice: str) -> int:
        return len(notice) // 2  # a dear price, so that notices matter

    plan = budget_images(msgs, window=32_768, text_tokens=text, vision=True, notice_tokens=price)
    assert plan.tokens + sum(map(price, plan.notices)) <= plan.budget or not plan.kept
    assert plan.budget == image_budget(32_768, text)
    assert len(plan.kept) + len(plan.left_out) == sum(len(r) for r in sides)
    assert len(plan.notices) == len({s.sequence_number for s in plan.left_out})


def test_notices_that_would_overrun_the_budget_leave_one_more_image_out() -> None:
    msgs = [with_images(i + 1, img(f"i{i}", 64)) for i in range(4)]  # 66 tokens each (64 px: 1 tile)
    each = budget_images(msgs[:1], window=5000, text_tokens=0, vision=True).tokens
    budget = image_budget(5000, 5000 * 8 // 10 - 3 * each - 10)  # room for three images and 10 tokens
    text = 5000 * 8 // 10 - budget
    without = budget_images(msgs, window=5000, text_tokens=text, vision=True)
    assert len(without.kept) == 3 and len(without.notices) == 1
    priced = budget_images(msgs, window=5000, text_tokens=text, vision=True, notice_tokens=lambda n: 40)
    assert len(priced.kept) == 2 and len(priced.notices) == 2
    assert priced.tokens + 2 * 40 <= priced.budget == budget


def test_images_past_the_bytes_a_response_can_carry_are_left_out_newest_kept() -> None:
    heavy = [with_images(i + 1, ImageRef(f"h{i}", "image/png", 64, 64, size_bytes=10_000_000)) for i in range(4)]
    plan = budget_images(heavy, window=100_000, text_tokens=0, vision=True, max_bytes=25_000_000)
    assert [s.blob_id for s in plan.kept] == ["h2", "h3"]  # two fit the bytes; the tokens fit all four
    assert [s.blob_id for s in plan.left_out] == ["h0", "h1"]
    assert "response size limit" in plan.notices[0]
    # Text alone past what a response carries (a negative allowance): no image, each named.
    none = budget_images(heavy, window=100_000, text_tokens=0, vision=True, max_bytes=-5)
    assert not none.kept and len(none.notices) == 4
    # Without a bound, bytes do not matter.
    assert len(budget_images(heavy, window=100_000, text_tokens=0, vision=True).kept) == 4


# --- size guard ----------------------------------------------------------------------------


def test_a_view_within_window_minus_reserve_fits() -> None:
    assert too_large(30_720, 32_768, 2048) is None
    check_fits(30_720, 32_768, 2048)


def test_a_view_over_the_budget_fails_with_the_numbers_it_compared() -> None:
    with pytest.raises(ContextTooLarge) as info:
        check_fits(30_721, 32_768, 2048)
    err = info.value
    assert err.reason == "CONTEXT_TOO_LARGE"
    assert err.metadata == {"estimate": "30721", "budget": "30720", "window": "32768"}
    assert "30721" in err.message and "30720" in err.message


def test_the_reserve_is_capped_for_small_windows() -> None:
    # reserve 2048 on a 4096 window is capped at 1024: the budget is 3072, not 2048
    assert too_large(3072, 4096, 2048) is None
    err = too_large(3073, 4096, 2048)
    assert err is not None and err.metadata["budget"] == "3072"


def test_the_guard_and_the_estimate_agree_on_the_budget() -> None:
    big = tool_result("q" * 200_000)
    est = estimate(counter=FALLBACK, window=WINDOW, reserve=2048, context=[big])
    err = too_large(est.total, est.window, 2048)
    assert est.over_budget and err is not None
    assert err.metadata["estimate"] == str(est.total) and err.metadata["budget"] == str(est.budget)
    # and the cut view of the same message fits
    cut = truncate_view([big], BUDGET, FALLBACK)
    est_cut = estimate(counter=FALLBACK, window=WINDOW, reserve=2048, context=cut)
    assert too_large(est_cut.total, WINDOW, 2048) is None
    assert message_size(cut[0]) < message_size(big) and text_chars(cut[0]) < text_chars(big)
