"""An anchored estimate of a view that cuts a long row elsewhere than the baseline's view did.

A baseline refits the calibration, and the new fit moves where the view cuts a row over the
per-message budget. The anchor (the baseline's real count) holds the cut its own view sent, so the
next view must price the difference, or a view sending ~1,400 tokens read ~950.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from contextsvc.core.calibration import Calibration
from contextsvc.core.messages import Message, Role
from contextsvc.core.priors import N_FEATURES, family_for, prior_for
from contextsvc.core.session import ANONYMOUS
from contextsvc.core.tokens import CalibratedCounter, message_features
from contextsvc.core.view_budget import truncate_for_view
from contextsvc.engine.engine import Engine
from contextsvc.engine.state import BaselineState, EngineState
from contextsvc.engine.views import _recut_tokens, _view_cuts
from contextsvc.stores.memory import MemoryData
from tests.unit.test_engine_tokens import _build, _engine, _msg, _session_with_a_long_tool_result, _settings


def _provider_count(view: Any) -> int:
    """What a provider whose tokenizer reads this log at ~4 characters a token counts for a view
    (the cold prior reads it at ~2.7: the first baseline teaches a much cheaper price)."""
    total = 0
    for vm in view.messages:
        m = vm.message
        text = len(m.content) + sum(len(c.name) + len(c.arguments_json) for c in m.tool_calls)
        total += 4 + math.ceil(text / 4.0)
    return total


async def _anchored_after_a_cheaper_count(engine: Engine) -> tuple[str, Any, Any]:
    """A session with a long tool result, its first view, and the view built after the provider's
    count of that first one was recorded (the refit cut the log elsewhere)."""
    sid, _ = await _session_with_a_long_tool_result(engine)
    first = await _build(engine, sid)
    recorded = await engine.record_baseline(ANONYMOUS, sid, view_id=first.view_id, prompt_tokens=_provider_count(first))
    assert recorded.recorded and not recorded.truncated
    return sid, first, recorded


def _cut_chars(view: Any) -> list[int]:
    return [len(vm.message.content) for vm in view.messages if vm.truncated]


async def test_a_row_cut_elsewhere_after_a_refit_is_priced_against_the_anchor() -> None:
    engine, _ = await _engine(_settings(context_window=8192))
    sid, first, _ = await _anchored_after_a_cheaper_count(engine)
    second = await _build(engine, sid)
    assert second.estimate.method.value == "baseline_delta"
    # The cheaper fit lets the view keep more of the log than the anchored view sent.
    assert _cut_chars(second)[0] > _cut_chars(first)[0] * 1.2
    real = _provider_count(second)
    # Before: 954 against 1,400 (the anchor counted the shorter cut, and nothing added the rest).
    assert abs(second.estimate.total - real) <= real * 0.03, (second.estimate.total, real)
    # Rows appended after it are priced on top, the re-cut still counted.
    turn = [_msg(Role.USER, "What failed?"), _msg(Role.ASSISTANT, "Nothing did.")]
    await engine.append(ANONYMOUS, sid, turn, request_id="", turn_complete=False)
    third = await _build(engine, sid)
    assert _cut_chars(third) == _cut_chars(second)
    assert abs(third.estimate.total - _provider_count(third)) <= _provider_count(third) * 0.03


async def test_a_restarted_engine_prices_the_re_cut_from_the_anchor_it_reads() -> None:
    """The anchor keeps the baseline's cuts in the session's state: a new process (nothing in its
    view memo) assembling the view from scratch prices the same difference."""
    data = MemoryData()
    engine, _ = await _engine(_settings(context_window=8192), data)
    sid, first, _ = await _anchored_after_a_cheaper_count(engine)
    state = EngineState.of(await engine.store.get_session(sid, caller=ANONYMOUS))
    assert state.baseline is not None
    assert [seq for seq, _ in state.baseline.cuts] == [3]  # the tool result, as the first view cut it
    assert EngineState.from_dict(state.to_dict()) == state
    restarted, _ = await _engine(_settings(context_window=8192), data)
    again = await _build(restarted, sid)
    assert _cut_chars(again) != _cut_chars(first)
    real = _provider_count(again)
    assert abs(again.estimate.total - real) <= real * 0.03, (again.estimate.total, real)


def _counter() -> CalibratedCounter:
    prior = prior_for(family_for("m", {}))
    return CalibratedCounter(Calibration(weights=prior.weights, observations=0, fitted=False, margin=0.2))


def test_the_difference_of_each_row_cut_otherwise_whole_or_alike() -> None:
    counter = _counter()
    price = counter.calibration.price
    log = dataclasses.replace(
        Message(Role.TOOL, "".join(f"line {i}: build step ok\n" for i in range(2000)), tool_call_id="c1"),
        sequence_number=4,
    )
    short = truncate_for_view(log, 500, counter)
    longer = truncate_for_view(log, 900, counter)
    assert short is not log and longer is not log and len(longer.content) > len(short.content)

    def anchor(*cuts: tuple[int, tuple[int, ...]]) -> BaselineState:
        return BaselineState(tokens=1000, last_sequence=6, view_id="v", cuts=tuple(cuts))

    gained = round(price(message_features(longer)) - price(message_features(short)))
    assert gained > 0
    # Cut shorter then, longer now: the difference is added.
    assert _recut_tokens(anchor((4, message_features(short))), counter, [(log, longer)], [longer]) == gained
    # Cut the same way: nothing.
    assert _recut_tokens(anchor((4, message_features(short))), counter, [(log, short)], [short]) == 0
    # Whole then (no cut named), cut now: what the cut leaves out is taken off.
    whole = round(price(message_features(log)) - price(message_features(short)))
    assert _recut_tokens(anchor(), counter, [(log, short)], [short]) == -whole
    # Cut then, whole now: what the row sends more is added.
    assert _recut_tokens(anchor((4, message_features(short))), counter, [], [log]) == whole
    # A row newer than the anchor's view is the delta's, not the anchor's.
    newer = dataclasses.replace(log, sequence_number=9)
    assert _recut_tokens(anchor(), counter, [(newer, short)], [short]) == 0
    # An anchor whose cuts are not known (made before they were kept): every row as its count held it.
    unknown = BaselineState(tokens=1000, last_sequence=6, view_id="v")
    assert unknown.cuts is None and _recut_tokens(unknown, counter, [(log, short)], [short]) == 0


def test_an_anchor_reads_no_cuts_it_cannot_price() -> None:
    """Cuts of another feature set (an upgrade since) or damaged ones are dropped, not fatal: the
    anchor then prices every row as its baseline counted it, as before cuts were kept."""
    good = [[3, list(range(N_FEATURES))]]
    for raw, expect in (
        (good, ((3, tuple(range(N_FEATURES))),)),
        ([], ()),
        ("3:" + ",".join(map(str, range(N_FEATURES))), ((3, tuple(range(N_FEATURES))),)),  # as state keeps them
        ("", ()),
        ("3:1,2,3", None),
        ("3;4", None),
        ([[3, [1, 2, 3]]], None),
        ("nonsense", None),
        ([[3]], None),
        (None, None),
    ):
        state = EngineState.from_dict({"baseline": {"tokens": 10, "last_sequence": 3, "cuts": raw}})
        assert state.baseline is not None and state.baseline.cuts == expect


async def test_an_anchor_made_before_cuts_were_kept_prices_its_rows_as_its_count_held_them() -> None:
    """A session anchored by an older release (no cuts in its state): the rows it counted are priced
    as that count held them, as before. Taken as "nothing was cut", the whole log was taken off the
    count and the view read 1 token for a prompt of 1,386."""
    data = MemoryData()
    engine, _ = await _engine(_settings(context_window=8192), data)
    sid, _, _ = await _anchored_after_a_cheaper_count(engine)
    session = await engine.store.get_session(sid, caller=ANONYMOUS)
    older = EngineState.of(session).to_dict()
    del older["baseline"]["cuts"]
    await engine.store.update_state(sid, caller=ANONYMOUS, state=older)
    restarted, _ = await _engine(_settings(context_window=8192), data)
    again = await _build(restarted, sid)
    assert again.estimate.method.value == "baseline_delta"
    assert again.estimate.total == older["baseline"]["tokens"]  # no row since: the count as it was


def test_a_view_cutting_more_rows_than_kept_records_its_cuts_as_not_known() -> None:
    rows = [
        dataclasses.replace(Message(Role.TOOL, f"cut {k}", tool_call_id=f"c{k}"), sequence_number=k + 1)
        for k in range(3)
    ]
    assert _view_cuts(rows, [True, False, True], 2) == ((1, message_features(rows[0])), (3, message_features(rows[2])))
    assert _view_cuts(rows, [True, True, True], 2) is None
    assert _view_cuts(rows, [False, False, False], 2) == ()
