"""A log line that a client can trigger, written at most so many times a minute."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any


class ThrottledLog:
    """Writes at most ``per_minute`` lines per 60-second window; the next line written after a
    quiet spell says how many were left out (``suppressed``), so nothing is silently lost and a
    client flooding bad requests cannot flood the log."""

    __slots__ = ("_clock", "_level", "_logger", "_per_minute", "_suppressed", "_window_count", "_window_start")

    def __init__(
        self,
        logger: logging.Logger,
        *,
        per_minute: int,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ):
        if per_minute < 0:
            raise ValueError(f"per_minute must not be negative, got {per_minute}")
        self._logger = logger
        self._per_minute = per_minute
        self._level = level
        self._clock = clock
        self._window_start = clock()
        self._window_count = 0
        self._suppressed = 0

    def write(self, event: str, **fields: Any) -> bool:
        """Log ``event`` with ``fields`` unless this window is full. True when it was written."""
        now = self._clock()
        if now - self._window_start >= 60.0:
            self._window_start = now
            self._window_count = 0
        if self._window_count >= self._per_minute:
            self._suppressed += 1
            return False
        self._window_count += 1
        if self._suppressed:
            fields["suppressed"] = self._suppressed
            self._suppressed = 0
        self._logger.log(self._level, event, extra=fields)
        return True
