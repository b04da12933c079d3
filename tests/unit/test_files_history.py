"""What only the files store has for the raw history index: its file, lazy loading, recovery,
durability modes and I/O failures that leave the session alone."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

import contextsvc.stores.files as files_module
from contextsvc.config import Durability, Settings
from contextsvc.core.messages import Message, Role
from contextsvc.core.session import Principal
from contextsvc.errors import Unavailable
from contextsvc.ports import HistoryChunk
from contextsvc.stores.files import FilesStore
from tests.support.stores import TickingClock

ALICE = Principal(user_id="alice")


def chunk(text: str, seq: int) -> HistoryChunk:
    return HistoryChunk(f"hash-{text}", text, seq, seq, None, None, ("crumb",))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "data"


async def opened(root: Path, **kw: Any) -> FilesStore:
    store = FilesStore(root, Settings(**{"durability": Durability.FSYNC, **kw}), clock=TickingClock())
    await store.open()
    return store


def history_of(root: Path, sid: str) -> Path:
    return root / "history" / f"{sid}.jsonl"


async def new_session(store: FilesStore) -> str:
    return (await store.create_session(caller=ALICE, profile_id="p")).id


async def found(store: FilesStore, sid: str, query: str) -> list[str]:
    return [s.chunk.text for s in await store.search_history(sid, query, limit=20)]


async def test_the_file_is_made_by_the_first_chunks_one_line_each(root: Path) -> None:
    store = await opened(root)
    sid = await new_session(store)
    assert not history_of(root, sid).exists()  # a session without chunks has no file
    await store.add_history_chunks(sid, [chunk("alpha one", 1), chunk("alpha two", 2)])
    await store.add_history_chunks(sid, [chunk("alpha one", 1), chunk("alpha three", 3)])
    lines = [json.loads(line)["r"] for line in history_of(root, sid).read_bytes().splitlines()]
    assert [(d["t"], d["text"], d["first"], d["crumbs"]) for d in lines] == [
        ("chunk", "alpha one", 1, ["crumb"]),
        ("chunk", "alpha two", 2, ["crumb"]),
        ("chunk", "alpha three", 3, ["crumb"]),
    ]
    await store.close()


async def test_history_is_loaded_on_first_use_not_at_open(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = await opened(root)
    sid = await new_session(store)
    await store.add_history_chunks(sid, [chunk("alpha one", 1), chunk("alpha two", 2)])
    await store.close()
    with history_of(root, sid).open("ab") as fh:
        fh.write(b'{"t":"chunk","hash":"torn","te')  # a crash in the middle of an append

    with caplog.at_level(logging.WARNING, logger="contextsvc.stores.files"):
        store = await opened(root)
        assert store.stats.recovered_histories == 0 and not caplog.records  # open() did not read it
        assert sorted(await found(store, sid, "alpha")) == ["alpha one", "alpha two"]
    assert store.stats.recovered_histories == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "torn" in warnings[0] and sid in warnings[0]
    (aside,) = (root / "history").glob(f"{sid}.jsonl.torn-*")
    assert aside.read_bytes().endswith(b'"te')
    # Rewritten without the torn line: later appends are readable on the next load.
    assert await store.add_history_chunks(sid, [chunk("alpha three", 3)]) == 1
    await store.close()
    store = await opened(root)
    assert len(await found(store, sid, "alpha")) == 3
    assert store.stats.recovered_histories == 0
    await store.close()


async def test_a_corrupt_line_costs_only_that_chunk(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = await opened(root)
    sid = await new_session(store)
    await store.add_history_chunks(sid, [chunk(f"alpha {n}", n) for n in range(1, 4)])
    await store.close()
    path = history_of(root, sid)
    lines = path.read_bytes().split(b"\n")
    lines[1] = b'{"t":"chunk","hash":7}'  # valid JSON, not a chunk
    path.write_bytes(b"\n".join(lines))

    store = await opened(root)
    with caplog.at_level(logging.ERROR, logger="contextsvc.stores.files"):
        assert sorted(await found(store, sid, "alpha")) == ["alpha 1", "alpha 3"]
    assert any("corrupt" in r.getMessage() and "line 2" in r.getMessage() for r in caplog.records)
    assert len(list((root / "history").glob(f"{sid}.jsonl.corrupt-*"))) == 1
    # The lost chunk can be indexed again.
    assert await store.add_history_chunks(sid, [chunk("alpha 2", 2)]) == 1
    await store.close()


async def test_io_errors_are_unavailable_and_leave_the_session_alone(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await opened(root)
    sid = await new_session(store)
    await store.add_history_chunks(sid, [chunk("alpha one", 1)])
    before = await store.get_session(sid, caller=ALICE)
    real = files_module._append_at

    def disk_full(path: Path, *args: Any) -> int:
        if path.parent.name == "history":
            raise OSError(28, "No space left on device")
        return real(path, *args)

    monkeypatch.setattr(files_module, "_append_at", disk_full)
    with pytest.raises(Unavailable):
        await store.add_history_chunks(sid, [chunk("alpha two", 2)])
    # Nothing half-indexed, and the session goes on.
    assert await found(store, sid, "alpha") == ["alpha one"]
    assert await store.get_session(sid, caller=ALICE) == before
    await store.append_messages(sid, [Message(role=Role.USER, content="still here")], caller=ALICE)
    monkeypatch.undo()
    assert await store.add_history_chunks(sid, [chunk("alpha two", 2)]) == 1
    await store.close()

    store = await opened(root)

    def unreadable(self: FilesStore, session_id: str) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(FilesStore, "_read_history", unreadable)
    with pytest.raises(Unavailable):
        await store.search_history(sid, "alpha", limit=5)
    assert (await store.get_session(sid, caller=ALICE)).last_sequence == 1
    monkeypatch.undo()
    assert len(await found(store, sid, "alpha")) == 2
    await store.close()


async def test_fsync_mode_fsyncs_every_append(root: Path, fsynced: list[str]) -> None:
    store = await opened(root)
    sid = await new_session(store)
    path = str(history_of(root, sid).resolve())
    fsynced.clear()
    await store.add_history_chunks(sid, [chunk("alpha one", 1)])
    # Created atomically: the temp file, then the folder holding its new name.
    assert [Path(p).parent.name for p in fsynced] == ["history", "data"]
    assert Path(fsynced[0]).name.startswith(f".{sid}.jsonl.") and fsynced[1] == str(Path(path).parent)
    fsynced.clear()
    await store.add_history_chunks(sid, [chunk("alpha two", 2)])
    assert fsynced == [path]
    fsynced.clear()
    assert await store.add_history_chunks(sid, [chunk("alpha two", 2)]) == 0
    assert fsynced == []  # nothing new, nothing written
    await store.close()


async def test_batch_mode_defers_the_fsync(root: Path, fsynced: list[str]) -> None:
    async def never(seconds: float) -> None:
        await asyncio.Event().wait()

    store = FilesStore(root, Settings(durability=Durability.BATCH), clock=TickingClock(), sleep=never)
    await store.open()
    sid = await new_session(store)
    path = str(history_of(root, sid).resolve())
    await store.add_history_chunks(sid, [chunk("alpha one", 1)])
    fsynced.clear()
    await store.add_history_chunks(sid, [chunk("alpha two", 2)])
    assert fsynced == [] and store.pending_fsync == 1
    await store.close()
    # The history file, then only the start-up index written at a clean stop (temp file, directory).
    assert fsynced[0] == path
    assert all(".index.jsonl." in p or p.endswith("/data") for p in fsynced[1:]), fsynced


async def test_delete_removes_the_history_file_and_its_copies(root: Path) -> None:
    store = await opened(root)
    keep, gone = await new_session(store), await new_session(store)
    for sid in (keep, gone):
        await store.add_history_chunks(sid, [chunk("alpha", 1)])
    await store.close()
    with history_of(root, gone).open("ab") as fh:
        fh.write(b"{torn")
    store = await opened(root)
    assert await found(store, gone, "alpha") == ["alpha"]  # leaves a .torn copy aside
    await store.delete_session(gone, caller=ALICE)
    assert sorted(p.name for p in (root / "history").iterdir()) == [f"{keep}.jsonl"]
    await store.close()


async def test_an_orphaned_history_file_is_not_adopted(root: Path) -> None:
    store = await opened(root)
    sid = await new_session(store)
    await store.add_history_chunks(sid, [chunk("secret alpha", 1)])
    await store.close()
    # The log is gone, set aside by an operator with its sequence mark (a mark alone would bring
    # the session back, damaged: test_files_store).
    (root / "sessions" / f"{sid}.jsonl").unlink()
    (root / "sessions" / f"{sid}.jsonl.mark").unlink()

    store = await opened(root)
    await store.create_session(caller=Principal(user_id="bob"), profile_id="p", session_id=sid)
    assert not history_of(root, sid).exists()
    assert await found(store, sid, "secret") == []
    await store.close()
