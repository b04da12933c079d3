"""A compaction that commits after appends it did not read (they take no compaction lock: another
replica's, or this one's while the summarizer ran) keeps their tokens in the session's count.

The commit set the session's context tokens to the count of the context it had compacted: the
rows appended meanwhile stay in the context (the commit does not touch them) but their tokens were
dropped from the count, which stayed short by them until the next anchor or compaction (seen with
two PostgreSQL replicas: short by one to four appends' tokens whenever Compress raced appends)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from contextsvc.stores.memory import MemoryStore
from tests.support.compaction_harness import Rig, a, u, words


class AppendsBeforeCommit(MemoryStore):
    """Runs ``before_commit`` (once) at the start of the next ``commit_compaction``: appends
    that commit between the compaction's read of the context and its commit."""

    before_commit: Callable[[], Awaitable[Any]] | None = None

    async def commit_compaction(self, session_id: str, **kwargs: Any) -> list[int]:
        hook, self.before_commit = self.before_commit, None
        if hook is not None:
            await hook()
        return await super().commit_compaction(session_id, **kwargs)


async def _counts_after_compress(race: bool) -> tuple[int, int]:
    """The session's context tokens after a forced compaction with two appends made just before
    its commit (``race``) or just after it, and the tokens those appends added."""
    rig = await Rig.start(store=AppendsBeforeCommit)
    try:
        sid = await rig.session()
        for k in range(12):
            await rig.append(sid, u(f"ask {k} about module_{k}.py"), a(f"answer {k} " + words(80)))
        store = rig.store
        assert isinstance(store, AppendsBeforeCommit)
        added: list[int] = []

        async def two_appends() -> None:
            before = (await rig.session_info(sid)).context_tokens
            await rig.append(sid, u("a question sent meanwhile " + words(30)))
            await rig.append(sid, u("and one more " + words(20)))
            added.append((await rig.session_info(sid)).context_tokens - before)

        if race:
            store.before_commit = two_appends
        report = await rig.compress(sid)
        assert report.compressed
        if not race:
            await two_appends()
        assert added and added[0] > 0
        return (await rig.session_info(sid)).context_tokens, added[0]
    finally:
        await rig.close()


async def test_appends_committed_during_a_compaction_stay_in_the_session_count() -> None:
    calm, added = await _counts_after_compress(race=False)
    raced, added_raced = await _counts_after_compress(race=True)
    assert added_raced == added
    # The same rows in the same context: the same count, whichever committed first.
    assert raced == calm, (raced, calm, added)
