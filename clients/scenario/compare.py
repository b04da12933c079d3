"""Normalizes scenario transcripts so the three clients' runs can be compared field for field."""

from __future__ import annotations

import re
from typing import Any

# Values that differ between two runs of the same scenario: server-assigned ids and clocks.
VOLATILE_KEYS = frozenset(
    {"id", "session_id", "view_id", "event_id", "request_id"}
    | {"create_time", "update_time", "time", "start_time", "end_time"}
)
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def normalize(value: Any, key: str = "") -> Any:
    """Volatile values become a marker of whether they were set; numbers compare as floats."""
    if key in VOLATILE_KEYS:
        return "<set>" if value not in (None, "", 0) else value
    if isinstance(value, dict):
        return {k: normalize(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        return UUID.sub("<uuid>", value)
    return value


def differences(a: Any, b: Any, path: str = "$") -> list[str]:
    """Paths where two normalized transcripts differ (empty when they match)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'first' if k in a else 'second'}")
            else:
                out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r:.80} != {b!r:.80}"]
