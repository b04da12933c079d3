"""The engine state a store keeps is its own: what the caller passed, and changes to it
afterwards, never reach the stored state (one copy per write, shared by the record)."""

from __future__ import annotations

from pathlib import Path

from contextsvc.config import Settings
from contextsvc.core.session import Principal
from contextsvc.stores.files import FilesStore
from contextsvc.stores.memory import MemoryStore

ALICE = Principal(user_id="alice")


async def test_a_written_state_is_the_stores_own_copy() -> None:
    store = MemoryStore(Settings())
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    state = {"baseline": {"tokens": 10, "rows": [1, 2]}, "epoch": 1}
    await store.update_state(sid, caller=ALICE, state=state)
    state["baseline"]["tokens"] = 99
    state["baseline"]["rows"].append(3)
    state["epoch"] = 7
    read = (await store.get_session(sid, caller=ALICE)).state
    assert read == {"baseline": {"tokens": 10, "rows": [1, 2]}, "epoch": 1}
    # The next write replaces it whole; the first one's snapshot keeps what it had.
    await store.update_state(sid, caller=ALICE, state={"epoch": 2})
    assert (await store.get_session(sid, caller=ALICE)).state == {"epoch": 2}
    assert read == {"baseline": {"tokens": 10, "rows": [1, 2]}, "epoch": 1}


async def test_a_files_state_reads_back_the_same_after_a_reopen(tmp_path: Path) -> None:
    store = FilesStore(tmp_path / "data", Settings())
    await store.open()
    sid = (await store.create_session(caller=ALICE, profile_id="p")).id
    state = {"baseline": {"tokens": 10}, "extra": {"profile": {"model": "m"}}}
    await store.update_state(sid, caller=ALICE, state=state)
    state["baseline"]["tokens"] = 0
    assert (await store.get_session(sid, caller=ALICE)).state["baseline"] == {"tokens": 10}
    await store.close()
    store = FilesStore(tmp_path / "data", Settings())
    await store.open()
    assert (await store.get_session(sid, caller=ALICE)).state == {
        "baseline": {"tokens": 10},
        "extra": {"profile": {"model": "m"}},
    }
    await store.close()


async def test_a_change_of_the_header_alone_shares_the_last_snapshots_copies() -> None:
    """An append changes the counters, so a read makes a new snapshot; its metadata and state
    were not replaced, so it holds the very copies the last snapshot had (no new deep copies).
    A state write is a new mapping: the next snapshot copies it again. Snapshots stay copies:
    the store's own dicts are never handed out."""
    from contextsvc.core.messages import Message, Role

    store = MemoryStore(Settings())
    sid = (await store.create_session(caller=ALICE, profile_id="p", metadata={"team": {"a": 1}})).id
    await store.update_state(sid, caller=ALICE, state={"epoch": 1})
    first = await store.get_session(sid, caller=ALICE)
    await store.append_messages(sid, [Message(Role.USER, "hello")], caller=ALICE)
    second = await store.get_session(sid, caller=ALICE)
    assert second is not first and second.last_sequence == first.last_sequence + 1
    assert second.state is first.state and second.metadata is first.metadata
    await store.update_state(sid, caller=ALICE, state={"epoch": 2})
    third = await store.get_session(sid, caller=ALICE)
    assert third.state == {"epoch": 2} and third.state is not second.state
    assert third.metadata is second.metadata
    kept = store._sessions[sid]
    assert third.state is not kept.state and third.metadata is not kept.metadata
