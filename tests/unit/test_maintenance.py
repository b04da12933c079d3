"""Store maintenance: the plan (``core/maintenance.py``) and a run over the files store."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from contextsvc.cli import main
from contextsvc.config import MaintenanceSettings, Settings
from contextsvc.core.maintenance import Candidate, Policy, plan
from contextsvc.core.messages import Message, Role
from contextsvc.core.session import Principal
from contextsvc.engine.maintenance import run_maintenance
from contextsvc.errors import NotFound
from contextsvc.events.memory_bus import MemoryEventBus
from contextsvc.stores._dirlock import DataDirLock
from contextsvc.stores.files import FilesStore
from tests.support.stores import TickingClock

NOW = datetime(2026, 6, 1, tzinfo=UTC)
MB = 1024 * 1024
ALICE = Principal(user_id="alice")


def c(sid: str, idle_days: float, *, mb: float = 1, pinned: bool = False, busy: bool = False) -> Candidate:
    return Candidate(sid, NOW - timedelta(days=idle_days), pinned=pinned, size_bytes=int(mb * MB), busy=busy)


@pytest.mark.parametrize(
    ("candidates", "policy", "removed"),
    [
        # prune_after: idle past 30 days, never pinned or streaming
        ([c("a", 40), c("b", 31, pinned=True), c("c", 35, busy=True), c("d", 2)], Policy(), ["a"]),
        ([c("a", 40)], Policy(prune_after=None), []),
        # max_sessions: longest idle first
        ([c("a", 1), c("b", 3), c("c", 2)], Policy(max_sessions=2), ["b"]),
        ([c("a", 1), c("b", 3, pinned=True), c("c", 2)], Policy(max_sessions=1), ["c", "a"]),
        # disk budget 10 MB: over it, down to 8 MB (high-water 80%)
        ([c("a", 1, mb=4), c("b", 3, mb=4), c("c", 2, mb=3)], Policy(disk_budget_bytes=10 * MB), ["b"]),
        ([c("a", 1, mb=4), c("b", 3, mb=4)], Policy(disk_budget_bytes=10 * MB), []),
        # the rules in order: prune first, then the cap counts what is left
        ([c("a", 60), c("b", 3), c("c", 2), c("d", 1)], Policy(max_sessions=2), ["a", "b"]),
    ],
)
def test_the_plan(candidates: list[Candidate], policy: Policy, removed: list[str]) -> None:
    assert [r.session_id for r in plan(candidates, policy, NOW).removals] == removed


def test_the_plan_says_when_pinned_or_streaming_sessions_break_a_cap() -> None:
    result = plan([c("a", 1, pinned=True), c("b", 2, busy=True)], Policy(max_sessions=1), NOW)
    assert result.removals == [] and "max_sessions 1 not met" in result.notes[0]
    result = plan([c("a", 1, mb=20, pinned=True)], Policy(disk_budget_bytes=10 * MB), NOW)
    assert "disk budget not met" in result.notes[0]


async def _store(root: Path) -> tuple[FilesStore, list[str]]:
    # The clock starts on 2026-01-01: every session is months idle by NOW.
    store = FilesStore(root, Settings(), clock=TickingClock())
    await store.open()
    ids = []
    for k in range(3):
        sid = (await store.create_session(caller=ALICE, profile_id="p", name=f"s{k}")).id
        await store.append_messages(sid, [Message(role=Role.USER, content="x" * 1000)], caller=ALICE)
        ids.append(sid)
    await store.update_session(ids[0], caller=ALICE, pinned=True)
    return store, ids


async def test_enforce_removes_with_an_event_and_an_audit_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, (pinned, old, busy) = await _store(tmp_path / "data")
    bus = MemoryEventBus(retention=100)
    config = MaintenanceSettings(mode="enforce")
    with caplog.at_level(logging.INFO, logger="contextsvc.audit"):
        result = await run_maintenance(store, bus, config, now=NOW, busy={busy})
    assert result is not None and [r.session_id for r in result.removals] == [old]
    assert "idle" in result.removals[0].reason and "prune_after 30 days" in result.removals[0].reason
    with pytest.raises(NotFound):
        await store.get_session(old, caller=ALICE)
    for sid in (pinned, busy):
        await store.get_session(sid, caller=ALICE)
    assert not list((tmp_path / "data" / "sessions").glob(f"{old}*"))
    audits = [r for r in caplog.records if r.name == "contextsvc.audit"]
    assert len(audits) == 1 and getattr(audits[0], "session_id", "") == old
    events = [e async for e in _retained(bus)]
    assert [(e.kind, e.session_id) for e in events] == [("session_deleted", old)]
    assert events[0].payload["reason"] == "prune_after"
    assert events[0].payload["detail"].startswith("maintenance: idle")
    await store.close()


async def _retained(bus: MemoryEventBus):  # type: ignore[no-untyped-def]
    async for event in bus.subscribe(caller=Principal(user_id="root", is_admin=True), after_event_id=1):
        yield event
        return


async def test_warn_and_dry_run_remove_nothing(tmp_path: Path) -> None:
    store, ids = await _store(tmp_path / "data")
    for config, dry in ((MaintenanceSettings(mode="warn"), False), (MaintenanceSettings(mode="enforce"), True)):
        result = await run_maintenance(store, None, config, now=NOW, dry_run=dry)
        assert result is not None and len(result.removals) == 2  # reported
    for sid in ids:
        await store.get_session(sid, caller=ALICE)
    await store.close()


def test_the_cli_dry_run_prints_what_and_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def prepare() -> list[str]:
        store, ids = await _store(tmp_path / "data")
        await store.close()
        return ids

    _pinned, old, other = asyncio.run(prepare())
    assert main(["maintain", "--store", f"files:{tmp_path / 'data'}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "(dry run): 3 sessions" in out
    assert f"would remove  {old}" in out and f"would remove  {other}" in out and "prune_after 30 days" in out
    assert "2 session(s)" in out and "to remove" in out
    assert len(list((tmp_path / "data" / "sessions").glob("*.jsonl"))) == 3  # nothing removed


def test_the_cli_dry_run_needs_no_lock_and_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def prepare() -> list[str]:
        store, ids = await _store(tmp_path / "data")
        await store.close()
        return ids

    _pinned, old, other = asyncio.run(prepare())
    files = tmp_path / "data"

    def snapshot() -> dict[str, tuple[int, int]]:
        return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in files.rglob("*") if p.is_file()}

    holder = DataDirLock(files)  # what a running server holds
    holder.acquire()
    try:
        before = snapshot()
        assert main(["maintain", "--store", f"files:{files}", "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert f"would remove  {old}" in out and f"would remove  {other}" in out
        assert "without the directory lock" in out
        assert snapshot() == before  # not a byte written, not even an index or a mark
        assert main(["maintain", "--store", f"files:{files}", "--enforce"]) != 0  # removing needs the lock
        assert len(list((files / "sessions").glob("*.jsonl"))) == 3
    finally:
        holder.release()


@pytest.mark.parametrize(
    "argv", [["fsck"], ["fsck", "--repair"], ["maintain"], ["maintain", "--enforce"], ["maintain", "--dry-run"]]
)
def test_a_store_path_that_does_not_exist_is_refused_and_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    missing = tmp_path / "nonexistent" / "path"
    assert main([*argv, "--store", f"files:{missing}"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines == [f"contextsvc {argv[0]}: no data directory at {missing} (nothing was created)"], captured
    assert not (tmp_path / "nonexistent").exists()


def test_the_cli_enforce_writes_an_audit_line_per_removal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``contextsvc maintain --enforce`` deletes sessions: each deletion leaves an audit line
    (logger ``contextsvc.audit``, README "Store maintenance"), as the server's runs do, though the
    command keeps its other log lines quiet (its report is the output)."""

    async def prepare() -> list[str]:
        store, ids = await _store(tmp_path / "data")
        await store.close()
        return ids

    _pinned, old, other = asyncio.run(prepare())
    try:
        assert main(["maintain", "--store", f"files:{tmp_path / 'data'}", "--enforce"]) == 0
        captured = capsys.readouterr()
    finally:
        logging.getLogger("contextsvc.audit").setLevel(logging.NOTSET)
    assert f"removed  {old}" in captured.out and f"removed  {other}" in captured.out
    audit = [line for line in captured.err.splitlines() if "maintenance removed a session" in line]
    assert len(audit) == 2, captured.err
    assert any(old in line for line in audit) and any(other in line for line in audit)
    assert "would remove" not in captured.err  # the warn-mode lines stay quiet
