"""What checked records cost an append (issue #9 target: within 10% of before).

    python bench/store/append_cost.py                # 5 rounds x 2,000 appends per variant
    python bench/store/append_cost.py --record       # and write "## Store: append cost" into bench/RESULTS.md

In process, through ``FilesStore.append_messages`` (one 400-character message per call), in both
durability modes. ``checked`` is the store as it is; ``before`` is the same store with the line
framing replaced by a plain JSON line and the sequence-mark update switched off, i.e. what an
append wrote before checksums. Rounds alternate between the variants, each on a fresh data
directory, so both see the same machine load; a cell is the median over rounds of the mean cost
of one append.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import _checkout  # noqa: F401 - this checkout's contextsvc, see _checkout.py

import contextsvc.stores.files as files
from contextsvc.config import Durability, Settings
from contextsvc.core.messages import Message, Role
from contextsvc.core.session import ANONYMOUS

RESULTS = Path(__file__).resolve().parents[1] / "RESULTS.md"
SECTION = "## Store: append cost"
TEXT = ("the quick brown fox jumps over the lazy dog; " * 10)[:400]


@contextmanager
def before() -> Iterator[None]:
    frame, mark = files.frame, files.write_mark_number
    files.frame = lambda body: body + b"\n"  # type: ignore[assignment]
    files.write_mark_number = lambda path, n: None  # type: ignore[assignment]
    try:
        yield
    finally:
        files.frame, files.write_mark_number = frame, mark


async def one_round(durability: Durability, appends: int) -> float:
    with tempfile.TemporaryDirectory(prefix="append-cost-") as tmp:
        store = files.FilesStore(Path(tmp) / "data", Settings(durability=durability))
        await store.open()
        sid = (await store.create_session(caller=ANONYMOUS, profile_id="default")).id
        message = [Message(role=Role.USER, content=TEXT)]
        started = time.perf_counter()
        for _ in range(appends):
            await store.append_messages(sid, message, caller=ANONYMOUS)
        elapsed = time.perf_counter() - started
        await store.close()
    return elapsed / appends * 1e6


async def measure(rounds: int, appends: int) -> dict[tuple[str, str], float]:
    samples: dict[tuple[str, str], list[float]] = {}
    for durability in (Durability.BATCH, Durability.FSYNC):
        n = appends if durability is Durability.BATCH else max(appends // 10, 50)
        await one_round(durability, n // 10)  # warm-up
        for _ in range(rounds):
            samples.setdefault((durability.value, "checked"), []).append(await one_round(durability, n))
            with before():
                samples.setdefault((durability.value, "before"), []).append(await one_round(durability, n))
    return {key: statistics.median(values) for key, values in samples.items()}


def report(cells: dict[tuple[str, str], float], rounds: int, appends: int, command: str) -> str:
    lines = [
        SECTION,
        "",
        f"- date: {dt.date.today().isoformat()}; machine: {os.cpu_count()} cores (nproc), Python "
        f"{platform.python_version()}, {platform.system()} {platform.machine()}; the machine is shared "
        "(other jobs running), so compare the ratio of the same run",
        f"- command: `{command}`",
        f"- {rounds} rounds per cell, alternating variants; {appends:,} appends per round in batch mode, "
        f"{max(appends // 10, 50):,} in fsync mode; one 400-character message per append",
        "- `before`: the same store writing plain JSON lines without the sequence mark (the format before "
        "checksums); `checked`: CRC32C-framed lines + the mark update",
        "",
        "| durability | before (µs/append) | checked (µs/append) | checked / before |",
        "|---|---|---|---|",
    ]
    for durability in ("batch", "fsync"):
        b, c = cells[(durability, "before")], cells[(durability, "checked")]
        lines.append(f"| {durability} | {b:.1f} | {c:.1f} | {c / b:.3f} |")
    return "\n".join(lines) + "\n"


def record(text: str) -> None:
    current = RESULTS.read_text()
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    updated = pattern.sub(text + "\n", current) if pattern.search(current) else current.rstrip() + "\n\n" + text
    RESULTS.write_text(updated)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--appends", type=int, default=2000)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    cells = asyncio.run(measure(args.rounds, args.appends))
    command = "python bench/store/append_cost.py" + (" --record" if args.record else "")
    text = report(cells, args.rounds, args.appends, command)
    print(text)
    if args.record:
        record(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
