"""A baseline's anchor applied the locked way (``ViewService.apply_anchor``: something was appended
since the view, so the one-statement anchor does not apply) keeps what an append committed while
it was written added to the session's context tokens.

Appends take no compaction lock. The anchor read the session, priced the rows after the view and
wrote the session's context tokens as an absolute number: an append (on another replica, or here)
committed between that read and that write had its tokens overwritten, and the session's count
stayed short by them until the next anchor or compaction (seen with two PostgreSQL replicas: short
by exactly one append's tokens in a third of the turns whose baseline raced an append)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from contextsvc.stores.memory import MemoryStore
from tests.support.compaction_harness import Rig, u, words


class AppendsBeforeStateWrite(MemoryStore):
    """Runs ``before_write`` (once) at the start of the next ``update_state`` that sets context
    tokens: an append that commits between the anchor's read and its write."""

    before_write: Callable[[], Awaitable[Any]] | None = None

    async def update_state(self, session_id: str, **kwargs: Any) -> Any:
        hook = self.before_write
        if hook is not None and kwargs.get("context_tokens") is not None:
            self.before_write = None
            await hook()
        return await super().update_state(session_id, **kwargs)


async def test_an_anchor_written_the_locked_way_keeps_an_append_committed_meanwhile() -> None:
    rig = await Rig.start(store=AppendsBeforeStateWrite)
    try:
        sid = await rig.session_of_turns(4, answer_words=40)
        view = await rig.build(sid, auto=False)
        view_last = max(vm.message.sequence_number for vm in view.messages)
        # Appended after the view: its baseline is anchored the locked way.
        await rig.append(sid, u("one more question " + words(20)))
        store = rig.store
        assert isinstance(store, AppendsBeforeStateWrite)
        raced: list[int] = []
        added: list[int] = []
        priced_at_read: list[int] = []

        async def append_meanwhile() -> None:
            # What the anchor read: the rows after its view, before this append.
            newer = [m for m in await rig.context(sid) if m.sequence_number > view_last]
            priced_at_read.append(rig.engine.accounting.messages_tokens("m", newer))
            before = (await rig.session_info(sid)).context_tokens
            raced.extend(await rig.append(sid, u("and another, sent meanwhile " + words(30))))
            added.append((await rig.session_info(sid)).context_tokens - before)

        store.before_write = append_meanwhile
        result = await rig.baseline(sid, view)
        assert result.recorded
        assert await rig.engine.anchors_applied(5)
        assert raced and added[0] > 0  # the append did commit between the anchor's read and its write
        info = await rig.session_info(sid)
        baseline = info.state.get("baseline") or {}
        assert baseline.get("last_sequence") == view_last, info.state  # anchored to the view
        # The view's real count, the rows after it as the anchor priced them, and the append.
        assert info.context_tokens == int(baseline["tokens"]) + priced_at_read[0] + added[0]
    finally:
        await rig.close()
