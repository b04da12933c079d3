"""Which sessions store maintenance removes, and why (DESIGN §5.7): a pure plan, no I/O.

Rules, applied in this order to the sessions left by the previous one:

1. ``prune_after``: a session idle (no update) longer than this goes.
2. ``max_sessions``: while more sessions remain, the longest idle goes first.
3. ``disk_budget``: when the store's bytes exceed the budget, the longest idle sessions go until
   the total is at or below ``high_water`` x budget (so maintenance does not run again at once).

Eviction order: longest idle first. Never removed: a pinned session, a session with a stream
open (someone is watching it). When those alone break a cap, the plan says so in ``notes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta


@dataclass(slots=True, frozen=True)
class Candidate:
    session_id: str
    update_time: datetime
    pinned: bool = False
    #: bytes the session takes on disk (logs, history, marks).
    size_bytes: int = 0
    #: a stream is open on it.
    busy: bool = False
    user_id: str = ""


@dataclass(slots=True, frozen=True)
class Policy:
    prune_after: timedelta | None = timedelta(days=30)
    max_sessions: int = 0  # 0: no cap
    disk_budget_bytes: int = 0  # 0: no budget
    high_water: float = 0.8


@dataclass(slots=True, frozen=True)
class Removal:
    session_id: str
    reason: str
    size_bytes: int
    user_id: str = ""
    #: the rule that removes it: ``prune_after``, ``max_sessions`` or ``disk_budget``.
    rule: str = ""


@dataclass(slots=True)
class Plan:
    removals: list[Removal] = field(default_factory=list)
    sessions_before: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    notes: list[str] = field(default_factory=list)
    #: session id -> rows moved to the archive (PostgreSQL), filled in by the run.
    archived: dict[str, int] = field(default_factory=dict)


def plan(candidates: Sequence[Candidate], policy: Policy, now: datetime, *, other_bytes: int = 0) -> Plan:
    """What to remove; ``other_bytes`` counts toward the disk budget but cannot be removed (blobs...)."""
    total = other_bytes + sum(c.size_bytes for c in candidates)
    out = Plan(sessions_before=len(candidates), bytes_before=total)
    # Longest idle first; ties by id so the plan is the same on every run.
    order = sorted(candidates, key=lambda c: (c.update_time, c.session_id))
    removable = [c for c in order if not c.pinned and not c.busy]
    gone: set[str] = set()

    def remove(c: Candidate, reason: str, rule: str) -> None:
        nonlocal total
        gone.add(c.session_id)
        total -= c.size_bytes
        out.removals.append(Removal(c.session_id, reason, c.size_bytes, c.user_id, rule))

    if policy.prune_after is not None:
        for c in removable:
            idle = now - c.update_time
            if idle > policy.prune_after:
                remove(c, f"idle {_days(idle)} (prune_after {_days(policy.prune_after)})", "prune_after")
    if policy.max_sessions > 0:
        left = len(candidates) - len(gone)
        for c in removable:
            if left <= policy.max_sessions:
                break
            if c.session_id not in gone:
                idle_for = _days(now - c.update_time)
                remove(c, f"{left} sessions > max_sessions {policy.max_sessions}; idle {idle_for}", "max_sessions")
                left -= 1
        if left > policy.max_sessions:
            out.notes.append(f"max_sessions {policy.max_sessions} not met: {left} left are pinned or streaming")
    if policy.disk_budget_bytes > 0 and total > policy.disk_budget_bytes:
        target = int(policy.disk_budget_bytes * policy.high_water)
        for c in removable:
            if total <= target:
                break
            if c.session_id not in gone:
                remove(
                    c,
                    f"{_mb(total)} > high-water {_mb(target)} of disk_budget {_mb(policy.disk_budget_bytes)}; "
                    f"idle {_days(now - c.update_time)}",
                    "disk_budget",
                )
        if total > target:
            out.notes.append(f"disk budget not met: {_mb(total)} left, high-water {_mb(target)}")
    out.bytes_after = total
    return out


def _days(span: timedelta) -> str:
    days = span.total_seconds() / 86400
    return f"{days:.1f} days" if days < 10 else f"{days:.0f} days"


def _mb(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MB"
