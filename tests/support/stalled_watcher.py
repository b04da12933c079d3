"""A ``StreamEvents`` watcher in a process of its own, so a test can stop it dead (SIGSTOP: it
reads nothing, its socket fills) and let it go on later.

``python -m tests.support.stalled_watcher ADDRESS SESSION_ID OUT``: watches through the package's
client (``ContextClient.events``, which reconnects from the last event on ``UNAVAILABLE``), prints
``FIRST <event id>`` once the first event arrived, waits for a line on stdin, then reads until
nothing comes for 3 s or the stream fails, and writes ``{"ids": [...], "error": reason}`` to OUT."""

from __future__ import annotations

import asyncio
import json
import sys

from contextsvc.client import ContextClient
from contextsvc.errors import ContextError

IDLE_SECONDS = 3.0


async def watch(address: str, session_id: str) -> dict[str, object]:
    ids: list[int] = []
    error = ""
    # No BDP probing: the connection's window stays small, so a stopped watcher's socket fills
    # after a few hundred events and the server feels it (as with a browser tab gone to sleep).
    async with ContextClient(address, channel_options=[("grpc.http2.bdp_probe", 0)]) as client:
        events = aiter(client.events(session_id))
        first = await anext(events)
        ids.append(first["event_id"])
        print(f"FIRST {first['event_id']}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        while True:
            try:
                event = await asyncio.wait_for(anext(events), IDLE_SECONDS)
            except TimeoutError:
                break
            except ContextError as exc:
                error = exc.reason
                break
            ids.append(event["event_id"])
    return {"ids": ids, "error": error}


if __name__ == "__main__":
    result = asyncio.run(watch(sys.argv[1], sys.argv[2]))
    with open(sys.argv[3], "w") as f:
        json.dump(result, f)
