"""ForkSession and a crash part-way: after a restart the fork is there whole or not at all.

A fork is several writes (the new session, its rows, its engine state, the history chunks of the
rows it inherits as demoted). Made as separate store calls, a crash after the first left a session
named "… (fork)" with none or part of the parent's rows, which the client, told the call failed,
never learns of. The store now creates the fork with all of it in one step."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from contextsvc.core.session import ANONYMOUS
from contextsvc.errors import Unavailable
from contextsvc.stores import files
from tests.support.compaction_harness import Rig
from tests.support.stores import FilesBacking


class _Crash(Exception):
    """The process stops here: nothing after this point reaches the disk."""


def _crash_at(store: Any, step: int) -> list[str]:
    """Make the ``step``-th durable write of ``store`` (from now on) a crash; returns the writes made."""
    made: list[str] = []
    for name in ("_persist_create", "_persist", "_persist_history"):
        original = getattr(store, name)

        async def write(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            made.append(_name)
            if len(made) == step:
                raise _Crash(_name)
            return await _original(*args, **kwargs)

        setattr(store, name, write)
    return made


async def _rows(rig: Rig, sid: str) -> list[tuple[str, bool]]:
    info = await rig.store.get_session(sid, caller=ANONYMOUS)
    rows = await rig.store.get_messages(sid, caller=ANONYMOUS, first=1, last=info.last_sequence)
    return [(m.content, m.flags.is_context) for m in rows]


# The fork's durable writes: its history chunks, then its log (one file: header, rows and state).
# Step 3 is past them: the fork completes.
@pytest.mark.parametrize("step", [1, 2, 3])
async def test_a_fork_cut_by_a_crash_is_whole_or_absent_after_a_restart(tmp_path: Path, step: int) -> None:
    backing = FilesBacking(tmp_path)
    rig = await Rig.over(backing)
    try:
        parent = await rig.session_of_turns(12)
        report = await rig.compress(parent)
        assert report.compressed  # the fork inherits demoted rows and their history chunks
        expected = await _rows(rig, parent)
        assert any(not in_context for _, in_context in expected)
        made = _crash_at(rig.store, step)
        try:
            await rig.engine.sessions.fork(
                ANONYMOUS, parent, at_sequence=0, chunks_of=rig.engine.compactor.history_chunks
            )
        except _Crash:
            crashed = True
        else:
            crashed = False
        assert made  # the fork wrote something
        await rig.engine.close()
        rig = await Rig.over(backing)  # the restart: a new store over the same directory
        page = await rig.store.list_sessions(caller=ANONYMOUS, limit=10)
        forks = [s.id for s in page.sessions if s.id != parent]
        assert crashed == (step <= 2), made
        if crashed and not forks:
            return
        assert len(forks) == 1
        assert await _rows(rig, forks[0]) == expected
        found = await rig.store.search_history(forks[0], "module_0.py", limit=5)
        assert found, "the fork's inherited demoted rows are searchable"
    finally:
        await rig.close()
        await backing.dispose()


async def test_a_fork_the_disk_refuses_leaves_no_session_and_no_history_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backing = FilesBacking(tmp_path)
    rig = await Rig.over(backing)
    try:
        parent = await rig.session_of_turns(12)
        assert (await rig.compress(parent)).compressed
        history_dir = rig.store._history_dir
        before = sorted(p.name for p in history_dir.iterdir())

        def full(path: Path, data: bytes) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(files, "_create_file", full)
        with pytest.raises(Unavailable):
            await rig.engine.sessions.fork(
                ANONYMOUS, parent, at_sequence=0, chunks_of=rig.engine.compactor.history_chunks
            )
        monkeypatch.undo()
        page = await rig.store.list_sessions(caller=ANONYMOUS, limit=10)
        assert [s.id for s in page.sessions] == [parent]
        assert sorted(p.name for p in history_dir.iterdir()) == before
        # The disk back: the same fork goes through whole.
        fork = await rig.engine.sessions.fork(
            ANONYMOUS, parent, at_sequence=0, chunks_of=rig.engine.compactor.history_chunks
        )
        assert await _rows(rig, fork.id) == await _rows(rig, parent)
        assert await rig.store.search_history(fork.id, "module_0.py", limit=5)
    finally:
        await rig.close()
        await backing.dispose()
