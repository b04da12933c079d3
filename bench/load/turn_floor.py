"""The turn loop's floor: what a turn costs the server when its three calls do (almost) nothing.

    python bench/load/turn_floor.py                    # 3 interleaved rounds, every variant
    python bench/load/turn_floor.py --rounds 1 --variants stub,real
    python bench/load/turn_floor.py --rounds 1 --variants real --store files --durability fsync --threads

One ``contextsvc serve`` process per variant (memory store, the same settings, interceptors and
start-up as ``run.py``'s), the same 50 seeded sessions, Health/Check with ghz then the turn loop
with the Go turn driver (``run.py``'s ``Loader``), back to back, so each ratio is to Health/Check
on the same process in the same window. Variants:

- ``real``: the shipped server.
- ``stub``: AppendMessages, BuildContext and RecordBaseline answer a prebuilt response (a view of
  2 messages) through the servicer's own error wrapper, after every interceptor, decoding and
  admission the real calls go through: the floor of gRPC, asyncio and the per-call Python around
  the handlers.
- ``stub-sized``: the same, BuildContext answering a prebuilt view of 60 workload messages
  (~22 KB, a seeded session's view midway through a run): what the bytes of the view add.
- ``stub-large``: the same with 150 workload messages (~55 KB, about the size of a seeded
  session's view late in a run of the suite's turn loop).
- ``stub-bare``: ``stub`` without the server's interceptors (serving gate, decode guard,
  quotas): what they add to the floor.

Experiments: ``real-count`` (refits, loop callbacks, handler CPU, sync passes, printed at exit),
``stub-count``, ``real-gc``, ``base`` (``--base DIR``: another checkout, for an A/B), and
``real-opts`` / ``stub-opts``: the server built with extra gRPC channel arguments, a JSON list of
pairs in ``TURN_FLOOR_OPTIONS`` (e.g. ``[["grpc.http2.bdp_probe", 0]]``).

The stubbed server is this file run as ``--serve ARGS...``: it patches the three servicer methods
and then runs the ordinary ``contextsvc serve ARGS...``. Bench-only; nothing here ships.
"""

from __future__ import annotations

import argparse
import ast
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _checkout  # noqa: E402,F401 - this checkout's contextsvc

VARIANTS = ("real", "stub", "stub-sized", "stub-large", "stub-bare")
EXPERIMENTS = ("real-gc", "real-count", "stub-count", "base", "real-opts", "stub-opts")


def _count_loop(counts: dict[str, int]) -> None:
    """Count the event loop's iterations and the callbacks it runs (task steps, gRPC's wake-ups)
    into ``counts`` (an experiment: the counting itself costs CPU)."""
    import asyncio
    import asyncio.base_events
    import asyncio.events

    counts.update(iterations=0, callbacks=0)
    loop_class: Any = asyncio.base_events.BaseEventLoop
    run_once, run = loop_class._run_once, asyncio.events.Handle._run

    def counted_run_once(self: Any) -> None:
        counts["iterations"] += 1
        run_once(self)

    def counted_run(self: Any) -> None:
        counts["callbacks"] += 1
        began = time.thread_time()
        run(self)
        # Each callback's thread CPU, by what it runs: a task's step by its coroutine's name,
        # anything else (gRPC's wake-ups, timers) by the callback's own name.
        callback = self._callback
        owner = getattr(callback, "__self__", None)
        if isinstance(owner, asyncio.Task):
            name = getattr(owner.get_coro(), "__qualname__", "task")
        else:
            name = getattr(callback, "__qualname__", type(callback).__name__)
        key = f"cb_us:{name}"
        counts[key] = counts.get(key, 0) + int((time.thread_time() - began) * 1e6)

    loop_class._run_once = counted_run_once
    asyncio.events.Handle._run = counted_run  # type: ignore[method-assign]

    def reset(*_: Any) -> None:  # the turn phase starts: forget what Health/Check and seeding ran
        for key in list(counts):
            if key.startswith("cb_us:"):
                del counts[key]
            else:
                counts[key] = 0

    signal.signal(signal.SIGUSR1, reset)


