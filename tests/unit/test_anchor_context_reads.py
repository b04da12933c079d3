"""A baseline's anchor reads the session's context only when rows came after its view: the new
baseline is the view's real count plus what was appended since, and when nothing was, the count
alone, without a read of the context."""

from __future__ import annotations

from contextsvc.core.session import ANONYMOUS
from tests.support.compaction_harness import ContextReadingStore, Rig, a, u, words


async def test_an_anchor_of_the_newest_view_reads_no_context_and_one_with_newer_rows_counts_them() -> None:
    rig = await Rig.start(store=ContextReadingStore)
    try:
        sid = await rig.session()
        await rig.append(sid, u("hello"), a("hi " + words(20)))
        view = await rig.build(sid)
        before = rig.store.context_reads
        assert (await rig.engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=500)).recorded
        assert await rig.engine.anchors_applied(5)
        assert rig.store.context_reads == before  # nothing newer than the view: the count alone
        assert (await rig.session_info(sid)).context_tokens == 500

        view = await rig.build(sid)
        await rig.append(sid, u("one more " + words(30)))
        newest = (await rig.context(sid))[-1]
        before = rig.store.context_reads
        assert (await rig.engine.record_baseline(ANONYMOUS, sid, view_id=view.view_id, prompt_tokens=600)).recorded
        assert await rig.engine.anchors_applied(5)
        assert rig.store.context_reads > before  # a row came after the view: read to price it
        added = rig.engine.accounting.messages_tokens("m", [newest])
        assert added > 0
        assert (await rig.session_info(sid)).context_tokens == 600 + added
    finally:
        await rig.close()
