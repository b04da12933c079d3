"""What making many written logs durable costs: one fsync per log, or one syncfs for all of them.

    python bench/store/disk_sync.py                  # 50 logs a pass, 40 passes, in a temporary directory
    python bench/store/disk_sync.py --logs 10 --dir /path/on/the/data/disk

Each pass appends one ~800-byte line to each of ``--logs`` files (what the batch flusher finds
after 50 ms of 50 agents, or what fsync durability's writers bring to one group-commit pass), then
makes them durable the way ``stores/_disk_sync.DiskSync`` would: with ``sync_whole_filesystem``
off (an fsync of each, through a fresh descriptor) and on (one ``syncfs`` of the directory's
filesystem). The two alternate pass by pass, so both see the same disk. Prints the wall time and
the process's CPU per pass, and their ratios. Everything stays in the directory given (a fresh
temporary one by default), which is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401 - this checkout's contextsvc

from contextsvc.stores._disk_sync import DiskSync


def _append_each(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        try:
            os.write(fd, b"x" * 799 + b"\n")
        finally:
            os.close(fd)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logs", type=int, default=50)
    parser.add_argument("--passes", type=int, default=40)
    parser.add_argument("--dir", default="", help="a directory on the disk to measure (default: a temporary one)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ctxsync-", dir=args.dir or None))
    try:
        paths = [folder / f"s{i}.jsonl" for i in range(args.logs)]
        for path in paths:
            path.touch()
        ways = {
            "fsync each": DiskSync(folder, whole_filesystem=False),
            "syncfs": DiskSync(folder, whole_filesystem=True),
        }
        for disk in ways.values():
            disk.open()
        if not ways["syncfs"].whole_filesystem:
            print("syncfs is not used on this system (Linux 5.8 or later only): both rows fsync each file")
        wall: dict[str, list[float]] = {name: [] for name in ways}
        cpu: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.passes):
            for name, disk in ways.items():
                _append_each(paths)
                began, used = time.perf_counter(), _cpu()
                disk.sync(paths)
                wall[name].append(time.perf_counter() - began)
                cpu[name].append(_cpu() - used)
        for disk in ways.values():
            disk.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"| way | wall ms a pass of {args.logs} logs (median) | process CPU ms a pass (mean) |")
    print("|---|---|---|")
    for name in ways:
        print(f"| {name} | {statistics.median(wall[name]) * 1e3:.2f} | {statistics.fmean(cpu[name]) * 1e3:.2f} |")
    print(
        f"syncfs / fsync each: wall {statistics.median(wall['syncfs']) / statistics.median(wall['fsync each']):.2f}x, "
        f"CPU {statistics.fmean(cpu['syncfs']) / max(1e-9, statistics.fmean(cpu['fsync each'])):.2f}x "
        f"({args.passes} passes each, alternating)"
    )


if __name__ == "__main__":
    main()
