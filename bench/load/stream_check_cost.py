"""What checking an open stream's token again costs each event (``api.auth._while_valid``).

    python bench/load/stream_check_cost.py

Iterates 200,000 items of an async generator (a pause every 50, as a watcher's stream waits for
events) plain and through ``_while_valid`` with a check that passes, in one process, and prints
the CPU a item of each. Every authenticated StreamEvents call and gateway socket pays the
difference for every event it is sent.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from contextsvc.api.auth import _while_valid

N = 200_000


async def items() -> AsyncIterator[int]:
    for i in range(N):
        yield i
        if i % 50 == 0:
            await asyncio.sleep(0)


async def passes() -> None:
    return None


async def main() -> None:
    began = time.process_time()
    async for _ in items():
        pass
    plain = time.process_time() - began
    began = time.process_time()
    async for _ in _while_valid(items(), passes, 5.0):
        pass
    checked = time.process_time() - began
    print(f"plain {plain / N * 1e6:.2f} us an item, checked {checked / N * 1e6:.2f} us an item")


if __name__ == "__main__":
    asyncio.run(main())
