"""Load suite: the service under ghz, one server process, ratios to Health/Check (DESIGN §7).

    python bench/load/run.py                         # every default scenario, print the table
    python bench/load/run.py --scenario steady_view  # one scenario (file name without .toml)
    python bench/load/run.py --record --label after  # and write "### after" under "## Load" in RESULTS.md
    python bench/load/run.py --quick                 # short bounds, to check the suite itself

Scenarios are data files in ``bench/load/scenarios/*.toml`` (format in bench/README.md). For each
store a scenario names, the suite starts ONE ``contextsvc serve`` (memory, files in a temporary
directory, or PostgreSQL in a private throwaway cluster), seeds sessions through the public API,
then for every run measures ``grpc.health.v1.Health/Check`` and the scenario's call back to back
with the same client settings (ghz ``--cpus 1 --connections 1``, 50 concurrent by default), each
bounded in calls and seconds. Ratios compare figures of the same server in the same run; a scenario
that compares stores (``derive = "across"``: the StreamEvents fan-out) starts a server for each of
them side by side after the others and measures them in turn. Multi-RPC
loads use their own clients: agent turns the Go driver in ``turndriver/`` (when ``go`` is on PATH;
``--turn-driver python`` picks the asyncio one in ``drivers.py``), event fan-out ``drivers.py``.
Server CPU per call comes from the server process's own CPU time (/proc) over the measured window.
The whole suite (no ``--scenario`` or ``--store``) also runs ``langchain_compare.py``, the in-process
target, and adds its ratios to the notes (``--no-langchain`` skips it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401 - this checkout's contextsvc
from workload import Seeder

from tests.support.postgres import PgCluster
from tests.support.server import StoreServer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCENARIOS = HERE / "scenarios"
BUILD = HERE / ".build"
HEALTH = "grpc.health.v1.Health.Check"
SERVICE = "contextsvc.v1.ContextService"
CLK_TCK = os.sysconf("SC_CLK_TCK")

#: Server profiles the scenarios name (a TOML config file given to ``serve``).
SERVER_CONFIG = """
[profiles.bench]
model = "bench"
context_window = 4000000
output_reserve_tokens = 2048

