"""A process killed right after a compaction commits must not leave the rows that compaction took
out of the context unsearchable (DESIGN §5.6).

The crash probe found it by killing a real server (files store, fsync) at random moments: rows a
compaction had demoted were in the display history and out of the context, but ``SearchHistory``
(and recall) could not find them, ever again, because the engine wrote their chunks to the raw
history index only after the compaction's record was on disk. Here the kill is placed exactly:
the store stops writing anything the moment the compaction's commit returns, as a killed process
would, and a new store then reads the data directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contextsvc.config import Durability
from contextsvc.core.session import ANONYMOUS
from contextsvc.ports import HistoryChunk
from contextsvc.stores._session import SessionState
from contextsvc.stores.files import FilesStore
from tests.support.compaction_harness import Rig, a, make_settings, overrides, t, u, words


class KilledAfterCommit(FilesStore):
    """Once a compaction's commit returned, nothing more reaches the disk (the process is gone)."""

    killed = False

    async def commit_compaction(self, session_id: str, **kwargs: Any) -> list[int]:
        seqs = await super().commit_compaction(session_id, **kwargs)
        self.killed = True
        return seqs

    async def _persist_history(self, st: SessionState, chunks: Any) -> None:
        if self.killed:
            raise OSError("the process was killed")
        await super()._persist_history(st, chunks)


async def test_rows_a_compaction_demoted_stay_searchable_when_the_process_dies_right_after_its_commit(
    tmp_path: Path,
) -> None:
    settings = make_settings(durability=Durability.FSYNC)
    store = KilledAfterCommit(tmp_path / "data", settings)
    await store.open()
    rig = Rig(settings, opened=store)
    try:
        sid = await rig.session()
        for k in range(10):
            await rig.append(
                sid,
                u(f"ask {k}: look at module_{k}.py"),
                a("", (f"c{k}", "read_file")),
                t(f"c{k}", f"zqmark{k}x " + words(120)),
                a(f"module_{k}.py is fine"),
            )
        report = await rig.compress(sid, profile=overrides(strategies=["summarize"]))
        assert report.compressed and store.killed
        demoted = [m for m in await rig.rows(sid) if m.tool_call_id and not m.flags.is_context]
        assert demoted, "the compaction took tool results out of the context"
    finally:
        await rig.close()

    again = FilesStore(tmp_path / "data", settings)
    await again.open()
    try:
        for m in demoted:
            token = m.content.split()[0]
            found = await again.search_history(sid, token, limit=5)
            assert any(token in s.chunk.text for s in found), f"#{m.sequence_number} ({token}) is not searchable"
        # The same chunks the engine would have written: nothing was written twice either.
        chunks: list[HistoryChunk] = [s.chunk for s in await again.search_history(sid, "zqmark0x", limit=50)]
        assert len({c.content_hash for c in chunks}) == len(chunks)
        assert (await again.get_session(sid, caller=ANONYMOUS)).id == sid
    finally:
        await again.close()
