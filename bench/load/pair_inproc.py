"""The long compressed session against its fresh copy, in process: BuildContext's own CPU, no gRPC.

    python bench/load/pair_inproc.py                     # 10,000 display messages, 9 rounds
    python bench/load/pair_inproc.py --messages 2000 --rounds 5 --calls 500

The ``compressed_vs_fresh`` scenario of the load suite, without the transport: a memory store and
``ContextServicer`` with the suite's settings (run.py ``SERVER_CONFIG``), a session of the ``small``
profile filled with ``--messages`` workload messages and compressed after every seeding batch
(as ``Seeder.compressed``), and a new session holding the same context rows appended as plain
messages (``workload.fresh_copy``). Both are built once, then measured in turn, ``--rounds``
rounds of ``--calls`` BuildContext calls each (requests parsed from bytes, responses serialized,
as the server does), the order swapped every round. Prints each one's CPU per call per round and
the ratio of the medians.

Over gRPC a build of this 17-row view costs about a Health/Check, so the suite's ratio of the two
runs mostly measures the machine between its windows; this is the part the service controls.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(1, str(HERE))


async def _pair(messages: int, calls: int, rounds: int) -> dict[str, list[float]]:
    from inproc import CallContext, bench_settings, serve_in_process
    from workload import batches, fresh_copy
    from workload import messages as seed_messages

    from contextsvc._gen.v1 import context_service_pb2 as pb
    from contextsvc.api.wire import serialize
    from contextsvc.stores.memory import MemoryStore

    settings = bench_settings()
    engine, servicer = await serve_in_process(MemoryStore(settings), settings)
    ctx: Any = CallContext()
    try:
        long = (await servicer.CreateSession(pb.CreateSessionRequest(profile_id="small", name="long"), ctx)).id
        for batch in batches(seed_messages(messages)):
            await servicer.AppendMessages(pb.AppendMessagesRequest(session_id=long, messages=batch), ctx)
            await servicer.Compress(pb.CompressRequest(session_id=long, reason="bench seed"), ctx)
        page = await servicer.ListMessages(
            pb.ListMessagesRequest(session_id=long, buffer=pb.BUFFER_CONTEXT, page_size=1000), ctx
        )
        if page.next_page_token:
            raise SystemExit("the compressed context is longer than one page: use fewer --messages")
        copy = (await servicer.CreateSession(pb.CreateSessionRequest(profile_id="small", name="copy"), ctx)).id
        for batch in batches(fresh_copy(list(page.messages))):
            await servicer.AppendMessages(pb.AppendMessagesRequest(session_id=copy, messages=batch), ctx)

        requests = {
            name: pb.BuildContextRequest(session_id=sid).SerializeToString()
            for name, sid in (("compressed", long), ("fresh copy", copy))
        }

        async def build(name: str) -> bytes:
            request = pb.BuildContextRequest.FromString(requests[name])
            return serialize(await servicer.BuildContext(request, ctx))

        for name in requests:  # the first build of a session is not the steady cost
            size = len(await build(name))
            print(f"{name}: {len(page.messages)} context rows, {size:,} response bytes", file=sys.stderr)
        figures: dict[str, list[float]] = {name: [] for name in requests}
        for r in range(rounds):
            for name in requests if r % 2 == 0 else reversed(requests):
                began = time.process_time()
                for _ in range(calls):
                    await build(name)
                figures[name].append((time.process_time() - began) / calls * 1e6)
        return figures
    finally:
        await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=10_000, help="display messages of the long session")
    parser.add_argument("--calls", type=int, default=1000, help="BuildContext calls a round")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    figures = asyncio.run(_pair(args.messages, args.calls, args.rounds))
    for name, values in figures.items():
        rounds = " ".join(f"{v:.1f}" for v in values)
        print(f"{name}: median {statistics.median(values):.1f} µs CPU per call (rounds: {rounds})")
    ratio = statistics.median(figures["compressed"]) / statistics.median(figures["fresh copy"])
    print(f"compressed / fresh copy (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()