[profiles.small]
model = "bench-small"
context_window = 8192
"""


@dataclass
class Run:
    """One measured run of a scenario (a ``[[runs]]`` table)."""

    label: str
    call: str = "BuildContext"
    sessions: int = 1
    messages: int = 200
    seed: str = "plain"  # plain | compressed | copy (the context of the previous run's session)
    concurrency: int = 50
    max_calls: int = 20_000
    max_seconds: float = 10.0
    append: int = 2  # messages per AppendMessages call
    watchers: int = 50
    profile: str = "bench"
    #: one seeded tool result in every ``long_every`` is ~8,000 tokens (``workload.messages``)
    long_every: int = 0
    #: turns: the user message goes with BuildContext (``incoming``), and both messages are
    #: appended after the baseline (an agent that builds before it stores)
    incoming: bool = False
    #: soak: the same call run this long, unmeasured, before the "before" sample, so that the soak
    #: measures growth from the server's working set under that load (50 streams of 75 KB
    #: responses: ~3 MB of buffers the first seconds allocate), not from the idle server's.
    warmup_seconds: float = 0.0
    #: "decode": ghz decodes each response into a dynamic message (the contract's protoset);
    #: "opaque": the view's messages stay bytes (bench/load/opaque/), so the client's decoding
    #: (~5 ms of ghz CPU per 75 KB view) does not cap what is measured of the server.
    client: str = "decode"


@dataclass
class Scenario:
    name: str
    title: str
    driver: str  # ghz | turns | stream
    stores: list[str]
    target: str
    runs: list[Run]
    derive: str = ""  # growth | pair | soak | across | ""
    default: bool = True
    order: int = 100


@dataclass
class Result:
    scenario: str
    store: str
    label: str
    call: str
    count: int
    rps: float
    p50_ms: float
    p99_ms: float
    health_rps: float
    cpu_ms_per_call: float
    view_messages: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.rps / self.health_rps if self.health_rps else 0.0


def load_scenarios(names: list[str]) -> list[Scenario]:
    out = []
    for path in sorted(SCENARIOS.glob("*.toml")):
        if names and path.stem not in names:
            continue
        raw = tomllib.loads(path.read_text())
        runs = [Run(**r) for r in raw.pop("runs")]
        sc = Scenario(name=path.stem, runs=runs, **raw)
        if names or sc.default:
            out.append(sc)
    missing = set(names) - {s.name for s in out}
    if missing:
        raise SystemExit(f"unknown scenario(s): {', '.join(sorted(missing))}")
    return sorted(out, key=lambda s: (s.order, s.name))


# --- tools -----------------------------------------------------------------------------------


def ghz_binary() -> str:
    done = subprocess.run([str(HERE / "ghz.sh")], capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"could not install ghz: {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def turn_driver_binary(choice: str) -> str | None:
    """The Go turn-loop driver (bench/load/turndriver), built into .build/ from the module cache;
    None for the Python driver (``--turn-driver python``, or ``auto`` without Go)."""
    if choice == "python" or (choice == "auto" and shutil.which("go") is None):
        return None
    out = BUILD / "turndriver"
    BUILD.mkdir(exist_ok=True)
    env = {**os.environ, "GOFLAGS": "-mod=mod"}
    cmd = ["go", "build", "-o", str(out), "."]
    subprocess.run(cmd, cwd=HERE / "turndriver", env=env, check=True, timeout=600)
    return str(out)


def protoset() -> Path:
    """The contract plus health.proto as one descriptor set (ghz cannot use reflection against a
    Python server)."""
    import grpc_tools

    BUILD.mkdir(exist_ok=True)
    out = BUILD / "contract.protoset"
    include = Path(grpc_tools.__file__).parent / "_proto"
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"-I{HERE}", f"-I{include}",
        "--include_imports", f"--descriptor_set_out={out}", "contextsvc/v1/context_service.proto", "health.proto",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=120)
    return out


def opaque_protoset() -> Path:
    """The BuildContext call with the view's messages left as bytes (bench/load/opaque/)."""
    BUILD.mkdir(exist_ok=True)
    out = BUILD / "opaque.protoset"
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc", f"-I{HERE / 'opaque'}", "--include_imports",
        f"--descriptor_set_out={out}", "context_service.proto",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=120)
    return out


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """CPU time of process ``pid``, or of its thread ``thread`` (``pid`` itself: the main thread,
    the one that runs the event loop and every handler)."""
    return sum(cpu_split(pid, thread))


def cpu_split(pid: int, thread: int | None = None) -> tuple[float, float]:
    """``cpu_seconds`` as (user, kernel): the kernel's part is the system calls (a files store's
    writes and syncs, the sockets)."""
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
    fields = stat.read_text().rpartition(")")[2].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK  # utime, stime


def database_cpu_seconds(cluster: PgCluster | None) -> float | None:
    """CPU time of a running PostgreSQL ``cluster`` (None for none: the other stores): its
    postmaster, every process it started (backends, WAL writer, checkpointer, autovacuum), and
    those already gone. It shares the machine's cores with the server and the driver."""
    if cluster is None:
        return None
    postmaster = cluster.postmaster_pid()
    total = 0.0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rpartition(")")[2].split()
        except OSError:  # gone since the listing
            continue
        pid, parent = int(entry.name), int(fields[1])
        if pid == postmaster:  # its own time and its finished children's (cutime, cstime)
            total += sum(int(f) for f in fields[11:15]) / CLK_TCK
        elif parent == postmaster:
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def drivers_command(
    address: str,
    sessions: list[str],
    seconds: float,
    max_count: int,
    *,
    kind: str = "turns",
    incoming: bool = False,
    turn_driver: str | None = None,
) -> list[str]:
    """The command for a load of ``kind`` on ``sessions``: ``drivers.py``'s, or for the turn loop
    the Go driver ``turn_driver`` when given (``turn_driver_binary``), which takes the same flags."""
    python = [sys.executable, str(HERE / "drivers.py"), kind]
    program = [turn_driver] if turn_driver and kind == "turns" else python
    flags = [
        "--address", address, "--sessions", ",".join(sessions), "--seconds", str(seconds),
        "--max-count", str(max_count), *(["--incoming"] if incoming else []),
    ]  # fmt: skip
    return [*program, *flags]


