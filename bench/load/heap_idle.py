"""What ``serve`` holds after a burst of load, with and without ``hot_path.heap_trim_interval_seconds``.

    python bench/load/heap_idle.py                       # 2 windows of 60 s, then 40 s idle, each variant
    python bench/load/heap_idle.py --windows 4 --seconds 60 --idle 40

For each variant (``trim``: the default interval; ``none``: 0, no trim), one ``contextsvc serve`` on
the memory store as ``run.py`` starts it, a 200-message session, then ``--windows`` ghz windows of
BuildContext at 50 concurrent (the soak scenario's run), the server's RSS after each; then
``--idle`` seconds without calls and its RSS again; then one ``malloc_trim(0)`` called inside the
server by ``gdb`` (when there is one): what was still free in its heap, i.e. not a leak.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from unittest import mock

import run as suite
from workload import Seeder

VARIANTS = {"trim": None, "none": "0"}


def measure(variant: str, windows: int, seconds: float, idle: float) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"ctxheap-{variant}-"))
    interval = VARIANTS[variant]
    wanted = {} if interval is None else {"CONTEXTSVC_HOT_PATH__HEAP_TRIM_INTERVAL_SECONDS": interval}
    with mock.patch.dict(os.environ, wanted):  # the server inherits it; this process keeps its own
        server = suite.start_server("memory", work)
    try:
        seeder = Seeder(server.address, "bench")
        sid = seeder.session(200, profile="bench")
        seeder.warm([sid])
        loader = suite.Loader(suite.ghz_binary(), suite.protoset(), work, False)
        soak = suite.load_scenarios(["soak"])[0].runs[0]
        run = dataclasses.replace(soak, max_seconds=seconds)
        line = [f"{variant:4}: start {suite.rss_mb(server.pid):.1f} MB"]
        for _ in range(windows):
            loader.ghz_run(server, f"{suite.SERVICE}.BuildContext", [{"session_id": sid}], run)
            line.append(f"{suite.rss_mb(server.pid):.1f}")
        time.sleep(idle)
        line.append(f"idle {idle:g} s {suite.rss_mb(server.pid):.1f} MB")
        if shutil.which("gdb"):
            subprocess.run(
                ["gdb", "-p", str(server.pid), "-batch", "-ex", "call (int)malloc_trim(0)"],
                capture_output=True,
                check=False,
                timeout=60,
            )
            line.append(f"after one more malloc_trim {suite.rss_mb(server.pid):.1f} MB")
        print(", ".join(line), flush=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--idle", type=float, default=40.0)
    args = parser.parse_args()
    os.chdir(suite.ROOT)
    for variant in VARIANTS:
        measure(variant, args.windows, args.seconds, args.idle)


if __name__ == "__main__":
    main()
