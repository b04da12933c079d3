"""Multi-RPC load drivers ghz cannot express (it calls one RPC): an agent turn loop and an event
fan-out. Run as a separate client process (``python drivers.py turns|stream ...``); prints one JSON
object. Single-threaded asyncio over one channel, like ghz's ``--cpus 1 --connections 1``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
import time
from typing import Any

import _checkout  # noqa: F401 - this checkout's contextsvc
import grpc
from workload import provider_tokens, turn_messages

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import context_service_pb2_grpc as pb_grpc
from contextsvc._gen.v1 import resources_pb2 as r

OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3),
    }


async def turns(
    address: str, sessions: list[str], *, seconds: float, max_turns: int, tokens: int, incoming: bool = False
) -> dict[str, Any]:
    """Each session is one agent: append 2 messages, build, record a baseline; repeat until a bound.
    ``incoming``: the user message goes with BuildContext, and both are appended after the baseline."""
    lat: dict[str, list[float]] = {"AppendMessages": [], "BuildContext": [], "RecordBaseline": []}
    errors: dict[str, int] = {}
    done = 0
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        stub = pb_grpc.ContextServiceStub(channel)
        deadline = time.monotonic() + seconds

        async def agent(k: int, sid: str) -> None:
            nonlocal done
            turn = 0

            async def store(messages: list[Any]) -> float:
                began = time.perf_counter()
                await stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=messages))
                return time.perf_counter() - began

            while time.monotonic() < deadline and done < max_turns:
                turn += 1
                messages = turn_messages(k * 100_000 + turn)
                try:
                    appended = 0.0 if incoming else await store(messages)
                    t1 = time.perf_counter()
                    build = pb.BuildContextRequest(session_id=sid, incoming=messages[0] if incoming else None)
                    built = await stub.BuildContext(build)
                    t2 = time.perf_counter()
                    count = provider_tokens(built.messages) if tokens == 0 else tokens
                    await stub.RecordBaseline(
                        pb.RecordBaselineRequest(session_id=sid, view_id=built.view_id, prompt_tokens=count)
                    )
                    t3 = time.perf_counter()
                    if incoming:  # both messages stored once the model answered
                        appended = await store(messages)
                except grpc.aio.AioRpcError as exc:
                    errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                    continue
                lat["AppendMessages"].append(appended)
                lat["BuildContext"].append(t2 - t1)
                lat["RecordBaseline"].append(t3 - t2)
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(agent(k, sid) for k, sid in enumerate(sessions)))
        elapsed = time.perf_counter() - started
    return {
        "count": done,
        "seconds": round(elapsed, 3),
        "rps": round(done / elapsed, 2) if elapsed else 0.0,
        "latency": {name: quantiles(v) for name, v in lat.items()},
        "errors": errors,
        "client": "python",
    }


async def stream(address: str, session: str, *, watchers: int, events: int, seconds: float) -> dict[str, Any]:
    """``watchers`` StreamEvents calls on one session while one producer appends ``events`` single
    messages; counts what every watcher received of them (by sequence number) and checks order."""
    ids: list[list[int]] = [[] for _ in range(watchers)]
    seen: list[set[int]] = [set() for _ in range(watchers)]
    #: when each watcher last received an event: the run ends at the last delivery, not when the
    #: watchers notice it (a watcher that has everything only checks on its next event, and there
    #: is none: waiting for it measured the time bound, not the deliveries).
    last_rx = [0.0] * watchers
    produced: set[int] = set()
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        stub = pb_grpc.ContextServiceStub(channel)
        ready = asyncio.Event()
        live = [0]
        calls = [stub.StreamEvents(pb.StreamEventsRequest(session_id=session)) for _ in range(watchers)]

        async def watch(i: int) -> None:
            try:
                async for ev in calls[i]:
                    if not ev.HasField("messages_appended"):
                        continue
                    if not ids[i]:
                        live[0] += 1
                        if live[0] == watchers:
                            ready.set()
                    ids[i].append(ev.event_id)
                    seen[i].update(ev.messages_appended.sequence_numbers)
                    last_rx[i] = time.perf_counter()
                    if done.is_set() and produced <= seen[i]:
                        complete.add(i)
                        if len(complete) == watchers:
                            all_in.set()
                        return
            except grpc.aio.AioRpcError:
                return

        done = asyncio.Event()
        complete: set[int] = set()
        all_in = asyncio.Event()
        tasks = [asyncio.create_task(watch(i)) for i in range(watchers)]
        # Prime: appends until every watcher is live (they subscribe asynchronously).
        for _ in range(200):
            await stub.AppendMessages(
                pb.AppendMessagesRequest(session_id=session, messages=[r.Message(role=r.ROLE_USER, content="prime")])
            )
            try:
                await asyncio.wait_for(ready.wait(), 0.05)
                break
            except TimeoutError:
                continue
        started = time.perf_counter()
        deadline = time.monotonic() + seconds
        for k in range(events):
            if time.monotonic() > deadline:
                break
            out = await stub.AppendMessages(
                pb.AppendMessagesRequest(
                    session_id=session, messages=[r.Message(role=r.ROLE_USER, content=f"event {k}")]
                )
            )
            produced.update(out.sequence_numbers)
        done.set()
        # Until every watcher has every event produced (bounded by the deadline, at least 1 s).
        complete.update(i for i in range(watchers) if produced <= seen[i])
        if len(complete) == watchers:
            all_in.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_in.wait(), max(1.0, deadline - time.monotonic()))
        elapsed = max(max(last_rx) - started, 1e-9)
        for call in calls:
            call.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    delivered = sum(len(produced & s) for s in seen)
    return {
        "count": delivered,
        "seconds": round(elapsed, 3),
        "rps": round(delivered / elapsed, 2) if elapsed else 0.0,
        "lost": sum(len(produced - s) for s in seen),
        "ordered": all(all(a < b for a, b in itertools.pairwise(g)) for g in ids),
        "watchers": watchers,
        "events": len(produced),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("driver", choices=["turns", "stream"])
    parser.add_argument("--address", required=True)
    parser.add_argument("--sessions", required=True, help="comma-separated session ids")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-count", type=int, default=10_000)
    parser.add_argument("--watchers", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=0)
    parser.add_argument(
        "--incoming", action="store_true", help="turns: the user message goes with BuildContext, appended after"
    )
    args = parser.parse_args()
    sessions = args.sessions.split(",")
    if args.driver == "turns":
        bounds = {"seconds": args.seconds, "max_turns": args.max_count, "tokens": args.prompt_tokens}
        out = asyncio.run(turns(args.address, sessions, **bounds, incoming=args.incoming))
    else:
        out = asyncio.run(
            stream(args.address, sessions[0], watchers=args.watchers, events=args.max_count, seconds=args.seconds)
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
