"""What reading a session again from its log costs: the CPU of ``FilesStore._load_log``.

    python bench/store/reload.py                           # 2,000 rows, 15 reads
    python bench/store/reload.py --rows 500 --reads 30
    python bench/store/reload.py --ab ../base --rounds 7   # interleaved with another checkout

The files store reads a session's log whole when a call needs a session it let go past
``files.cache_mb`` (agents taking turns in a cycle, once their sessions outgrow the budget) and,
at a start without a usable index, for every session. This writes one session of ``--rows``
agent-loop rows through the store (a user ask, an assistant tool call, its result, an answer,
in turn) into a temporary directory, then reads its log ``--reads`` times with the cyclic
collector paused (its passes otherwise moved single reads by half), and prints the median and
the least CPU per read, and per row. With ``--ab`` each round reads the same log once with each
checkout, each in its own process, the order alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _rows(count: int) -> list[Any]:
    from contextsvc.core.messages import Message, Role, ToolCall

    rows: list[Any] = []
    for i in range(count):
        step = i % 4
        if step == 0:
            rows.append(Message(Role.USER, f"ask {i}: " + "find where the retry budget is read " * 5))
        elif step == 1:
            call = ToolCall(id=f"call_{i}", name="grep", arguments_json=f'{{"pattern": "retry_{i}", "path": "src/"}}')
            rows.append(Message(Role.ASSISTANT, "", tool_calls=(call,)))
        elif step == 2:
            rows.append(
                Message(
                    Role.TOOL,
                    f"src/net/retry.py:{i}: budget = settings.retry_budget\n" * 3,
                    tool_call_id=f"call_{i - 1}",
                )
            )
        else:
            rows.append(Message(Role.ASSISTANT, f"answer {i}: " + "the budget comes from the settings object " * 4))
    return rows


async def _write(data: Path, count: int) -> None:
    from contextsvc.config import Durability, Settings
    from contextsvc.core.session import Principal
    from contextsvc.stores.files import FilesStore

    store = FilesStore(data, Settings(durability=Durability.BATCH))
    await store.open()
    try:
        sid = (await store.create_session(caller=Principal(user_id="bench"), profile_id="bench")).id
        rows = _rows(count)
        for first in range(0, count, 4):  # one agent turn an append
            await store.append_messages(sid, rows[first : first + 4], caller=Principal(user_id="bench"))
    finally:
        await store.close()


async def _read(data: Path, reads: int) -> list[float]:
    from contextsvc.config import Durability, Settings
    from contextsvc.stores.files import FilesStore

    store = FilesStore(data, Settings(durability=Durability.BATCH))
    await store.open()
    try:
        (log,) = store._logs.values()
        gc.collect()
        gc.disable()
        spent = []
        for _ in range(reads):
            began = time.process_time()
            store._load_log(log.path)
            spent.append((time.process_time() - began) * 1e3)
        gc.enable()
        return spent
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--reads", type=int, default=15)
    parser.add_argument("--ab", default="", help="another checkout, read in turn with this one")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--root", default=str(HERE.parents[1]), help=argparse.SUPPRESS)
    parser.add_argument("--data", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    if args.data:  # one checkout's reads of a log already written (an --ab round)
        spent = asyncio.run(_read(Path(args.data), args.reads))
        print(f"{statistics.median(spent):.3f} {min(spent):.3f}")
        return
    workdir = Path(tempfile.mkdtemp(prefix="ctxreload-"))
    try:
        data = workdir / "data"
        asyncio.run(_write(data, args.rows))
        if not args.ab:
            spent = asyncio.run(_read(data, args.reads))
            median = statistics.median(spent)
            print(f"{args.rows} rows: median {median:.2f} ms CPU a read, least {min(spent):.2f} ms; "
                  f"{median / args.rows * 1e3:.2f} µs a row")  # fmt: skip
            return
        checkouts = {"this": Path(args.root).resolve(), "other": Path(args.ab).resolve()}
        figures: dict[str, list[float]] = {name: [] for name in checkouts}
        for r in range(args.rounds):
            order = list(checkouts.items()) if r % 2 == 0 else list(reversed(checkouts.items()))
            for name, root in order:
                cmd = [sys.executable, __file__, "--root", str(root), "--data", str(data), "--reads", str(args.reads)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
                figures[name].append(float(out.split()[0]))
            print(
                f"round {r + 1}: this {figures['this'][-1]:.2f}  other {figures['other'][-1]:.2f} ms a read", flush=True
            )
        for name, values in figures.items():
            print(f"{name}: median {statistics.median(values):.2f} ms a read, least {min(values):.2f}")
        print(f"this / other (medians): {statistics.median(figures['this']) / statistics.median(figures['other']):.3f}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