def _patch(variant: str) -> None:
    """Replace the three turn methods of the servicer (and, for ``stub-bare``, the interceptors)."""
    import grpc

    from contextsvc._gen.v1 import context_service_pb2 as pb
    from contextsvc._gen.v1 import resources_pb2 as r
    from contextsvc.api import servicer as sv
    from contextsvc.api.wire import EncodedResponse

    if variant.endswith("-opts"):  # an experiment: extra server channel args, JSON in TURN_FLOOR_OPTIONS
        import json

        extra = [tuple(o) for o in json.loads(os.environ.get("TURN_FLOOR_OPTIONS", "[]"))]
        plain_server = grpc.aio.server

        def with_options(*args: Any, **kwargs: Any) -> Any:
            kwargs["options"] = [*kwargs.get("options", []), *extra]
            return plain_server(*args, **kwargs)

        grpc.aio.server = with_options  # type: ignore[assignment]
        variant = variant.removesuffix("-opts") or "real"
    if variant == "real":
        return
    if variant == "real-count":  # an experiment: refits per baseline, written to stderr at exit
        import atexit

        from contextsvc.core.calibration import CalibrationRegistry
        from contextsvc.engine.accounting import TokenAccounting
        from contextsvc.engine.compaction import Compactor

        counts = {"fits": 0, "fit_us": 0, "baselines": 0, "compactions": 0}
        _count_loop(counts)
        load, observe, compact = CalibrationRegistry.load, TokenAccounting.observe, Compactor.run

        async def counted_compact(self: Any, *a: Any, **k: Any) -> Any:
            counts["compactions"] += 1
            return await compact(self, *a, **k)

        def counted_load(self: Any, *a: Any, **k: Any) -> Any:
            counts["fits"] += 1
            began = time.thread_time()
            try:
                return load(self, *a, **k)
            finally:
                counts["fit_us"] += int((time.thread_time() - began) * 1e6)

        async def counted_observe(self: Any, *a: Any, **k: Any) -> Any:
            counts["baselines"] += 1
            return await observe(self, *a, **k)

        from contextsvc.api.wire import WireCache
        from contextsvc.engine.views import ViewService

        extended, view_hit, prefix_hit = ViewService._extended, WireCache.view, WireCache.view_prefix
        counts.update(extended=0, extended_none=0, wire_view=0, wire_prefix=0, handler_us=0)

        def counted_extended(self: Any, *a: Any, **k: Any) -> Any:
            out = extended(self, *a, **k)
            counts["extended" if out is not None else "extended_none"] += 1
            return out

        def counted_view(self: Any, *a: Any, **k: Any) -> Any:
            out = view_hit(self, *a, **k)
            counts["wire_view"] += out is not None
            return out

        def counted_prefix(self: Any, *a: Any, **k: Any) -> Any:
            out = prefix_hit(self, *a, **k)
            counts["wire_prefix"] += out is not None
            return out

        import gc

        counts.update(gc0_us=0, gc1_us=0, gc2_us=0, gc0_n=0, gc2_n=0, gc_collected=0)
        gc_began = [0.0]

        def gc_timed(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                gc_began[0] = time.thread_time()
                return
            key = f"gc{info['generation']}_us"
            counts[key] += int((time.thread_time() - gc_began[0]) * 1e6)
            counts["gc2_n"] += info["generation"] == 2
            counts["gc0_n"] += info["generation"] == 0
            counts["gc_collected"] += info["collected"]

        gc.callbacks.append(gc_timed)
        ViewService._extended = counted_extended  # type: ignore[method-assign]
        WireCache.view = counted_view  # type: ignore[method-assign]
        WireCache.view_prefix = counted_prefix  # type: ignore[method-assign]

        class _Timed:  # the CPU of a handler's own steps (not of the tasks it starts)
            def __init__(self, coro: Any, name: str) -> None:
                self.coro = coro
                self.key = f"handler_us:{name}"
                counts.setdefault(self.key, 0)

            def _spent(self, began: float) -> None:
                spent = int((time.thread_time() - began) * 1e6)
                counts["handler_us"] += spent
                counts[self.key] += spent

            def __await__(self) -> Any:
                value: Any = None
                error: BaseException | None = None
                while True:
                    began = time.thread_time()
                    try:
                        step = self.coro.throw(error) if error is not None else self.coro.send(value)
                    except StopIteration as done:
                        self._spent(began)
                        return done.value
                    except BaseException:
                        self._spent(began)
                        raise
                    self._spent(began)
                    try:
                        value, error = (yield step), None
                    except BaseException as exc:
                        value, error = None, exc

        for name in ("AppendMessages", "BuildContext", "RecordBaseline"):
            handler = getattr(sv.ContextServicer, name)

            def timed(handler: Any, name: str) -> Any:
                async def run(self: Any, request: Any, context: Any) -> Any:
                    return await _Timed(handler(self, request, context), name)

                return run

            setattr(sv.ContextServicer, name, timed(handler, name))
        CalibrationRegistry.load = counted_load  # type: ignore[method-assign]
        TokenAccounting.observe = counted_observe  # type: ignore[method-assign]
        Compactor.run = counted_compact  # type: ignore[method-assign]
        # The files store's sync passes in fsync durability, and the writers they served.
        from contextsvc.stores._disk_sync import GroupCommit

        groups: list[GroupCommit] = []
        group_init = GroupCommit.__init__

        def registered(self: GroupCommit, *a: Any, **k: Any) -> None:
            group_init(self, *a, **k)
            groups.append(self)

        GroupCommit.__init__ = registered  # type: ignore[method-assign]

        def report() -> None:
            counts.update(sync_passes=sum(g.passes for g in groups), sync_writers=sum(g.writers for g in groups))
            print(f"COUNTS {counts}", file=sys.stderr, flush=True)

        atexit.register(report)
        return
    if variant == "stub-count":  # an experiment: the stub's loop callbacks, written at exit
        import atexit

        stub_counts = {"baselines": 0}
        _count_loop(stub_counts)
        atexit.register(lambda: print(f"COUNTS {stub_counts}", file=sys.stderr, flush=True))
        variant = "stub"
    if variant == "real-gc":  # an experiment: the collector at Python's threshold (``Server`` sets it)
        return
    if variant in ("stub-sized", "stub-large"):
        from workload import messages

        view = messages(60 if variant == "stub-sized" else 150)
    else:
        view = [r.Message(role=r.ROLE_USER, content="hi"), r.Message(role=r.ROLE_ASSISTANT, content="hello")]
    built = EncodedResponse(
        pb.BuildContextResponse(messages=view, view_id="v1", estimate=r.TokenEstimate(total=1200)).SerializeToString()
    )
    appended = pb.AppendMessagesResponse(sequence_numbers=[41, 42], context_tokens=1200, window_fraction=0.01)
    baseline = pb.RecordBaselineResponse(
        recorded=True, calibration=r.Calibration(model="bench", overhead=3.0, tokens_per_char=0.25, observations=1)
    )

    async def append(self: Any, request: Any, context: Any) -> Any:
        return appended

    async def build(self: Any, request: Any, context: Any) -> Any:
        return built

    async def record(self: Any, request: Any, context: Any) -> Any:
        return baseline

    sv.ContextServicer.AppendMessages = sv.unary(append)  # type: ignore[method-assign]
    sv.ContextServicer.BuildContext = sv.unary(build)  # type: ignore[method-assign]
    sv.ContextServicer.RecordBaseline = sv.unary(record)  # type: ignore[method-assign]
    if variant == "stub-bare":
        plain = grpc.aio.server

        def server(*args: Any, **kwargs: Any) -> Any:
            kwargs["interceptors"] = []
            return plain(*args, **kwargs)

        grpc.aio.server = server  # type: ignore[assignment]


def serve(variant: str, args: list[str]) -> int:
    _patch(variant)
    from contextsvc._launch import main as launch

    sys.argv = ["contextsvc", *args]
    return launch()


class Server:
    """One server process of a variant; ``address`` and ``pid`` as ``run.py``'s ``StoreServer``."""

    cluster = None  # never PostgreSQL: run.py's driver reads a cluster's CPU when there is one

    def __init__(
        self,
        variant: str,
        workdir: Path,
        config: str,
        base: Path | None = None,
        store: str = "memory",
        durability: str = "batch",
    ) -> None:
        settings = workdir / "settings.toml"
        settings.write_text(config)
        if store == "files":
            store = f"files:{workdir / 'files'}"
        args = [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            store,
            "--config",
            str(settings),
            "--log-level",
            "WARNING",
        ]
        if store != "memory":
            args += ["--durability", durability]
        env = dict(os.environ)
        if variant == "real-gc":  # Python's own collector threshold, not hot_path.gc_young_threshold
            env["CONTEXTSVC_HOT_PATH__GC_YOUNG_THRESHOLD"] = "0"
        if variant == "base":  # the ordinary server of another checkout (an A/B)
            assert base is not None, "--base names the other checkout"
            cmd = [sys.executable, "-m", "contextsvc", *args]
            env["PYTHONPATH"] = str(base)
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", variant, *args]
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.stderr, text=True, start_new_session=True, env=env,
            cwd=str(base) if variant == "base" else None,
        )  # fmt: skip
        self.pid = self.proc.pid
        self.address = ""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not self.address:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if "listening on" in line:
                    self.address = line.split("listening on ", 1)[1].split()[0]
            if self.proc.poll() is not None:
                break
        if not self.address:
            self.stop()
            self.stderr.seek(0)
            raise RuntimeError(f"server did not start: {self.stderr.read()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _thread_times(pid: int) -> dict[tuple[str, str], tuple[int, int]]:
    """(thread id, name) -> (user, system) clock ticks of every thread of process ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[(tid, name)] = (int(fields[11]), int(fields[12]))
    return out


def _per_thread(pid: int, before: dict[tuple[str, str], tuple[int, int]], turns: int) -> str:
    """Each kind of thread's CPU a turn since ``before``, user + system µs (the event loop's
    thread is the process's main thread)."""
    tick = os.sysconf("SC_CLK_TCK")
    kinds: dict[str, list[int]] = {}
    for (tid, name), (user, system) in _thread_times(pid).items():
        was = before.get((tid, name), (0, 0))
        kind = "event loop" if tid == str(pid) else name
        totals = kinds.setdefault(kind, [0, 0, 0])
        totals[0] += user - was[0]
        totals[1] += system - was[1]
        totals[2] += 1
    scale = 1e6 / tick / max(1, turns)
    rows = sorted(kinds.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    return ", ".join(f"{k} x{n} {u * scale:.0f}+{s * scale:.0f}" for k, (u, s, n) in rows if u + s)


def measure(
    variant: str,
    loader: Any,
    run: Any,
    config: str,
    base: Path | None,
    store: str,
    durability: str = "batch",
    threads: bool = False,
) -> dict[str, Any]:
    from workload import Seeder

    workdir = Path(tempfile.mkdtemp(prefix=f"ctxfloor-{variant}-"))
    server = Server(variant, workdir, config, base, store, durability)
    try:
        seeder = Seeder(server.address, "bench")
        try:
            sessions = [seeder.session(run.messages, profile=run.profile) for _ in range(run.sessions)]
        finally:
            seeder.close()
        health = loader.health(server, run)
        if variant.endswith("-count"):
            server.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
        before = _thread_times(server.pid) if threads else {}
        m = loader.driver(server, "turns", sessions, run)
        if threads:
            print(f"{variant} threads, µs a turn (user+system): {_per_thread(server.pid, before, m['count'])}")
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    server.stderr.seek(0)
    for line in server.stderr.read().splitlines():
        if line.startswith("COUNTS"):
            counted = ast.literal_eval(line.split(" ", 1)[1])
            per_turn = {k: round(v / max(1, m["count"]), 2) for k, v in counted.items()}
            shares = sorted((k for k in per_turn if k.startswith("cb_us:")), key=per_turn.__getitem__, reverse=True)
            print(variant, "per turn:", {k: v for k, v in per_turn.items() if k not in shares}, flush=True)
            print(variant, "callback CPU us per turn:", {k[6:]: per_turn[k] for k in shares}, flush=True)
    return {
        "variant": variant,
        "turns": m["count"],
        "turns_s": m["rps"],
        "health": health,
        "ratio": m["rps"] / health if health else 0.0,
        "server_ms": m["cpu_ms_per_call"],
        "driver_ms": m["driver_cpu_ms_per_call"],
        "errors": m.get("errors", {}),
        "append": m.get("latency", {}).get("AppendMessages", {}),
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        raise SystemExit(serve(sys.argv[2], sys.argv[3:]))
    import run as suite

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seconds", type=float, default=0.0, help="bound of each turn run (default: the scenario's)")
    parser.add_argument("--agents", type=int, default=0, help="sessions, one agent each (default: the scenario's)")
    parser.add_argument("--messages", type=int, default=0, help="seeded messages a session (default: the scenario's)")
    parser.add_argument("--base", type=Path, help="another checkout, run as variant 'base' (an A/B against 'real')")
    parser.add_argument("--store", default="memory", help="memory | files (the stubs make sense on memory only)")
    parser.add_argument(
        "--durability", default="batch", choices=("batch", "fsync"), help="the files store's (serve's default: fsync)"
    )
    parser.add_argument(
        "--threads", action="store_true", help="print each kind of server thread's CPU a turn (Linux /proc)"
    )
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS) - set(EXPERIMENTS)
    if unknown:
        raise SystemExit(f"unknown variant(s): {', '.join(sorted(unknown))}")
    os.chdir(suite.ROOT)
    (scenario,) = suite.load_scenarios(["turn_loop"])
    run = scenario.runs[0]
    if args.seconds:
        run.max_seconds = args.seconds
    if args.agents:  # another shape than the one the settings were chosen on (a held-out check)
        run.sessions = run.concurrency = args.agents
    if args.messages:
        run.messages = args.messages
    driver = suite.turn_driver_binary("go")
    workdir = Path(tempfile.mkdtemp(prefix="ctxfloor-"))
    try:
        loader = suite.Loader(suite.ghz_binary(), suite.protoset(), workdir, False, driver)
        _rounds(args, variants, run, loader, suite.SERVER_CONFIG)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _rounds(args: argparse.Namespace, variants: list[str], run: Any, loader: Any, config: str) -> None:
    """Every variant once a round, interleaved, then each variant's medians."""
    rows: list[dict[str, Any]] = []
    print(
        "| round | variant | turns/s | Health/Check calls/s | ratio | server CPU ms/turn | driver CPU ms/turn "
        "| AppendMessages p50/p99 ms | errors | load |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for i in range(args.rounds):
        for v in variants:
            base = args.base.resolve() if args.base else None
            res = measure(v, loader, run, config, base, args.store, args.durability, args.threads)
            rows.append(res)
            print(
                f"| {i + 1} | {v} | {res['turns_s']:.0f} | {res['health']:.0f} | {res['ratio']:.3f} "
                f"| {res['server_ms']:.2f} | {res['driver_ms']:.2f} "
                f"| {res['append'].get('p50_ms', 0):.1f}/{res['append'].get('p99_ms', 0):.1f} | {res['errors'] or 0} "
                f"| {os.getloadavg()[0]:.1f} |",
                flush=True,
            )
    print()
    for v in variants:
        mine = [r for r in rows if r["variant"] == v]
        print(
            f"{v}: median ratio {statistics.median(r['ratio'] for r in mine):.3f}, "
            f"server CPU {statistics.median(r['server_ms'] for r in mine):.2f} ms/turn, "
            f"turns/s {statistics.median(r['turns_s'] for r in mine):.0f}"
        )


if __name__ == "__main__":
    main()
