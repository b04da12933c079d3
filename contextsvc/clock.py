"""The default clock: timezone-aware UTC wall time (tests inject their own ``Clock``)."""

from __future__ import annotations

from datetime import UTC, datetime


class SystemClock:
    """``now()`` in UTC, always timezone-aware."""

    __slots__ = ()

    def now(self) -> datetime:
        return datetime.now(UTC)


SYSTEM_CLOCK = SystemClock()
