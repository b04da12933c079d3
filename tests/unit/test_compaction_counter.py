"""The compaction's counter prices rows as the view shows them (``Compactor.counter``).

Rows not shown yet are checked at once: when the largest of their features fit one message's
budget, none of them is priced alone. These tests hold it to the row-by-row price the view's
rules give (``truncate_for_view`` of each row, images as the view prices them), with rows under
the budget, rows over it and pinned rows (a row with an image is always priced alone).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from contextsvc.core.messages import Flags, Message, Role
from contextsvc.core.profile import EffectiveProfile
from contextsvc.core.tokens import TextCounter, each_message_features, image_tokens_of
from contextsvc.core.view_budget import additive, budget_images, column_max, none_cut, truncate_for_view
from contextsvc.engine.compaction import _shared_shown
from tests.support.compaction_harness import Rig, words


def _by_row(rows: Sequence[Message], profile: EffectiveProfile, text: TextCounter, fallback: int) -> int:
    budget = profile.per_message_budget
    cut = []
    for m in rows:
        shown = truncate_for_view(m, budget, text)
        if shown.images and not profile.vision:
            shown = budget_images([shown], window=profile.context_window, text_tokens=0, vision=False).messages[0]
        cut.append(shown)
    return text.count_messages(cut) + image_tokens_of(cut, fallback_tokens=fallback)


async def _profile(rig: Rig, sid: str) -> EffectiveProfile:
    session = await rig.session_info(sid)
    return await rig.engine._profile_for(session, None)


def _rows(rng: random.Random, n: int, *, long_every: int, budget_words: int) -> list[Message]:
    rows = []
    for i in range(n):
        size = budget_words * 3 if long_every and i % long_every == 3 else rng.randint(3, budget_words // 4)
        pinned = i % 17 == 5
        rows.append(
            Message(
                role=Role.USER if i % 2 == 0 else Role.ASSISTANT,
                content=f"row {i} {words(size, rng)}",
                sequence_number=i + 1,
                flags=Flags(is_pinned=True) if pinned else Flags(),
            )
        )
    return rows


async def test_the_counter_prices_what_a_row_by_row_pass_prices() -> None:
    rig = await Rig.start()
    try:
        sid = await rig.session()
        profile = await _profile(rig, sid)
        fallback = rig.settings.tokens.image_tokens_fallback
        budget_words = max(16, profile.per_message_budget // 2)
        rng = random.Random(7)
        for long_every in (0, 9):
            for n in (1, 2, 40, 300):
                rows = _rows(rng, n, long_every=long_every, budget_words=budget_words)
                text = rig.engine.accounting.counter(profile.model)
                want = _by_row(rows, profile, text, fallback)
                # Within a compaction (the shown rows kept between counts) and outside one.
                with _shared_shown():
                    count = rig.engine.compactor.counter(profile)
                    assert count(rows) == want
                    assert count(rows[: n // 2]) == _by_row(rows[: n // 2], profile, text, fallback)
                    assert count(rows) == want
                assert rig.engine.compactor.counter(profile)(rows) == want
    finally:
        await rig.close()


async def test_rows_over_the_budget_are_still_cut_and_rows_under_it_are_not() -> None:
    rig = await Rig.start()
    try:
        sid = await rig.session()
        profile = await _profile(rig, sid)
        text = rig.engine.accounting.counter(profile.model)
        budget_words = max(16, profile.per_message_budget // 2)
        rng = random.Random(11)
        short = _rows(rng, 50, long_every=0, budget_words=budget_words)
        long = _rows(rng, 50, long_every=9, budget_words=budget_words)
        # The check the counter relies on tells the two apart...
        budget = profile.per_message_budget
        assert additive(text)
        assert none_cut(text, column_max(each_message_features([m for m in short if not m.flags.is_pinned])), budget)
        assert not none_cut(text, column_max(each_message_features(long)), budget)
        # ... and the long rows are priced cut: less than they cost whole.
        count = rig.engine.compactor.counter(profile)
        assert count(long) < text.count_messages(long)
        assert count(short) == text.count_messages(short)
    finally:
        await rig.close()