def children_cpu_seconds() -> float:
    """CPU time of this process's finished children (a driver run is one)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class RssPeak:
    """The highest RSS of a process while a ``with`` block runs, read every ``every`` seconds by
    a thread (a soak's end reading alone could land on a low or a high of its working set)."""

    def __init__(self, pid: int, every: float = 5.0) -> None:
        self.pid, self.every, self.mb = pid, every, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            with contextlib.suppress(OSError, ValueError):
                self.mb = max(self.mb, rss_mb(self.pid))
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# --- the server --------------------------------------------------------------------------------


def start_server(store: str, workdir: Path, durability: str = "batch") -> StoreServer:
    """One ``contextsvc serve`` for one store, stopped by its own pid (the files store batches its
    fsyncs by default, as a loaded service would be configured)."""
    extra = ["--log-level", "WARNING", *(["--durability", durability] if store == "files" else [])]
    return StoreServer(store, workdir, SERVER_CONFIG, extra)


# --- measuring -----------------------------------------------------------------------------------


class Loader:
    def __init__(
        self, ghz: str, protoset_path: Path, workdir: Path, quick: bool, turn_driver: str | None = None
    ) -> None:
        self.ghz = ghz
        self.turn_driver = turn_driver
        self.protoset = protoset_path
        self.opaque = opaque_protoset()
        self.workdir = workdir
        self.quick = quick

    def bounds(self, run: Run) -> tuple[int, float]:
        if self.quick:
            return min(run.max_calls, 500), min(run.max_seconds, 2.0)
        return run.max_calls, run.max_seconds

    def ghz_run(self, server: StoreServer, method: str, data: Any, run: Run) -> dict[str, Any]:
        calls, seconds = self.bounds(run)
        data_file = self.workdir / "data.json"
        data_file.write_text(json.dumps(data))
        out = self.workdir / "ghz.json"
        protoset_path = self.opaque if run.client == "opaque" else self.protoset
        cmd = [
            self.ghz, "--insecure", "--protoset", str(protoset_path), "--call", method,
            "--data-file", str(data_file), "-c", str(run.concurrency), "--connections", "1", "--cpus", "1",
            "-n", str(calls), "-x", f"{seconds}s", "--duration-stop", "ignore", "--max-recv-message-size", "64MB",
            "--format", "json", "-o", str(out), server.address,
        ]  # fmt: skip
        before = cpu_seconds(server.pid)
        subprocess.run(cmd, check=True, timeout=seconds + 60, capture_output=True)
        cpu = cpu_seconds(server.pid) - before
        report = json.loads(out.read_text())
        lat = {d["percentage"]: d["latency"] / 1e6 for d in report.get("latencyDistribution") or []}
        statuses = dict(report.get("statusCodeDistribution") or {})
        ok = statuses.get("OK", 0)
        errors = {k: v for k, v in statuses.items() if k != "OK"}
        # ghz's rps counts failed calls too; a ratio of failures is no throughput.
        total_s = report["total"] / 1e9
        return {
            "count": ok,
            "rps": ok / total_s if total_s else 0.0,
            "p50_ms": lat.get(50, 0.0),
            "p99_ms": lat.get(99, 0.0),
            "cpu_ms_per_call": 1000 * cpu / max(1, report["count"]),
            "errors": errors,
        }

    def health(self, server: StoreServer, run: Run) -> float:
        # The floor needs no longer than a usual run (a soak's length would only add minutes).
        floor = Run(
            label="health",
            concurrency=run.concurrency,
            max_calls=min(run.max_calls, 20_000),
            max_seconds=min(run.max_seconds, 10.0),
        )
        return float(self.ghz_run(server, HEALTH, {}, floor)["rps"])

    def driver(self, server: StoreServer, kind: str, sessions: list[str], run: Run) -> dict[str, Any]:
        calls, seconds = self.bounds(run)
        incoming = kind == "turns" and run.incoming
        cmd = drivers_command(
            server.address, sessions, seconds, calls, kind=kind, incoming=incoming, turn_driver=self.turn_driver
        )
        if kind != "turns":
            cmd += ["--watchers", str(run.watchers)]
        before, children, database = cpu_split(server.pid), children_cpu_seconds(), database_cpu_seconds(server.cluster)
        loop_before, began = cpu_seconds(server.pid, server.pid), time.monotonic()
        done = subprocess.run(cmd, check=True, timeout=seconds + 120, capture_output=True, text=True)
        after = cpu_split(server.pid)
        cpu, kernel = sum(after) - sum(before), after[1] - before[1]
        # The event loop's thread busy over the run (driver start and exit included): near 1.0,
        # the server was the bottleneck; well below it, the calls waited on something else.
        loop_busy = (cpu_seconds(server.pid, server.pid) - loop_before) / max(1e-9, time.monotonic() - began)
        out: dict[str, Any] = json.loads(done.stdout)
        out["loop_busy"] = round(loop_busy, 3)
        out["cpu_ms_per_call"] = 1000 * cpu / max(1, out["count"])
        out["kernel_cpu_ms_per_call"] = 1000 * kernel / max(1, out["count"])
        # The driver shares the cores with the server (ghz, for Health/Check, is Go and cheap).
        out["driver_cpu_ms_per_call"] = 1000 * (children_cpu_seconds() - children) / max(1, out["count"])
        if database is not None:  # PostgreSQL's own work for these calls, on the same cores
            out["database_cpu_ms_per_call"] = (
                1000 * ((database_cpu_seconds(server.cluster) or 0.0) - database) / max(1, out["count"])
            )
        return out


def seed(seeder: Seeder, run: Run, previous: list[str]) -> list[str]:
    if run.seed == "compressed":
        return [seeder.compressed(run.messages, profile=run.profile)]
    if run.seed == "copy":
        return [seeder.copy_context(previous[0], profile=run.profile)]
    return [seeder.session(run.messages, profile=run.profile, long_every=run.long_every) for _ in range(run.sessions)]


def call_data(run: Run, sessions: list[str]) -> list[dict[str, Any]]:
    from google.protobuf import json_format
    from workload import messages

    if run.call == "BuildContext":
        return [{"session_id": s} for s in sessions]
    if run.call == "AppendMessages":
        batch = [json_format.MessageToDict(m) for m in messages(run.append, start=run.messages)]
        return [{"session_id": s, "messages": batch} for s in sessions]
    raise SystemExit(f"unknown call {run.call}")


#: Rounds of a "pair" scenario: its two runs measured in turn, ABBAABBAAB, each round a fifth of
#: the run's bounds. Taken one after the other, the same two sessions came out 1.05-1.19x apart on
#: a quiet machine; with three rounds each the medians still read 0.91-1.15x from run to run
#: (round 17), while in process the two builds cost the same, 1.000x (``pair_inproc.py``): the
#: ratio of a few short windows measured the windows as much as the sessions.
PAIR_ORDER = (0, 1, 1, 0, 0, 1, 1, 0, 0, 1)


def run_scenario(loader: Loader, server: StoreServer, store: str, sc: Scenario) -> list[Result]:
    if sc.derive == "pair" and sc.driver == "ghz" and len(sc.runs) == 2:
        return run_pair(loader, server, store, sc)
    results = []
    seeder = Seeder(server.address, "bench")
    previous: list[str] = []
    try:
        for run in sc.runs:
            sessions = seed(seeder, run, previous)
            previous = sessions
            view = seeder.context_count(sessions[0])
            if run.call == "BuildContext" and sc.driver == "ghz":
                seeder.warm(sessions)  # one build each first: a cold first build is not the steady cost
            health = loader.health(server, run)
            warmed = 0.0
            if sc.derive == "soak" and run.warmup_seconds > 0:
                warmup = dataclasses.replace(run, max_seconds=run.warmup_seconds)
                warmed = loader.bounds(warmup)[1]
                loader.ghz_run(server, f"{SERVICE}.{run.call}", call_data(run, sessions), warmup)
            rss_before = rss_mb(server.pid)
            if sc.driver == "ghz":
                with RssPeak(server.pid) as peak:
                    m = loader.ghz_run(server, f"{SERVICE}.{run.call}", call_data(run, sessions), run)
                extra: dict[str, Any] = {}
                if sc.derive == "soak":
                    after = rss_mb(server.pid)
                    extra = {
                        "rss_before_mb": rss_before,
                        "rss_after_mb": after,
                        "rss_peak_mb": max(peak.mb, after),
                        "warmup_seconds": warmed,
                    }
            else:
                m = loader.driver(server, sc.driver, sessions, run)
                extra = {
                    k: v
                    for k, v in m.items()
                    if k
                    in (
                        "latency",
                        "lost",
                        "ordered",
                        "watchers",
                        "events",
                        "driver_cpu_ms_per_call",
                        "database_cpu_ms_per_call",
                        "kernel_cpu_ms_per_call",
                        "client",
                        "loop_busy",
                    )
                }
            res = Result(
                scenario=sc.name, store=store, label=run.label, call=run.call if sc.driver == "ghz" else sc.driver,
                count=m["count"], rps=m["rps"], p50_ms=m.get("p50_ms", 0.0), p99_ms=m.get("p99_ms", 0.0),
                health_rps=health, cpu_ms_per_call=m["cpu_ms_per_call"], view_messages=view,
                errors=m.get("errors", {}), extra=extra,
            )  # fmt: skip
            print(row(res), flush=True)
            results.append(res)
    finally:
        seeder.close()
    return results


def run_pair(loader: Loader, server: StoreServer, store: str, sc: Scenario) -> list[Result]:
    """Both runs seeded and warmed first, then measured in turn (``PAIR_ORDER``); each run's
    figures are the medians of its rounds (counts summed), Health/Check measured before each."""
    seeder = Seeder(server.address, "bench")
    try:
        sessions: list[list[str]] = []
        for run in sc.runs:
            sessions.append(seed(seeder, run, sessions[-1] if sessions else []))
        for each in sessions:
            seeder.warm(each)
        views = [seeder.context_count(each[0]) for each in sessions]
    finally:
        seeder.close()
    rounds: list[list[tuple[float, dict[str, Any]]]] = [[], []]
    share = sum(1 for k in PAIR_ORDER if k == 0)
    for k in PAIR_ORDER:
        run = sc.runs[k]
        part = dataclasses.replace(run, max_calls=max(1, run.max_calls // share), max_seconds=run.max_seconds / share)
        health = loader.health(server, part)
        rounds[k].append((health, loader.ghz_run(server, f"{SERVICE}.{run.call}", call_data(run, sessions[k]), part)))
    results = []
    for k, run in enumerate(sc.runs):
        res = Result(
            scenario=sc.name, store=store, label=run.label, call=run.call, view_messages=views[k],
            extra={}, **_medians(rounds[k]),
        )  # fmt: skip
        print(row(res), flush=True)
        results.append(res)
    return results


def _medians(rounds: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """A run's figures over its rounds (each its Health/Check calls/s and its measurement): the
    medians, and the counts and errors summed."""
    ms = [m for _, m in rounds]
    errors: dict[str, int] = {}
    for m in ms:
        for code, n in m.get("errors", {}).items():
            errors[code] = errors.get(code, 0) + n
    return {
        "count": sum(m["count"] for m in ms),
        "rps": statistics.median(m["rps"] for m in ms),
        "p50_ms": statistics.median(m.get("p50_ms", 0.0) for m in ms),
        "p99_ms": statistics.median(m.get("p99_ms", 0.0) for m in ms),
        "health_rps": statistics.median(h for h, _ in rounds),
        "cpu_ms_per_call": statistics.median(m["cpu_ms_per_call"] for m in ms),
        "errors": errors,
    }


#: Rounds of an "across" scenario: its stores measured in turn, A B B A A B, both servers up for
#: the whole scenario. In the whole suite the memory store's fan-out ran ~15 minutes before
#: PostgreSQL's, on a server of its own; a machine that slowed in between moved the ratio from
#: 0.62-0.67 (the scenario alone) to 0.48 (round 39).
ACROSS_ORDER = (0, 1, 1, 0, 0, 1)


def run_across(loader: Loader, stores: list[str], sc: Scenario) -> list[Result]:
    """Each store's server started, then the scenario's single run measured on them in turn
    (``ACROSS_ORDER``), each round on sessions seeded for it and after its own Health/Check;
    each store's figures are the medians of its rounds (counts, losses and errors summed)."""
    (run,) = sc.runs
    servers: list[StoreServer] = []
    workdirs: list[Path] = []
    rounds: dict[str, list[tuple[float, dict[str, Any]]]] = {s: [] for s in stores}
    views: dict[str, int] = {}
    try:
        for store in stores:
            workdirs.append(Path(tempfile.mkdtemp(prefix=f"ctxload-{store}-")))
            servers.append(start_server(store, workdirs[-1]))
        order = ACROSS_ORDER if len(stores) == 2 else tuple(k for k in range(len(stores)) for _ in range(3))
        for k in order:
            server, store = servers[k], stores[k]
            seeder = Seeder(server.address, "bench")
            try:
                sessions = seed(seeder, run, [])
                view = seeder.context_count(sessions[0])
            finally:
                seeder.close()
            health = loader.health(server, run)
            views[store] = view
            rounds[store].append((health, loader.driver(server, sc.driver, sessions, run)))
    finally:
        for server in servers:
            server.stop()
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)
    results = []
    for store in stores:
        ms = [m for _, m in rounds[store]]
        res = Result(
            scenario=sc.name, store=store, label=f"{run.label}, median of {len(ms)} rounds", call=sc.driver,
            view_messages=views[store], **_medians(rounds[store]),
            extra={
                "lost": sum(m.get("lost", 0) for m in ms),
                "ordered": all(m.get("ordered", True) for m in ms),
                "rounds_rps": [m["rps"] for m in ms],
            },
        )  # fmt: skip
        print(row(res), flush=True)
        results.append(res)
    return results


# --- reporting -----------------------------------------------------------------------------------

LOAD_INTRO = (
    "Command: `python bench/load/run.py` (bench/load/README in bench/README.md). Ratios are to "
    "`grpc.health.v1.Health/Check` on the same server process, measured just before each run with the same "
    "client settings; server CPU per call is the server process's own CPU time over the run."
)
HEADER = (
    "| scenario | store | run | calls | calls/s | Health/Check calls/s | ratio | p50 ms | p99 ms "
    "| server CPU ms/call | context rows | errors |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def row(r: Result) -> str:
    errors = ", ".join(f"{k} {v}" for k, v in r.errors.items()) or "0"
    if "lost" in r.extra:
        errors += f"; lost {r.extra['lost']}, ordered {r.extra['ordered']}"
    return (
        f"| {r.scenario} | {r.store} | {r.label} | {r.count} | {r.rps:,.0f} | {r.health_rps:,.0f} | {r.ratio:.3f} "
        f"| {r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.cpu_ms_per_call:.2f} | {r.view_messages} | {errors} |"
    )


def derived(scenarios: list[Scenario], results: list[Result]) -> list[str]:
    lines = []
    for sc in scenarios:
        mine = [r for r in results if r.scenario == sc.name]
        for store in sc.stores:
            rs = [r for r in mine if r.store == store]
            if not rs:
                continue
            if sc.derive == "growth" and len(rs) >= 2:
                small, big = rs[0], rs[-1]
                per_msg = (
                    (big.cpu_ms_per_call - small.cpu_ms_per_call)
                    * 1000
                    / max(1, big.view_messages - small.view_messages)
                )
                lines.append(
                    f"- {sc.name} ({store}): {per_msg:.1f} µs of server CPU per extra message in the view; "
                    f"{big.view_messages}-row view costs {big.cpu_ms_per_call / small.cpu_ms_per_call:.1f}x "
                    f"a {small.view_messages}-row view (target <= 3 µs, <= 10x)"
                )
            elif sc.derive == "pair" and len(rs) == 2:
                a, b = rs
                lines.append(
                    f"- {sc.name} ({store}): {a.label} costs {a.cpu_ms_per_call / b.cpu_ms_per_call:.2f}x the server "
                    f"CPU per call of {b.label}, throughput {b.rps / a.rps:.2f}x slower (target <= 1.1x)"
                )
            elif sc.derive == "soak":
                for r in rs:
                    before, after = r.extra["rss_before_mb"], r.extra["rss_after_mb"]
                    warm = r.extra.get("warmup_seconds", 0)
                    lines.append(
                        f"- {sc.name} ({store}, {r.label}): server RSS {before:.1f} -> {after:.1f} MB "
                        f"({100 * (after - before) / before:+.1f}%) over {r.count} calls, highest "
                        f"{r.extra.get('rss_peak_mb', after):.1f} MB"
                        + (f", after {warm:g} s of the same load unmeasured" if warm else "")
                        + " (target < 5%)"
                    )
            elif sc.driver == "turns":
                for r in rs:
                    lat = r.extra.get("latency", {})
                    rb, ap = lat.get("RecordBaseline", {}), lat.get("AppendMessages", {})
                    lines.append(
                        f"- {sc.name} ({store}): {r.ratio:.3f} turns/s per Health/Check call/s (target >= 0.20); "
                        f"p50/p99 ms: AppendMessages {ap.get('p50_ms', 0):.1f}/{ap.get('p99_ms', 0):.1f}, "
                        f"BuildContext {lat.get('BuildContext', {}).get('p50_ms', 0):.1f}/"
                        f"{lat.get('BuildContext', {}).get('p99_ms', 0):.1f}, "
                        f"RecordBaseline {rb.get('p50_ms', 0):.1f}/{rb.get('p99_ms', 0):.1f} "
                        f"(target: RecordBaseline p99 <= 2x AppendMessages p99); "
                        f"CPU ms per turn: server {r.cpu_ms_per_call:.2f} "
                        f"(of which in the kernel {r.extra.get('kernel_cpu_ms_per_call', 0):.2f}), "
                        f"driver ({r.extra.get('client', 'python')}) {r.extra.get('driver_cpu_ms_per_call', 0):.2f}"
                        + (
                            f", PostgreSQL {r.extra['database_cpu_ms_per_call']:.2f}"
                            if "database_cpu_ms_per_call" in r.extra
                            else ""
                        )
                        + "; "
                        f"the server's event-loop thread busy {r.extra.get('loop_busy', 0):.0%} of the run"
                    )
    stream = {r.store: r for r in results if r.scenario.startswith("stream")}
    if "memory" in stream and "postgres" in stream:
        pg, mem = stream["postgres"], stream["memory"]
        # Round by round: each PostgreSQL round against the memory round measured next to it.
        pairs = list(zip(mem.extra.get("rounds_rps", []), pg.extra.get("rounds_rps", []), strict=False))
        lines.append(
            f"- StreamEvents fan-out: PostgreSQL delivers {pg.rps / mem.rps:.2f}x the memory store's events/s "
            "(target >= 0.5)"
            + (f"; round by round {', '.join(f'{b / a:.2f}' for a, b in pairs)}" if len(pairs) > 1 else "")
        )
    return lines


def machine() -> str:
    python = platform.python_version()
    return f"{os.cpu_count()} cores (nproc), Python {python}, {platform.system()} {platform.machine()}"


def record(label: str, command: str, table: list[str], notes: list[str]) -> None:
    path = HERE.parent / "RESULTS.md"
    text = path.read_text()
    block = "\n".join(
        [
            f"### {label}",
            "",
            f"- date: {dt.date.today().isoformat()}; machine: {machine()}; "
            f"commit: {git_head()}; client: ghz v0.120.0 `--cpus 1 --connections 1`",
            f"- command: `{command}`",
            "",
            HEADER,
            *table,
            "",
            *notes,
            "",
        ]
    )
    if "## Load\n" not in text:
        text = text.rstrip("\n") + "\n\n## Load\n\n" + LOAD_INTRO + "\n\n"
    start = text.index("## Load\n")
    end_match = re.compile(r"\n## ").search(text, start + 1)
    end = end_match.start() + 1 if end_match else len(text)
    section = text[start:end]
    sub = re.compile(rf"### {re.escape(label)}\n.*?(?=\n### |\Z)", re.S)
    if sub.search(section):
        section = sub.sub(lambda _m: block.rstrip("\n"), section)
    else:
        section = section.rstrip("\n") + "\n\n" + block
    path.write_text(text[:start] + section.rstrip("\n") + "\n" + ("\n" + text[end:] if end < len(text) else ""))


def langchain_micros(table: str) -> dict[str, float]:
    """µs per call by row of ``langchain_compare.py``'s table: ``langchain``, then our states by
    name (``cold``, ``warm``, ``extended``, ``reused``)."""
    micros: dict[str, float] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 4 or not cells[2].replace(",", "").isdigit():
            continue
        name = "langchain" if cells[1].startswith("LangChain") else cells[1].split(",")[-1].split("(")[0].strip()
        micros[name] = float(cells[2].replace(",", ""))
    return micros


def langchain_note(quick: bool) -> str:
    """The in-process target beside the served ones (issue #15): a 200-message view built again
    (warm) against LangChain's ``trim_messages``, timed in one run by ``langchain_compare.py`` (which
    makes its own environment for LangChain); one line for the notes. It ran apart from the suite
    and drifted past its target unseen for four rounds, so the whole suite measures it too."""
    rounds, calls = ("3", "10") if quick else ("15", "30")
    cmd = [sys.executable, str(HERE / "langchain_compare.py"), "--rounds", rounds, "--calls", calls]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    micros = langchain_micros(done.stdout)
    if done.returncode != 0 or not {"langchain", "warm", "extended"} <= micros.keys():
        why = (done.stderr.strip().splitlines() or ["no table"])[-1]
        return f"- in process vs LangChain `trim_messages`: not measured ({why})"
    lc = micros["langchain"]
    return (
        f"- in process (`python bench/load/langchain_compare.py --rounds {rounds} --calls {calls}`): a 200-message "
        f"view built again {micros['warm']:,.0f} µs against LangChain's `trim_messages` {lc:,.0f} µs, "
        f"{micros['warm'] / lc:.2f}x (target <= 1.0); extended by one agent step {micros['extended'] / lc:.2f}x"
    )


def git_head() -> str:
    cmd = ["git", "rev-parse", "--short", "HEAD"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    return done.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", default=[], help="scenario file name (repeatable)")
    parser.add_argument("--store", action="append", default=[], help="only these stores (repeatable)")
    parser.add_argument("--quick", action="store_true", help="short bounds (checks the suite, not the service)")
    parser.add_argument("--record", action="store_true", help="write the table into bench/RESULTS.md")
    parser.add_argument("--label", default="latest", help="subsection of '## Load' that --record rewrites")
    parser.add_argument(
        "--no-langchain",
        action="store_true",
        help="skip the in-process comparison with LangChain that the whole suite (no --scenario) runs",
    )
    parser.add_argument(
        "--turn-driver",
        choices=["auto", "go", "python"],
        default="auto",
        help="client of the turn loop: the Go driver (bench/load/turndriver; auto: when `go` is on PATH) or drivers.py",
    )
    args = parser.parse_args()
    os.chdir(ROOT)
    scenarios = load_scenarios(args.scenario)
    ghz = ghz_binary()
    ps = protoset()
    turn_driver = turn_driver_binary(args.turn_driver) if any(sc.driver == "turns" for sc in scenarios) else None
    wanted = [s for s in ("memory", "files", "postgres") if not args.store or s in args.store]
    # One server a store for the scenarios measured store by store; "across" ones start their own.
    stores = [s for s in wanted if any(s in sc.stores for sc in scenarios if sc.derive != "across")]
    results: list[Result] = []
    print(HEADER, flush=True)
    for store in stores:
        workdir = Path(tempfile.mkdtemp(prefix=f"ctxload-{store}-"))
        server = start_server(store, workdir)
        try:
            loader = Loader(ghz, ps, workdir, args.quick, turn_driver)
            for sc in scenarios:
                if store in sc.stores and sc.derive != "across":
                    results += run_scenario(loader, server, store, sc)
        finally:
            server.stop()
            shutil.rmtree(workdir, ignore_errors=True)
    for sc in scenarios:
        if sc.derive == "across":
            chosen = [s for s in sc.stores if s in wanted]
            if chosen:
                workdir = Path(tempfile.mkdtemp(prefix="ctxload-across-"))
                try:
                    results += run_across(Loader(ghz, ps, workdir, args.quick, turn_driver), chosen, sc)
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
    notes = derived(scenarios, results)
    if not args.scenario and not args.store and not args.no_langchain:
        notes.append(langchain_note(args.quick))
    print("\n".join(notes))
    if args.record:
        command = shlex.join(["python", "bench/load/run.py", *sys.argv[1:]])
        record(args.label, command.strip(), [row(r) for r in results], notes)


if __name__ == "__main__":
    main()
