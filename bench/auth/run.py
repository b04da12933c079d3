"""What authentication costs a call: the same RPC against one server without and one with tokens.

Two ``contextsvc serve`` processes on loopback (memory store; the second with ``--auth tokens`` and
its tokens in a file store), interleaved in rounds so machine noise hits both alike. Each round
times ``GetSession`` calls from one client thread (sequential) and from 16 threads, on both
servers; the table shows calls per second and the ratio tokens / none. Also timed in process:
``Authenticator.authenticate`` on a cached token (the per-call price when the cache hits) and on a
miss against the files token store.

    python bench/auth/run.py [--calls 1500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from contextsvc._gen.v1 import context_service_pb2 as pb  # noqa: E402
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub  # noqa: E402
from contextsvc.clock import SystemClock  # noqa: E402
from contextsvc.config import AuthSettings, Settings  # noqa: E402
from contextsvc.core.credentials import issue  # noqa: E402
from contextsvc.engine.authn import Authenticator  # noqa: E402
from contextsvc.stores.api_tokens import FilesTokenStore  # noqa: E402
from contextsvc.stores.token_access import token_store_at  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402


async def _make_token(url: str) -> str:
    async with token_store_at(url, Settings()) as store:
        issued = issue(user="bench", is_admin=False, now=datetime.now(UTC), expire_time=None)
        await store.add_api_token(issued.record)
        return issued.secret


def _rate(stub: ContextServiceStub, sid: str, md: list[tuple[str, str]], calls: int, threads: int) -> float:
    request = pb.GetSessionRequest(session_id=sid)

    def work(n: int) -> None:
        for _ in range(n):
            stub.GetSession(request, metadata=md, timeout=10)

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, [calls // threads] * threads))
    return (calls // threads * threads) / (time.perf_counter() - started)


async def _in_process(folder: Path, token: str) -> tuple[float, float]:
    store = FilesTokenStore(folder)
    cached = Authenticator(store, AuthSettings(cache_seconds=3600, last_used_interval_seconds=3600), SystemClock())
    header = f"Bearer {token}"
    await cached.authenticate(header)
    n = 20_000
    started = time.perf_counter()
    for _ in range(n):
        await cached.authenticate(header)
    hit_us = (time.perf_counter() - started) / n * 1e6
    uncached = Authenticator(store, AuthSettings(cache_seconds=0, last_used_interval_seconds=3600), SystemClock())
    m = 2_000
    started = time.perf_counter()
    for _ in range(m):
        await uncached.authenticate(header)
    miss_us = (time.perf_counter() - started) / m * 1e6
    await cached.close()
    await uncached.close()
    return hit_us, miss_us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        token_url = f"files:{tmp}/tokens"
        token = asyncio.run(_make_token(token_url))
        hit_us, miss_us = asyncio.run(_in_process(Path(tmp) / "tokens", token))
        plain = ServerProcess("memory", extra_args=["--auth", "none"]).start()
        secured = ServerProcess(
            "memory", extra_args=["--auth", "tokens"], env={"CONTEXTSVC_AUTH__TOKEN_STORE": token_url}
        ).start()
        try:
            results: dict[tuple[str, int], list[float]] = {}
            with grpc.insecure_channel(plain.address) as c1, grpc.insecure_channel(secured.address) as c2:
                md = [("authorization", f"Bearer {token}")]
                targets = {"none": (ContextServiceStub(c1), []), "tokens": (ContextServiceStub(c2), md)}
                sids = {
                    name: stub.CreateSession(pb.CreateSessionRequest(), metadata=m).id
                    for name, (stub, m) in targets.items()
                }
                for name, (stub, m) in targets.items():  # warm up
                    _rate(stub, sids[name], m, 200, 1)
                for _ in range(args.rounds):
                    for threads in (1, 16):
                        for name, (stub, m) in targets.items():
                            rate = _rate(stub, sids[name], m, args.calls, threads)
                            results.setdefault((name, threads), []).append(rate)
        finally:
            plain.kill()
            secured.kill()
    print("| client | auth none (calls/s) | auth tokens (calls/s) | tokens / none |")
    print("|---|---|---|---|")
    for threads in (1, 16):
        none = statistics.median(results[("none", threads)])
        tokens = statistics.median(results[("tokens", threads)])
        label = "1 thread, sequential" if threads == 1 else f"{threads} threads"
        print(f"| GetSession, {label} | {none:,.0f} | {tokens:,.0f} | {tokens / none:.2f} |")
    print()
    print(f"Authenticator.authenticate in process: cached {hit_us:.1f} µs, miss on the files store {miss_us:.1f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
