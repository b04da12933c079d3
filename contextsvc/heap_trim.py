"""Handing the C heap's free memory back to the operating system while ``serve`` runs.

glibc's malloc keeps what the server freed (views of ~75 KB, gRPC's buffers) in its arenas for
reuse, so after a burst of load the process goes on holding much of its peak. ``trim_loop`` calls
``malloc_trim(0)`` every ``hot_path.heap_trim_interval_seconds``, in a worker thread (the call takes
the arenas' locks, not the interpreter's, so the event loop goes on meanwhile). Measured (round 19,
bench/RESULTS.md): after two minutes of BuildContext at 50 concurrent, 40 s idle brought RSS from
67.7 to 63.0 MB with it and left it at 63.7 MB without; under steady load RSS follows the load's
working set either way (a trim between the load's windows changes little there).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)


def load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (another C library, another system)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


async def trim_loop(interval: float, trim: Callable[[int], int]) -> None:
    """Call ``trim(0)`` every ``interval`` seconds until cancelled."""
    while True:
        await asyncio.sleep(interval)
        try:
            released = await asyncio.to_thread(trim, 0)
        except Exception:  # never stops the server
            logger.exception("giving free heap memory back to the system failed")
        else:
            logger.debug("free heap memory given back to the system", extra={"released": bool(released)})
