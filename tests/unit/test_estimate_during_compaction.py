"""EstimateTokens of a session while a compaction of it commits (another request's, the post-turn
job's, another replica's) prices a state the session had: the one before the compaction or the
one after it.

It read the session (with its baseline, the real count of the last view) and then the context
buffer apart: a compaction committed between the two reads paired the pre-compaction baseline
with the compacted context, and baseline + delta counted the dropped turns and their summary both,
more than either state holds (seen with two PostgreSQL replicas, EstimateTokens on one while
Compress ran on the other). BuildContext reads both at one moment (``context_and_session``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from contextsvc.stores.memory import MemoryStore
from tests.support.compaction_harness import Rig


class CompactsBeforeContextRead(MemoryStore):
    """Runs ``before_context`` (once) at the start of the next ``load_context``: a compaction that
    commits between a read of the session and a read of its context."""

    before_context: Callable[[], Awaitable[Any]] | None = None

    async def load_context(self, session_id: str, *, caller: Any) -> Any:
        hook, self.before_context = self.before_context, None
        if hook is not None:
            await hook()
        return await super().load_context(session_id, caller=caller)


async def test_an_estimate_racing_a_compaction_prices_the_state_before_or_after_it() -> None:
    rig = await Rig.start(store=CompactsBeforeContextRead)
    try:
        sid = await rig.session_of_turns(12)
        view = await rig.build(sid, auto=False)
        assert (await rig.baseline(sid, view)).recorded  # the session is anchored to a real count
        before = await rig.estimate(sid)
        store = rig.store
        assert isinstance(store, CompactsBeforeContextRead)
        compacted, compact = rig.compaction_of(sid)
        store.before_context = compact
        raced = await rig.estimate(sid)
        if not compacted:  # read at one moment: the compaction did not come between; run it now
            store.before_context = None
            await compact()
        assert compacted[0].compressed
        after = await rig.estimate(sid)
        assert after < before
        assert raced in (before, after), (raced, before, after)
    finally:
        await rig.close()
