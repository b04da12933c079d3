"""A long row's cut lands on a grid of its characters (``view_budget._CUT_GRID``), and a cut made
before is reused rather than made again (issue #15): a fit that moves a row's price by a little
cuts it where the last one did, the very same object, so its features, its encoding and a
provider's cached prefix hold; and whatever the memo holds, a cut is what cutting afresh gives."""

from __future__ import annotations

import dataclasses
import gc

from hypothesis import given, settings
from hypothesis import strategies as st

from contextsvc.core import tokens, view_budget
from contextsvc.core.calibration import Calibration
from contextsvc.core.messages import Message, Role
from contextsvc.core.priors import N_CLASSES, N_UNITS
from contextsvc.core.tokens import CalibratedCounter, message_features, text_chars
from contextsvc.core.view_budget import truncate_for_view

NO_FAMILY = (0.0,) * (N_UNITS - N_CLASSES)
BASE = Calibration((0.3,) * N_CLASSES + NO_FAMILY + (2.4, 4.8, 100.0), 2, fitted=True, margin=0.0)


def scaled(scale: float) -> CalibratedCounter:
    return CalibratedCounter(dataclasses.replace(BASE, weights=tuple(w * scale for w in BASE.weights)))


class WordCounter:
    """A counter that is not calibrated (it reads the text: the path an exact tokenizer takes)."""

    method = None
    overhead = 0

    def __init__(self, per_word: float = 1.0) -> None:
        self.per_word = per_word

    def count_text(self, text: str) -> int:
        return round(len(text.split()) * self.per_word)

    def count_messages(self, messages: list[Message]) -> int:
        return sum(self.count_text(m.content) + self.count_text(m.thinking) + 4 for m in messages)


def row(text: str, thinking: str = "") -> Message:
    return Message(role=Role.TOOL, content=text, thinking=thinking, tool_call_id="c1", sequence_number=9)


PROSE = "The deploy of build 4471 failed at step migrate: lock timeout on table events. " * 600
JSON = '{"id": "9f86d081884c", "status": "failed", "ms": 812.5, "host": "db-3"}, ' * 500


def fresh(m: Message) -> Message:
    """A copy of ``m`` no memo has seen (the same fields, another object)."""
    return dataclasses.replace(m)


def test_a_fit_that_moves_a_row_by_less_than_a_step_cuts_it_where_it_was() -> None:
    m = row(PROSE)
    first = truncate_for_view(m, 2_000, scaled(1.0))
    assert first is not m
    again = truncate_for_view(m, 2_000, scaled(1.0003))  # a refit's typical move (~0.02 %)
    assert again is first  # the same object: its features and its encoding are reused
    # ... and it is what cutting afresh by the new fit gives.
    alone = truncate_for_view(fresh(m), 2_000, scaled(1.0003))
    assert (alone.content, alone.thinking) == (again.content, again.thinking)


def test_a_fit_that_moves_a_row_by_more_than_a_step_cuts_it_again() -> None:
    m = row(PROSE)
    first = truncate_for_view(m, 2_000, scaled(1.0))
    other = truncate_for_view(m, 2_000, scaled(1.05))
    assert other is not first and len(other.content) < len(first.content)
    assert scaled(1.05).count_messages([other]) <= 2_000


def test_a_cut_keeps_a_whole_number_of_grid_steps_just_under_its_aim() -> None:
    m = row(PROSE)
    counter = scaled(1.0)
    chars = text_chars(m)
    aim = chars * 2_000 // counter.count_messages([m])  # the first round's aim: the row's density
    grid = view_budget._grid_step(aim)
    assert aim // 256 < grid <= aim // 128  # a power of two: 1/256 to 1/128 of the kept part
    assert aim % grid  # (this row's aim is off the grid: rounding it matters)
    cut = truncate_for_view(m, 2_000, counter)
    assert counter.count_messages([cut]) <= 2_000
    # What cutting to a whole number of steps at most a few under the aim gives (rounds after the
    # first tighten the cut, on the same grid), and not the cut of the unrounded aim.
    on_grid = {
        view_budget._cut_fields((m.content, m.thinking), excess=chars - kept)[0]
        for kept in range(aim - aim % grid, aim - aim // 16, -grid)
    }
    assert cut.content in on_grid
    unrounded, _, _ = view_budget._cut_fields((m.content, m.thinking), excess=chars - aim)
    assert cut.content != unrounded


@given(st.integers(20, 400), st.integers(500, 8_000))
@settings(max_examples=25, deadline=None)
def test_a_row_many_times_its_budget_keeps_nearly_the_budget(times: int, budget: int) -> None:
    """Grid steps sized by what is kept, not by the whole row: a row hundreds of times its budget
    (a 2 MB tool result against a 5,461-token budget) once kept its marker alone."""
    counter = scaled(1.0)
    unit = "The deploy of build 4471 failed at step migrate: lock timeout. "
    per_unit = counter.count_messages([row(unit * 2)]) - counter.count_messages([row(unit)])
    m = row(unit * (times * budget // per_unit + 1))
    assert counter.count_messages([m]) > times * budget * 0.9
    cut = truncate_for_view(m, budget, counter)
    kept = counter.count_messages([cut])
    assert 0.95 * budget <= kept <= budget, (kept, budget)
    head, _, tail = cut.content.partition("\n[… ")
    assert head and tail.split("…]\n", 1)[1]  # head and tail both kept, around the marker


def test_a_cut_whose_copy_is_gone_is_made_again_with_its_measured_features() -> None:
    m = row(JSON, thinking="step one; step two. " * 300)
    cut = truncate_for_view(m, 1_500, scaled(1.0))
    fields = (cut.content, cut.thinking)
    del cut
    gc.collect()
    again = truncate_for_view(m, 1_500, scaled(1.0002))
    assert (again.content, again.thinking) == fields
    assert message_features(again) == tokens._features(again)  # the kept features are its own


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([PROSE, JSON, "Сборка упала на шаге миграции. " * 700, "x = f(y)\n" * 2_000]),
    st.integers(200, 6_000),
    st.lists(st.floats(0.9, 1.1), min_size=1, max_size=6),
    st.booleans(),
    st.booleans(),
)
def test_whatever_the_memo_holds_a_cut_is_what_cutting_afresh_gives(
    text: str, budget: int, scales: list[float], calibrated: bool, drop: bool
) -> None:
    m = row(text[: len(text) * 2 // 3], thinking=text[: len(text) // 3])
    for scale in scales:
        counter = scaled(scale) if calibrated else WordCounter(scale)
        cut = truncate_for_view(m, budget, counter)
        alone = truncate_for_view(fresh(m), budget, counter)
        assert (cut.content, cut.thinking) == (alone.content, alone.thinking)
        assert message_features(cut) == tokens._features(cut)
        if counter.count_messages([m]) > budget:
            assert counter.count_messages([cut]) <= budget or not calibrated
        if drop:
            del cut, alone
            gc.collect()


def test_a_message_keeps_a_few_cuts_the_newest() -> None:
    m = row(PROSE)
    for k in range(12):  # fits far apart: each cuts the row at another place
        truncate_for_view(m, 2_000, scaled(1.0 + 0.05 * k))
    made = view_budget._CUTS.get(m, view_budget._no_cuts)
    assert 0 < len(made) <= view_budget._CUTS_KEPT
    newest = truncate_for_view(m, 2_000, scaled(1.0 + 0.05 * 11))
    assert any(cut.ref() is newest for cut in made.values())  # the last fit's cut is among them
