"""Operator commands over a store: ``contextsvc fsck`` checks (and ``--repair``s) the files store's logs."""

from __future__ import annotations

import sys
from collections import Counter

from contextsvc.config import Settings
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
