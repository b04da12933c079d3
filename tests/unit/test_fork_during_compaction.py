"""ForkSession while a compaction of the parent commits (another request's, the post-turn job's,
another replica's): the fork is a state the parent had, never its rows as one state left them
beside the compaction records of another.

The fork reads the parent's session, then its rows. A compaction committed between the two reads
demoted the old rows, and its summary and compression record lie past the number the fork read
first: a fork that read only up to that number saw the demotions without the record that says
what they were, and came out with the newest turns alone, neither the old context nor the summary
standing for it (seen with two PostgreSQL replicas, a fork on one and Compress on the other)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from contextsvc.core.session import ANONYMOUS
from contextsvc.stores.memory import MemoryStore
from tests.support.compaction_harness import Rig


class CompactsBeforeRowsRead(MemoryStore):
    """Runs ``before_rows`` (once) at the start of the next ``get_messages``: a compaction that
    commits between the fork's read of the session and its read of the rows."""

    before_rows: Callable[[], Awaitable[Any]] | None = None

    async def get_messages(self, session_id: str, *, caller: Any, first: int, last: int) -> Any:
        hook, self.before_rows = self.before_rows, None
        if hook is not None:
            await hook()
        return await super().get_messages(session_id, caller=caller, first=first, last=last)


async def test_a_fork_racing_a_compaction_keeps_the_context_the_parent_had_at_its_point() -> None:
    rig = await Rig.start(store=CompactsBeforeRowsRead)
    try:
        sid = await rig.session_of_turns(12)
        before = [m.content for m in await rig.context(sid)]
        store = rig.store
        assert isinstance(store, CompactsBeforeRowsRead)
        compacted, compact = rig.compaction_of(sid)
        store.before_rows = compact
        fork = await rig.engine.sessions.fork(ANONYMOUS, sid, at_sequence=0)
        assert compacted and compacted[0].compressed  # the compaction did commit in between
        after = [m.content for m in await rig.context(sid)]
        assert after != before
        # The fork is the parent as it stood at the fork's point: before that compaction.
        forked = [m.content for m in await rig.context(fork.id)]
        assert forked == before, (len(forked), len(before), len(after))
    finally:
        await rig.close()
