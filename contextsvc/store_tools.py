"""Operator commands over a store: ``contextsvc fsck`` checks (and ``--repair``s) the files store's
logs; ``contextsvc maintain`` runs store maintenance once (``--dry-run`` only prints)."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter

from contextsvc.config import MaintenanceSettings, Settings
from contextsvc.stores import open_store
from contextsvc.stores.files import FilesStore

OUTCOMES = ("ok", "torn", "recovered", "damaged", "unreadable")


def run_fsck(settings: Settings, *, repair: bool) -> int:
    """Print one line per session that is not ok, then a summary; the process exit status."""
    try:
        store = open_store(settings.store, settings)
    except ValueError as exc:
        print(f"contextsvc fsck: {exc}", file=sys.stderr)
        return 2
    if not isinstance(store, FilesStore):
        print("contextsvc fsck: only the files store keeps logs to check (store is not files:PATH)", file=sys.stderr)
        return 2
    if _no_data_directory(store, "fsck"):
        return 2
    try:
        entries = store.fsck(repair=repair)
    except OSError as exc:
        print(f"contextsvc fsck: {exc}", file=sys.stderr)
        return 1
    print(f"contextsvc fsck: {store.root} ({len(entries)} sessions{', repair' if repair else ''})")
    for e in entries:
        if e.outcome == "ok":
            continue
        print(f"{e.session_id}  {e.outcome:<10}  {e.detail}")
        if e.repaired:
            print(f"{'':36}  {'repaired':<10}  {e.repaired}")
    counts = Counter(e.outcome for e in entries)
    print(", ".join(f"{counts.get(o, 0)} {o}" for o in OUTCOMES))
    remaining = [e for e in entries if e.outcome != "ok" and not e.repaired]
    return 1 if remaining else 0


def run_maintain(settings: Settings, *, dry_run: bool, enforce: bool) -> int:
    """One maintenance run over the files store. Removing takes the directory lock (the server
    must be stopped); ``--dry-run`` only reads, without the lock, so it works beside a running
    server (sessions with a stream open there cannot be seen from outside)."""
    from contextsvc.clock import SystemClock
    from contextsvc.engine.maintenance import run_maintenance

    try:
        store = open_store(settings.store, settings)
    except ValueError as exc:
        print(f"contextsvc maintain: {exc}", file=sys.stderr)
        return 2
    if not isinstance(store, FilesStore):
        print("contextsvc maintain: runs over the files store (store is not files:PATH)", file=sys.stderr)
        return 2
    if _no_data_directory(store, "maintain"):
        return 2
    if dry_run:
        store = FilesStore(store.root, settings, read_only=True)
    config = settings.maintenance.model_copy(update={"mode": "enforce"}) if enforce else settings.maintenance

    async def run() -> int:
        await store.open()
        try:
            result = await run_maintenance(store, None, config, now=SystemClock().now(), dry_run=dry_run)
        finally:
            await store.close()
        assert result is not None
        removing = config.mode == "enforce" and not dry_run
        how = "dry run" if dry_run else f"mode {config.mode}"
        print(
            f"contextsvc maintain: {store.root} ({how}): {result.sessions_before} sessions, "
            f"{_mb(result.bytes_before)}; policy: {_policy(config)}"
        )
        verb = "removed" if removing else "to remove"
        for r in result.removals:
            print(f"{'removed' if removing else 'would remove'}  {r.session_id}  {_mb(r.size_bytes):>9}  {r.reason}")
        for note in result.notes:
            print(f"note: {note}")
        if dry_run:
            print("note: read without the directory lock; a running server also spares sessions with a stream open")
        freed = sum(r.size_bytes for r in result.removals)
        left = "left" if removing else "would be left"
        print(f"{len(result.removals)} session(s), {_mb(freed)} {verb}; {_mb(result.bytes_after)} {left}")
        return 0

    try:
        return asyncio.run(run())
    except OSError as exc:
        print(f"contextsvc maintain: {exc}", file=sys.stderr)
        return 1


def _no_data_directory(store: FilesStore, command: str) -> bool:
    """True, after one line on stderr, when the store's data directory does not exist: a mistyped
    path is refused, not made into a new empty store (a lock file, an index) and reported clean."""
    if store.root.is_dir():
        return False
    print(f"contextsvc {command}: no data directory at {store.root} (nothing was created)", file=sys.stderr)
    return True


def _mb(n: int) -> str:
    return f"{n / (1024 * 1024):.2f} MB"


def _policy(config: MaintenanceSettings) -> str:
    parts = [f"prune_after {config.prune_after_days:g} days" if config.prune_after_days else "no prune_after"]
    parts.append(f"max_sessions {config.max_sessions}" if config.max_sessions else "no max_sessions")
    if config.disk_budget_mb:
        parts.append(f"disk_budget {config.disk_budget_mb:g} MB (high-water {config.high_water_fraction:.0%})")
    else:
        parts.append("no disk_budget")
    return ", ".join(parts)
