"""The post-turn check skips a session far from every compaction level without reading its view
(``Compactor.far_below``, ``hot_path.post_turn_headroom``), and still checks in full a session
near them, one whose last prompt was truncated, or every session when the headroom is 0."""

from __future__ import annotations

from contextsvc.core.session import ANONYMOUS
from tests.support.compaction_harness import ContextReadingStore, Rig, a, u, words


async def _checked_reads(rig: Rig, sid: str) -> int:
    """Context reads of one post-turn check of ``sid``."""
    assert await rig.engine.post_turn.drain(5)
    before = rig.store.context_reads
    rig.engine.post_turn.schedule(sid)
    assert await rig.engine.post_turn.drain(5)
    return int(rig.store.context_reads - before)


async def _grow_near_a_level(rig: Rig, sid: str) -> None:
    """Append turns until the session is past half its lowest compaction level."""
    info = await rig.session_info(sid)
    bounds = rig.engine.compactor.bounds(await rig.engine._profile_for(info, None))
    k = 0
    while 2 * (await rig.session_info(sid)).context_tokens < min(bounds.trigger, bounds.limit):
        assert k < 500
        await rig.append(sid, u(f"ask {k}"), a(f"answer {k} " + words(60)))
        k += 1


async def test_a_session_far_below_every_level_is_skipped_and_one_near_them_is_checked() -> None:
    rig = await Rig.start(store=ContextReadingStore)
    try:
        sid = await rig.session()
        await rig.append(sid, u("hello"), a("hi " + words(20)))
        view = await rig.build(sid)
        assert (await rig.baseline(sid, view)).recorded
        info = await rig.session_info(sid)
        profile = await rig.engine._profile_for(info, None)
        assert rig.engine.compactor.far_below(profile, info.context_tokens)
        assert await _checked_reads(rig, sid) == 0  # nothing read: the check stopped at once
        # Grow it past half the lowest level: the check reads and prices its view again.
        await _grow_near_a_level(rig, sid)
        assert await _checked_reads(rig, sid) == 1
    finally:
        await rig.close()


async def test_a_truncated_prompt_is_checked_in_full_however_small_the_session() -> None:
    rig = await Rig.start(store=ContextReadingStore)
    try:
        sid = await rig.session()
        await rig.append(sid, u("hello"), a("hi " + words(20)))
        await rig.store.update_state(sid, caller=ANONYMOUS, context_truncated=True)
        assert await _checked_reads(rig, sid) >= 1
    finally:
        await rig.close()


async def test_without_headroom_every_check_is_in_full() -> None:
    rig = await Rig.start(store=ContextReadingStore, hot_path={"post_turn_headroom": 0})
    try:
        sid = await rig.session()
        await rig.append(sid, u("hello"), a("hi " + words(20)))
        assert await _checked_reads(rig, sid) == 1
    finally:
        await rig.close()


async def test_a_baseline_schedules_no_check_of_a_session_it_leaves_far_below_and_one_of_a_session_near() -> None:
    """RecordBaseline judges the session as its anchor wrote it (``Engine._post_turn_profile``):
    no post-turn check is queued for a session far below every level, one is for a session near
    them, and one is for every session when the headroom is 0."""
    for headroom, grow, expect in ((2.0, False, 0), (2.0, True, 1), (0.0, False, 1)):
        rig = await Rig.start(store=ContextReadingStore, hot_path={"post_turn_headroom": headroom})
        try:
            sid = await rig.session()
            await rig.append(sid, u("hello"), a("hi " + words(20)))
            if grow:
                await _grow_near_a_level(rig, sid)
            view = await rig.build(sid)
            assert await rig.engine.post_turn.drain(5)
            before = rig.store.context_reads
            assert (await rig.baseline(sid, view)).recorded
            queued = sid in rig.engine.post_turn._pending
            assert await rig.engine.post_turn.drain(5)
            assert (queued, rig.store.context_reads - before) == (bool(expect), expect), (headroom, grow)
        finally:
            await rig.close()


async def test_a_check_queued_by_a_baseline_near_a_level_reads_the_session_with_its_context() -> None:
    """The baseline found the session near a level, so its check reads both in one store call
    (one statement on PostgreSQL); a check queued otherwise reads the session alone first."""
    rig = await Rig.start(store=ContextReadingStore)
    try:
        sid = await rig.session()
        await _grow_near_a_level(rig, sid)
        view = await rig.build(sid)
        assert await rig.engine.post_turn.drain(5)
        assert (await rig.baseline(sid, view)).recorded
        before = (rig.store.context_reads, rig.store.session_reads)
        assert await rig.engine.post_turn.drain(5)
        assert (rig.store.context_reads - before[0], rig.store.session_reads - before[1]) == (1, 0)
        # Queued by anything else (an append that completes a turn): the session first, then the context.
        before = (rig.store.context_reads, rig.store.session_reads)
        rig.engine.post_turn.schedule(sid)
        assert await rig.engine.post_turn.drain(5)
        assert (rig.store.context_reads - before[0], rig.store.session_reads - before[1]) == (1, 1)
    finally:
        await rig.close()
