"""Gateway benchmarks (issue 11 targets), over loopback against real processes.

1. Fan-out: N WebSocket clients on one session through a standalone ``contextsvc gateway``, plus one
   direct ``StreamEvents`` watcher in the same process and run. Events are appended at a steady rate;
   every client must receive every event, and the p99 delay (service event time → frame received) of
   the WebSocket clients must stay within 3x that of the direct watcher.
2. Idle sockets: the extra RSS of a gateway process holding M idle sockets (spread over a few
   sessions) over the same gateway after one socket came and went.

    python bench/gateway/run.py                       # 200 clients x 200 events, 1,000 idle sockets
    python bench/gateway/run.py --clients 50 --events 50 --idle 200   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from websockets.asyncio.client import ClientConnection, connect

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.gateway.rawclient import open_client  # noqa: E402
from contextsvc._gen.v1 import context_service_pb2 as pb  # noqa: E402
from contextsvc._gen.v1 import resources_pb2 as r  # noqa: E402
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub  # noqa: E402
from tests.support.gateway import Process  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 1/100 s


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def grpc_reader(stub: ContextServiceStub, sid: str, out: dict[int, float], want: int) -> None:
    async for event in stub.StreamEvents(pb.StreamEventsRequest(session_id=sid)):
        now = time.time()
        if event.WhichOneof("payload") == "messages_appended":
            out[event.event_id] = now - event.time.ToDatetime(tzinfo=UTC).timestamp()
            if len(out) >= want:
                return


async def fanout(service: Process, gateway: Process, clients: int, events: int, rate: float) -> dict[str, float]:
    async with grpc.aio.insecure_channel(service.grpc_address) as channel:
        stub = ContextServiceStub(channel)
        sid = (await stub.CreateSession(pb.CreateSessionRequest(name="bench-fanout"))).id
        got: list[dict[int, float]] = [{} for _ in range(clients)]
        dones = [asyncio.Event() for _ in range(clients)]
        synced = [asyncio.Event() for _ in range(clients)]

        def recorder(i: int) -> Callable[[dict[str, Any], float], None]:
            def on_frame(frame: dict[str, Any], now: float) -> None:
                if frame["type"] == "session_sync":
                    synced[i].set()
                elif frame["type"] == "messages_appended":
                    got[i][frame["event_id"]] = now - datetime.fromisoformat(frame["time"]).timestamp()
                    if len(got[i]) >= events:
                        dones[i].set()

            return on_frame

        host, port = gateway.gateway_address.rsplit(":", 1)
        sockets = [await open_client(host, int(port), f"/ws/sessions/{sid}", recorder(i)) for i in range(clients)]
        await asyncio.gather(*(e.wait() for e in synced))
        direct: dict[int, float] = {}
        watcher = asyncio.create_task(grpc_reader(stub, sid, direct, events))
        await asyncio.sleep(1.0)  # both kinds of stream are open before the first event
        assert gateway.proc is not None
        cpu_gateway, cpu_self = cpu_seconds(gateway.proc.pid), time.process_time()
        started = time.monotonic()
        for n in range(events):
            await stub.AppendMessages(
                pb.AppendMessagesRequest(session_id=sid, messages=[r.Message(role=r.ROLE_USER, content=f"m{n}")])
            )
            await asyncio.sleep(max(0.0, started + (n + 1) / rate - time.monotonic()))
        await asyncio.wait_for(asyncio.gather(watcher, *(d.wait() for d in dones)), 300)
        cpu_gateway, cpu_self = cpu_seconds(gateway.proc.pid) - cpu_gateway, time.process_time() - cpu_self
        elapsed = time.monotonic() - started
        for client in sockets:
            client.close()
    ids = set(direct)
    complete = sum(1 for g in got if set(g) == ids)
    ws_delays = [d * 1000 for g in got for d in g.values()]
    grpc_delays = [d * 1000 for d in direct.values()]
    return {
        "clients": clients,
        "events": events,
        "clients_with_every_event": complete,
        "frames": len(ws_delays),
        "ws_p50_ms": pct(ws_delays, 0.50),
        "ws_p99_ms": pct(ws_delays, 0.99),
        "grpc_p50_ms": pct(grpc_delays, 0.50),
        "grpc_p99_ms": pct(grpc_delays, 0.99),
        "ws_mean_ms": statistics.fmean(ws_delays),
        "gateway_cpu": cpu_gateway / elapsed,
        "clients_cpu": cpu_self / elapsed,
    }


async def idle(service: Process, sockets: int, sessions: int) -> dict[str, float]:
    gateway = Process(["gateway", "--listen", "127.0.0.1:0", "--target", service.grpc_address]).start()
    try:
        assert gateway.proc is not None
        pid = gateway.proc.pid
        async with grpc.aio.insecure_channel(service.grpc_address) as channel:
            stub = ContextServiceStub(channel)
            sids = [(await stub.CreateSession(pb.CreateSessionRequest(name=f"idle{n}"))).id for n in range(sessions)]
        # Warm up: imports, one hub, one handshake; then the baseline.
        async with connect(gateway.ws_url(sids[0])) as ws:
            await ws.recv()
        await asyncio.sleep(1.0)
        before = rss_mb(pid)
        opened: list[ClientConnection] = []

        async def one(n: int) -> None:
            ws = await connect(gateway.ws_url(sids[n % sessions]))
            assert json.loads(await ws.recv())["type"] == "session_sync"
            opened.append(ws)

        for start in range(0, sockets, 50):
            await asyncio.gather(*(one(n) for n in range(start, min(sockets, start + 50))))
        await asyncio.sleep(2.0)
        after = rss_mb(pid)
        for ws in opened:
            await ws.close()
        return {"sockets": len(opened), "sessions": sessions, "rss_before_mb": before, "rss_after_mb": after}
    finally:
        gateway.kill()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="events per second")
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--idle-sessions", type=int, default=10)
    args = parser.parse_args()
    service = Process(["serve", "--listen", "127.0.0.1:0", "--store", "memory"]).start()
    gateway = Process(["gateway", "--listen", "127.0.0.1:0", "--target", service.grpc_address]).start()
    try:
        f = await fanout(service, gateway, args.clients, args.events, args.rate)
        gateway.kill()
        i = await idle(service, args.idle, args.idle_sessions)
    finally:
        gateway.kill()
        service.kill()
    ratio = f["ws_p99_ms"] / f["grpc_p99_ms"]
    extra = i["rss_after_mb"] - i["rss_before_mb"]
    print(f"date: {datetime.now(UTC):%Y-%m-%d}; machine: {platform.machine()}, Python {platform.python_version()}")
    print(f"command: python bench/gateway/run.py {' '.join(sys.argv[1:])}".rstrip())
    print()
    print("| measure | value |")
    print("|---|---|")
    print(f"| clients x events | {f['clients']} x {f['events']} at {args.rate:g}/s |")
    print(f"| clients that got every event | {f['clients_with_every_event']} / {f['clients']} ({f['frames']} frames) |")
    print(f"| WebSocket delay p50 / p99 | {f['ws_p50_ms']:.1f} / {f['ws_p99_ms']:.1f} ms |")
    print(f"| direct StreamEvents delay p50 / p99 | {f['grpc_p50_ms']:.1f} / {f['grpc_p99_ms']:.1f} ms |")
    print(f"| p99 ratio (target <= 3) | {ratio:.2f} |")
    print(f"| CPU: gateway / bench clients | {f['gateway_cpu']:.2f} / {f['clients_cpu']:.2f} cores |")
    print(f"| idle sockets / sessions | {i['sockets']} / {i['sessions']} |")
    print(f"| gateway RSS before / after | {i['rss_before_mb']:.1f} / {i['rss_after_mb']:.1f} MB |")
    print(f"| extra RSS (target < 100 MB) | {extra:.1f} MB ({extra * 1024 / max(1, i['sockets']):.0f} KB per socket) |")


if __name__ == "__main__":
    asyncio.run(main())
