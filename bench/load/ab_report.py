"""The summary lines of an in-process A/B run (``turns_inproc.py --ab``, ``append_inproc.py --ab``):
per side the median and minimum, the ratio of the medians, and the machine's load."""

from __future__ import annotations

import os
import statistics


def print_ab(figures: dict[str, list[float]], unit: str) -> None:
    """``figures``: the per-round values of ``this`` and ``other`` checkout, in ``unit``."""
    for name, values in figures.items():
        print(f"{name}: median {statistics.median(values):.3f} {unit}, min {min(values):.3f}")
    print(f"this / other (medians): {statistics.median(figures['this']) / statistics.median(figures['other']):.3f}")
    print(f"load average: {os.getloadavg()[0]:.1f}")
