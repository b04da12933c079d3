"""Files store at scale: start-up time, resident memory, lazy loading (issue #9 item 3).

    python bench/store/startup.py                      # 10,000 sessions, 1,000,000 messages
    python bench/store/startup.py --sessions 1000 --messages 100000
    python bench/store/startup.py --record             # and write "## Store: start-up and memory"

The data directory is written directly in the store's on-disk format (``bulk.write_files``: the
store's own encoders, one ``os.sync()``), then real ``contextsvc serve`` processes are started on
it over loopback and measured from outside:

- time from ``Popen`` to the health service answering SERVING for ``contextsvc.v1.ContextService``
  (polled every 5 ms), and the process's resident memory (``VmRSS``; ``VmHWM`` is its peak), for:
  an empty data directory (the floor: interpreter, imports, gRPC), the first start on the data (no
  start-up index: every log is read, the index written), and later starts (the index is used);
- ``ListSessions``: every page compared field for field between the start that read every log
  (the full-load path) and a start from the index; the first page's latency (median) on both;
- ``BuildContext`` on sessions not held yet (cold: the rows are read from the log) and right again
  (warm), median over ``--cold`` sessions spread over the data, and their ratio;
- resident memory after touching (BuildContext) ``--touch`` sessions with the default
  ``files.cache_mb``;
- the empty and the index start again with the package's bytecode compiled (``compileall``, as a
  wheel install or the container image has it), when the first rows ran from source because the
  environment forbids writing bytecode (``PYTHONDONTWRITEBYTECODE``): then every start compiled
  the package's modules again.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401 - this checkout's contextsvc, see _checkout.py
import grpc
from bulk import write_files
from grpc_health.v1 import health_pb2, health_pb2_grpc
from synth import Generator, Plan

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import context_service_pb2_grpc
from contextsvc.config import FilesSettings

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## Store: start-up and memory"
SERVICE = "contextsvc.v1.ContextService"
_LISTENING = re.compile(r"contextsvc listening on (\S+):(\d+)")
START_TIMEOUT_S = 600.0


@dataclass
class Start:
    seconds: float
    rss_mb: float
    hwm_mb: float
    #: CPU seconds the server process used until SERVING (less moved by other load than wall time).
    cpu_s: float = 0.0


@dataclass
class Server:
    proc: subprocess.Popen[str]
    address: str
    started: Start
    stderr: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address, options=[("grpc.max_receive_message_length", 64 << 20)])

    def memory(self) -> tuple[float, float]:
        return _memory(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)


def _memory(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB."""
    values = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def _cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(data: Path, env: dict[str, str] | None = None) -> Server:
    cmd = [sys.executable, "-m", "contextsvc", "serve", "--listen", "127.0.0.1:0", "--store", f"files:{data}"]
    stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the process
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        cwd=ROOT,
        env={**os.environ, "CONTEXTSVC_LOG_LEVEL": "WARNING", **(env or {})},
        start_new_session=True,
    )
    assert proc.stdout is not None
    deadline = started + START_TIMEOUT_S
    address = ""
    while not address and time.perf_counter() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.05)
        if ready:
            match = _LISTENING.search(proc.stdout.readline())
            if match:
                address = f"{match.group(1)}:{match.group(2)}"
        if proc.poll() is not None:
            stderr.seek(0)
            raise RuntimeError(f"server exited: {stderr.read()[-2000:]}")
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while time.perf_counter() < deadline:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1).status
            except grpc.RpcError:
                status = None
            if status == health_pb2.HealthCheckResponse.SERVING:
                break
            time.sleep(0.005)
        else:
            raise RuntimeError("server never reported SERVING")
    seconds = time.perf_counter() - started
    rss, hwm = _memory(proc.pid)
    return Server(proc, address, Start(seconds, rss, hwm, _cpu(proc.pid)), stderr)


def all_pages(stub: Any) -> list[Any]:
    out, token = [], ""
    for _ in range(100_000):  # bounded
        page = stub.ListSessions(pb.ListSessionsRequest(page_size=500, page_token=token))
        out.extend(page.sessions)
        token = page.next_page_token
        if not token:
            break
    return out


def first_page_ms(stub: Any, repeats: int = 9) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        stub.ListSessions(pb.ListSessionsRequest(page_size=50))
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def build_ms(stub: Any, sid: str) -> float:
    t = time.perf_counter()
    stub.BuildContext(pb.BuildContextRequest(session_id=sid))
    return (time.perf_counter() - t) * 1000


def _package_caches() -> set[Path]:
    return set((ROOT / "contextsvc").rglob("__pycache__"))


@contextlib.contextmanager
def compiled_package() -> Any:
    """The package's modules compiled to bytecode for the time of the block; caches this made are
    removed after it (ones that were there stay)."""
    before = _package_caches()
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "contextsvc")], check=True)
    try:
        yield
    finally:
        for cache in _package_caches() - before:
            shutil.rmtree(cache, ignore_errors=True)


def from_source() -> bool:
    """Whether servers started here compile the package from source at every start."""
    return bool(os.environ.get("PYTHONDONTWRITEBYTECODE")) and not _package_caches()


