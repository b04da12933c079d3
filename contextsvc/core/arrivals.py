"""Who came lately: the distinct sources (sessions, files) seen within a sliding window, per group.

Gatherings that trade a short wait for shared work (baselines sharing a refit, appends sharing a
sync pass) wait only when many sources are active at once; a few agents taking turns would only
wait longer for each of theirs. Pure: the caller passes the time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class Arrivals:
    """Per group, the sources that arrived within the last window, with when each came last.
    Bounded by the sources active within one window (older ones are dropped as new ones come)."""

    __slots__ = ("_recent",)

    def __init__(self) -> None:
        #: group -> source -> time of its newest arrival, oldest first
        self._recent: dict[Hashable, OrderedDict[Hashable, float]] = {}

    def note(self, group: Hashable, source: Hashable, now: float, window: float) -> int:
        """Record an arrival of ``source`` at ``now``; how many other sources of the group arrived
        within ``window`` before it."""
        recent = self._recent.get(group)
        if recent is None:
            recent = self._recent[group] = OrderedDict()
        while recent:
            oldest, when = next(iter(recent.items()))
            if now - when <= window:
                break
            del recent[oldest]
        others = len(recent) - (source in recent)
        recent[source] = now
        recent.move_to_end(source)
        return others

    def forget(self, group: Hashable) -> None:
        self._recent.pop(group, None)
