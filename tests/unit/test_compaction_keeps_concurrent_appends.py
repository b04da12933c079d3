"""A compaction that commits after appends it did not read (they take no compaction lock: another
replica's, or this one's while the summarizer ran) keeps their tokens in the session's count.

The commit set the session's context tokens to the count of the context it had compacted: the
rows appended meanwhile stay in the context (the commit does not touch them) but their tokens were
dropped from the count, which stayed short by them until the next anchor or compaction (seen with
two PostgreSQL replicas: short by one to four appends' tokens whenever Compress raced appends)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from contextsvc.core.session import ANONYMOUS
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
        sid = await rig.session_of_turns(12)
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


async def _count_after_preturn(anchored: bool) -> int:
    """The session's context tokens after a build's pre-turn compaction, with a baseline anchored
    (``anchored``) after the build read the session and before it took the compaction lock."""
    rig = await Rig.start()
    try:
        sid = await rig.session()
        k = 0
        while await rig.estimate(sid) < rig.window:  # past the pre-turn trigger
            assert k < 500
            await rig.append(sid, u(f"ask {k} about module_{k}.py"), a(f"answer {k} " + words(80)))
            k += 1
        hooks: list[Callable[[], Awaitable[Any]]] = []

        async def anchor() -> None:
            # As an anchor writes it: the same rows, re-counted from a provider's real count.
            info = await rig.session_info(sid)
            await rig.store.update_state(sid, caller=ANONYMOUS, context_tokens=info.context_tokens + 500)

        if anchored:
            hooks.append(anchor)
        locked = rig.engine.compactor.lock

        @contextlib.asynccontextmanager
        async def lock(session_id: str, *, wait: float | None = None) -> AsyncIterator[None]:
            while hooks:
                await hooks.pop()()
            async with locked(session_id, wait=wait):
                yield

        rig.engine.compactor.lock = lock  # type: ignore[method-assign]
        view = await rig.build(sid)
        assert view.compression is not None and view.compression.compressed
        assert not hooks
        return (await rig.session_info(sid)).context_tokens
    finally:
        await rig.close()


async def test_a_compaction_counts_the_context_it_left_whatever_an_anchor_wrote_before_its_lock() -> None:
    assert await _count_after_preturn(anchored=True) == await _count_after_preturn(anchored=False)