def measure(
    sessions: int, messages: int, cold: int, touch: list[int], keep: Path | None, env: dict[str, str]
) -> dict[str, Any]:
    plan = Plan(sessions, messages)
    tmp = Path(tempfile.mkdtemp(prefix="contextsvc-startup-"))
    data = keep if keep is not None else tmp / "data"
    out: dict[str, Any] = {"plan": plan, "cache_mb": FilesSettings().cache_mb, "env": env}
    try:
        if not (data / "sessions").is_dir():
            print(f"writing {sessions:,} sessions / {messages:,} messages ...", flush=True)
            out["write_s"] = write_files(data, Generator(plan))
        (data / "index.jsonl").unlink(missing_ok=True)
        out["disk_mb"] = sum(p.stat().st_size for p in (data / "sessions").iterdir()) / 1e6

        out["load_start"] = os.getloadavg()[0]
        empties = []
        for k in range(3):
            empty = start_server(tmp / f"empty{k}", env)
            empties.append(empty.started)
            empty.stop()
        out["empties"] = empties

        print("first start (no index: every log read) ...", flush=True)
        full = start_server(data, env)
        out["full"] = full.started
        with full.channel() as ch:
            stub = context_service_pb2_grpc.ContextServiceStub(ch)
            full_pages = all_pages(stub)
            out["full_first_page_ms"] = first_page_ms(stub)
        full.stop()

        starts = []
        for _ in range(3):
            s = start_server(data, env)
            starts.append(s.started)
            if len(starts) < 3:
                s.stop()
        out["indexed"] = starts
        server = s
        if from_source():
            server.stop()
            print("again with the package's bytecode compiled ...", flush=True)
            with compiled_package():
                out["bytecode_empties"] = []
                for k in range(3):
                    empty = start_server(tmp / f"empty{k}", env)
                    out["bytecode_empties"].append(empty.started)
                    empty.stop()
                out["bytecode_indexed"] = []
                for _ in range(3):
                    s = start_server(data, env)
                    out["bytecode_indexed"].append(s.started)
                    s.stop()
            server = start_server(data, env)
        ids = [info.id for info in full_pages]
        gen_ids = [plan.session_id(i) for i in range(sessions)]
        with server.channel() as ch:
            stub = context_service_pb2_grpc.ContextServiceStub(ch)
            indexed_pages = all_pages(stub)
            out["same_listing"] = [p.SerializeToString() for p in indexed_pages] == [
                p.SerializeToString() for p in full_pages
            ]
            out["listed"] = (len(indexed_pages), len(full_pages))
            out["indexed_first_page_ms"] = first_page_ms(stub)
            step = max(3, sessions // cold)
            sample = gen_ids[1::step][:cold]
            loaded_sample = gen_ids[2::step][:cold]
            colds, warms, loaded = [], [], []
            for sid, other in zip(sample, loaded_sample, strict=False):
                colds.append(build_ms(stub, sid))  # rows not held: read from the log first
                warms.append(statistics.median(build_ms(stub, sid) for _ in range(3)))
                # Rows held (read by ListMessages), but never built: the first build of a loaded session.
                stub.ListMessages(pb.ListMessagesRequest(session_id=other, page_size=1))
                loaded.append(build_ms(stub, other))
            out["cold_ms"], out["warm_ms"] = statistics.median(colds), statistics.median(warms)
            out["loaded_ms"] = statistics.median(loaded)
            out["cold_200_ms"] = build_ms(stub, gen_ids[0])
            out["warm_200_ms"] = statistics.median(build_ms(stub, gen_ids[0]) for _ in range(5))
            touched = len(sample) + 1
            rss_after: list[tuple[int, float, float]] = []
            for n in sorted(touch):
                for sid in gen_ids[:n]:
                    stub.BuildContext(pb.BuildContextRequest(session_id=sid))
                touched = max(touched, n)
                rss, hwm = server.memory()
                rss_after.append((touched, rss, hwm))
            out["rss_after"] = rss_after
            out["load_end"] = os.getloadavg()[0]
            assert set(ids) == set(gen_ids)
        server.stop()
    finally:
        if keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            for k in range(3):
                shutil.rmtree(tmp / f"empty{k}", ignore_errors=True)
    return out


def report(r: dict[str, Any], command: str) -> str:
    plan: Plan = r["plan"]
    idx: list[Start] = r["indexed"]
    empties: list[Start] = r["empties"]
    best = min(idx, key=lambda s: s.seconds)
    med = statistics.median(s.seconds for s in idx)
    med_cpu = statistics.median(s.cpu_s for s in idx)
    empty_s = statistics.median(s.seconds for s in empties)
    empty_cpu = statistics.median(s.cpu_s for s in empties)
    lines = [
        SECTION,
        "",
        f"- date: {dt.date.today().isoformat()}; machine: {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}; load average (1 min) {r['load_start']:.1f} at the start, "
        f"{r['load_end']:.1f} at the end",
        f"- command: `{command}`",
        f"- data: {plan.sessions:,} sessions, {plan.messages:,} messages, {r['disk_mb']:.0f} MB of logs"
        + (f" (written in {r['write_s']:.0f} s by `bulk.write_files`)" if "write_s" in r else ""),
        f"- default `files.cache_mb` = {r['cache_mb']:g}; settings given: "
        + (", ".join(f"`{k}={v}`" for k, v in r["env"].items()) or "none (defaults)")
        + "; times are from `Popen` to health SERVING; CPU is the server process's user + system time until then",
        "",
        "| start | to SERVING (s) | CPU until SERVING (s) | RSS after start (MB) | peak RSS (MB) |",
        "|---|---|---|---|---|",
        f"| empty data directory (floor: interpreter, imports, gRPC; median of {len(empties)}) | {empty_s:.2f} | "
        f"{empty_cpu:.2f} | {statistics.median(s.rss_mb for s in empties):.0f} | "
        f"{statistics.median(s.hwm_mb for s in empties):.0f} |",
        f"| first start: no index, every log read, index written | {r['full'].seconds:.2f} | {r['full'].cpu_s:.2f} | "
        f"{r['full'].rss_mb:.0f} | {r['full'].hwm_mb:.0f} |",
        f"| with the index (median of {len(idx)}; best {best.seconds:.2f}) | {med:.2f} | {med_cpu:.2f} | "
        f"{statistics.median(s.rss_mb for s in idx):.0f} | {statistics.median(s.hwm_mb for s in idx):.0f} |",
        "",
        f"With the index, the data adds **{med - empty_s:+.2f} s** to an empty start "
        f"({med_cpu - empty_cpu:+.2f} s of CPU).",
        "",
    ]
    if "bytecode_indexed" in r:
        b_empty, b_idx = r["bytecode_empties"], r["bytecode_indexed"]
        b_empty_s = statistics.median(s.seconds for s in b_empty)
        b_idx_s = statistics.median(s.seconds for s in b_idx)
        lines += [
            "These servers compiled the package from source at every start (the environment sets "
            "`PYTHONDONTWRITEBYTECODE`, and an editable install has no bytecode). With its bytecode "
            "compiled, as a wheel install or the container image (`deploy/Dockerfile`) has it:",
            "",
            "| start, package bytecode compiled | to SERVING (s) | CPU until SERVING (s) |",
            "|---|---|---|",
            f"| empty data directory (median of {len(b_empty)}) | {b_empty_s:.2f} | "
            f"{statistics.median(s.cpu_s for s in b_empty):.2f} |",
            f"| with the index (median of {len(b_idx)}) | {b_idx_s:.2f} | "
            f"{statistics.median(s.cpu_s for s in b_idx):.2f} |",
            "",
            f"With bytecode, the data adds **{b_idx_s - b_empty_s:+.2f} s** to an empty start.",
            "",
        ]
    lines += [
        "| measure | value |",
        "|---|---|",
        f"| ListSessions, every page: index start == full-load start | {r['same_listing']} "
        f"({r['listed'][0]:,} / {r['listed'][1]:,} sessions) |",
        f"| ListSessions first page (50), full-load start / index start (ms, median of 9) | "
        f"{r['full_first_page_ms']:.1f} / {r['indexed_first_page_ms']:.1f} |",
        f"| first BuildContext of a session not loaded / of a loaded one, ~{plan.messages // plan.sessions}-row "
        f"sessions (ms, median) | {r['cold_ms']:.1f} / {r['loaded_ms']:.1f} = "
        f"**{r['cold_ms'] / r['loaded_ms']:.2f}x** |",
        f"| first BuildContext of a session not loaded / a repeated build (view memo warm) (ms, median) | "
        f"{r['cold_ms']:.1f} / {r['warm_ms']:.1f} = {r['cold_ms'] / r['warm_ms']:.2f}x |",
        f"| BuildContext cold / warm, the 200-row session (ms) | {r['cold_200_ms']:.1f} / {r['warm_200_ms']:.1f} = "
        f"{r['cold_200_ms'] / r['warm_200_ms']:.2f}x |",
    ]
    for touched, rss, hwm in r["rss_after"]:
        lines.append(f"| RSS after BuildContext on {touched:,} sessions (MB; peak) | {rss:.0f}; {hwm:.0f} |")
    return "\n".join(lines) + "\n"


def record(text: str) -> None:
    current = RESULTS.read_text()
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    updated = pattern.sub(text + "\n", current) if pattern.search(current) else current.rstrip() + "\n\n" + text
    RESULTS.write_text(updated)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--cold", type=int, default=200, help="sessions BuildContext is timed cold and warm on")
    parser.add_argument("--touch", default="2000,10000", help="RSS after BuildContext on this many sessions")
    parser.add_argument("--keep", type=Path, help="data directory to reuse (written there if missing)")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the servers (settings)")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    touch = [min(int(n), args.sessions) for n in args.touch.split(",") if n]
    env = dict(item.split("=", 1) for item in args.env)
    result = measure(args.sessions, args.messages, args.cold, touch, args.keep, env)
    command = " ".join(["python bench/store/startup.py", *sys.argv[1:]])
    text = report(result, command)
    print(text)
    if args.record:
        record(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
