"""Start-up A/B: two checkouts started in turn (interleaved), to SERVING, on the same machine load.

    python bench/store/startup_ab.py --a ../main --b . --rounds 6                        # empty data
    python bench/store/startup_ab.py --a ../main --data-a DIR_A --b . --data-b DIR_B   # with data

Each round starts one server of each checkout (``python -m contextsvc serve`` from that checkout,
``startup.start_server``: from ``Popen`` to health SERVING, the process's CPU until then), the order
alternating by round; medians and minima are printed. A shared machine moves wall times a lot, so
compare the two in one run, CPU first. A data directory is used as is (an index of the format its
checkout writes: give each checkout its own copy when the formats differ).

A server is stopped with SIGTERM, a clean stop, ``--serve-seconds`` (1.5) after it reported
SERVING: the files store then seals its index (``stores/_seal.py``; a sealed start checks the logs
in the background once serving, ~0.3 s at 10,000 sessions, and a stop before that check ended
leaves no seal) and the next start takes it without a ``stat`` of each log. ``--after-crash`` stops
it with SIGKILL instead, so every start is one after a crash (the index checked log by log).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import startup


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="checkout A (its root)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B (its root)")
    parser.add_argument("--data-a", type=Path, help="data directory for A (default: a new empty one each start)")
    parser.add_argument("--data-b", type=Path, help="data directory for B (default: a new empty one each start)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--after-crash", action="store_true", help="stop servers with SIGKILL (no clean stop)")
    parser.add_argument("--serve-seconds", type=float, default=1.5, help="how long a server runs after SERVING")
    args = parser.parse_args()
    sides = [("A", args.a.resolve(), args.data_a), ("B", args.b.resolve(), args.data_b)]
    runs: dict[str, list[startup.Start]] = {"A": [], "B": []}
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        for name, root, data in sides if r % 2 == 0 else sides[::-1]:
            startup.ROOT = root  # start_server runs `python -m contextsvc` from this checkout
            where = data if data is not None else Path(tempfile.mkdtemp(prefix="contextsvc-ab-"))
            server = startup.start_server(where, {})
            runs[name].append(server.started)
            time.sleep(args.serve_seconds)
            if args.after_crash:
                server.proc.kill()
                server.proc.wait(120)
            server.stop()
            if data is None:
                shutil.rmtree(where, ignore_errors=True)
    for name, root, data in sides:
        got = runs[name]
        print(
            f"{name} {root.name} ({'data' if data is not None else 'empty'}): to SERVING median "
            f"{statistics.median(s.seconds for s in got):.3f} s (min {min(s.seconds for s in got):.3f}); CPU median "
            f"{statistics.median(s.cpu_s for s in got):.3f} s (min {min(s.cpu_s for s in got):.3f}); RSS "
            f"{statistics.median(s.rss_mb for s in got):.0f} MB"
        )
    stops = "SIGKILL (every start after a crash)" if args.after_crash else "SIGTERM (clean stops)"
    print(
        f"load average (1 min) {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
        f"{args.rounds} rounds; servers stopped by {stops}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
