"""Store maintenance runs (DESIGN §5.7): plan with ``core/maintenance.py``, then warn or remove.

Every removal is a ``session_deleted`` event (payload ``reason``: the rule, ``prune_after``,
``max_sessions`` or ``disk_budget``; ``detail``: why, in words) and an audit line (logger
``contextsvc.audit``); in ``warn`` mode (or a dry run) each would-be removal is a warning line
instead. Only stores that can list their sessions' sizes take part (``maintenance_candidates``:
the files store, memory and PostgreSQL); for others a run does nothing. PostgreSQL also moves old
rows to its archive table by ``archive_keep_messages`` (``archive_by_rule``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from contextsvc.config import MaintenanceSettings
from contextsvc.core.session import Principal
from contextsvc.errors import NotFound
from contextsvc.ports import EventBus

if TYPE_CHECKING:  # imported by the first run, one interval after the start (issue #9, start-up)
    from contextsvc.core.maintenance import Candidate, Plan, Policy

log = logging.getLogger(__name__)
audit = logging.getLogger("contextsvc.audit")

#: the caller maintenance deletes as (an admin: it may remove any user's session).
MAINTENANCE = Principal(user_id="contextsvc-maintenance", is_admin=True)


def policy_of(settings: MaintenanceSettings) -> Policy:
    from contextsvc.core.maintenance import Policy

    return Policy(
        prune_after=timedelta(days=settings.prune_after_days) if settings.prune_after_days > 0 else None,
        max_sessions=settings.max_sessions,
        disk_budget_bytes=int(settings.disk_budget_mb * 1024 * 1024),
        high_water=settings.high_water_fraction,
    )


async def run_maintenance(
    store: Any,
    bus: EventBus | None,
    settings: MaintenanceSettings,
    *,
    now: datetime,
    busy: Collection[str] = (),
    dry_run: bool = False,
) -> Plan | None:
    """Plan, then remove (``enforce`` and not ``dry_run``) or only report; None: not supported."""
    candidates_of: Callable[[Collection[str]], Awaitable[tuple[list[Candidate], int]]] | None = getattr(
        store, "maintenance_candidates", None
    )
    if candidates_of is None:
        return None
    candidates, other_bytes = await candidates_of(busy)
    from contextsvc.core.maintenance import plan

    result = plan(candidates, policy_of(settings), now, other_bytes=other_bytes)
    enforce = settings.mode == "enforce" and not dry_run
    done = []
    for removal in result.removals:
        extra = {"session_id": removal.session_id, "reason": removal.reason, "bytes": removal.size_bytes}
        if not enforce:
            log.warning("maintenance would remove a session (%s)", "dry run" if dry_run else "mode warn", extra=extra)
            done.append(removal)
            continue
        try:
            await store.delete_session(removal.session_id, caller=MAINTENANCE)
        except NotFound:  # deleted meanwhile
            continue
        done.append(removal)
        audit.info("maintenance removed a session", extra={"audit": True, "user": removal.user_id, **extra})
        if bus is not None:
            await bus.publish(
                session_id=removal.session_id,
                user_id=removal.user_id,
                kind="session_deleted",
                payload={"reason": removal.rule, "detail": f"maintenance: {removal.reason}"},
            )
    result.removals = done
    archive: Callable[..., Awaitable[dict[str, int]]] | None = getattr(store, "archive_by_rule", None)
    if archive is not None and settings.archive_keep_messages > 0 and not dry_run:
        # Archiving loses nothing (every read still sees the rows): it runs in warn mode too.
        moved = await archive(settings.archive_keep_messages, caller=MAINTENANCE)
        result.archived = moved
        for sid, n in moved.items():
            log.info("maintenance archived old rows", extra={"session_id": sid, "rows": n})
    for note in result.notes:
        log.warning("maintenance: %s", note)
    return result


async def maintenance_loop(
    store: Any,
    bus: EventBus,
    settings: MaintenanceSettings,
    *,
    now: Callable[[], datetime],
    busy: Callable[[], Collection[str]],
    sleep: Callable[[float], Awaitable[None]],
) -> None:
    """``serve``'s periodic run: first after one interval, then every interval; never dies."""
    while True:
        await sleep(settings.interval_seconds)
        try:
            result = await run_maintenance(store, bus, settings, now=now(), busy=busy())
        except Exception:
            log.exception("maintenance run failed")
            continue
        if result is None:
            return  # this store does not take part
        if result.removals:
            log.info(
                "maintenance run",
                extra={"mode": settings.mode, "removals": len(result.removals), "bytes_after": result.bytes_after},
            )
