"""Where telemetry's server-level cost comes from: one run, one server per signal mix, interleaved.

    python bench/load/telemetry_split.py                       # 4 rounds, print the table
    python bench/load/telemetry_split.py --record              # and write it under "## Telemetry split"
    python bench/load/telemetry_split.py --only otlp-0.1 --spy 'record --gil'   # py-spy one variant

One ``contextsvc serve`` (memory store, 200-message session) per variant, each with its own
environment, the OTLP/gRPC ones exporting to ``telemetry_overhead.py``'s loopback sink:

- ``off``: no ``OTEL_*`` variable;
- ``traces``: OTLP traces, every trace sampled, ``OTEL_METRICS_EXPORTER=none``;
- ``traces-0.1``: the same, 10 % of traces sampled (``parentbased_traceidratio``);
- ``traces-0``: the same, no trace sampled (what tracing costs a call it does not record);
- ``metrics``: OTLP metrics, ``OTEL_TRACES_EXPORTER=none``;
- ``otlp-0.1``: both, 10 % sampled;
- ``otlp``: both, every trace sampled.

Each round runs ghz against every server in turn (rotating order): ``BuildContext`` for
``--seconds``, then ``--settle`` seconds more in the CPU window, so the batch export of the run's
spans is counted. The figure is server CPU per call from ``/proc`` (utime + stime of every thread),
split into the event-loop (main) thread and the others (gRPC's poller, the batch span processor, the
metric reader), compared with ``off`` in the same round; the table gives the median of the per-round
ratios. ``--spy`` runs py-spy on each selected server during its run instead (no table then).

On a machine others share, servers measured one after the other see different machines: the same
server's CPU per call moved by ±15 % from run to run. ``--together --rps N`` loads every server in
the same window at the same fixed rate instead, so what other processes do falls on all of them
alike, and each runs the same calls at the same pace (a saturated server's CPU per call also
depends on how many calls one event-loop turn batches, which varies with its speed). ``--before
REV`` adds, for variants named ``NAME@before``, servers running the tree of git revision ``REV``.
``--fresh`` starts new server processes for every round: one process can be steadily faster or
slower than another of the same code (by ~10 %), which fresh processes turn into round-to-round noise
that the median of the per-round ratios absorbs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import run as suite  # the load suite's ghz runner, protoset, CPU accounting
from telemetry_overhead import Bench, start_sink

RESULTS = suite.ROOT / "bench" / "RESULTS.md"
SECTION = "## Telemetry split"
VARIANTS = ("off", "traces", "traces-0.1", "traces-0", "metrics", "otlp-0.1", "otlp")
LABELS = {
    "off": "off (no OTEL_* variable)",
    "traces": "OTLP traces only, every trace",
    "traces-0.1": "OTLP traces only, 10 % sampled",
    "traces-0": "OTLP traces only, none sampled",
    "metrics": "OTLP metrics only",
    "otlp-0.1": "OTLP traces + metrics, 10 % sampled",
    "otlp": "OTLP traces + metrics, every trace",
}


def label(name: str) -> str:
    base = name.removesuffix("@before")
    return LABELS[base] + (" — before (the --before revision)" if base != name else "")


def environment(name: str, sink_port: int, extra: dict[str, str]) -> dict[str, str]:
    # One hash seed for every server: string hashing (dicts of attributes, method paths) then lays
    # out alike in each process, one source of process-to-process difference fewer.
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | {"PYTHONHASHSEED": "0"}
    if name == "off":
        return base
    env = {
        **base,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "contextsvc-bench",
        **extra,
    }
    if name.startswith("traces"):
        env["OTEL_METRICS_EXPORTER"] = "none"
    if name == "metrics":
        env["OTEL_TRACES_EXPORTER"] = "none"
    if name.endswith(("-0.1", "-0")):
        env["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
        env["OTEL_TRACES_SAMPLER_ARG"] = name.rpartition("-")[2]
    return env


def summarize(collapsed: Path, top: int) -> None:
    """bench/load/pyspy_profile.py's summary of py-spy's collapsed stacks."""
    import pyspy_profile

    pyspy_profile.summarize(collapsed, top)


def thread_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of ``pid``'s main thread and of all its other threads (live ones)."""
    main = others = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # a thread that ended meanwhile
            continue
        seconds = (int(fields[11]) + int(fields[12])) / suite.CLK_TCK
        if task.name == str(pid):
            main += seconds
        else:
            others += seconds
    return main, others


def start_build_context(
    ghz: str, protoset: Path, workdir: Path, bench: Bench, seconds: float, rps: int
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start one ghz run of BuildContext on ``bench``'s session (the suite's settings: 50 concurrent,
    one connection, one client CPU), at most ``rps`` calls/s when given (0: as fast as it goes)."""
    data_file = workdir / f"data-{bench.pid}.json"
    data_file.write_text(json.dumps([{"session_id": bench.session}]))
    out = workdir / f"ghz-{bench.pid}.json"
    cmd = [
        ghz, "--insecure", "--protoset", str(protoset), "--call", f"{suite.SERVICE}.BuildContext",
        "--data-file", str(data_file), "-c", "50", "--connections", "1", "--cpus", "1",
        "-n", "1000000", "-x", f"{seconds}s", "--duration-stop", "ignore", *(["-r", str(rps)] if rps else []),
        "--max-recv-message-size", "64MB", "--format", "json", "-o", str(out), bench.address,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out


def finish_build_context(run: tuple[subprocess.Popen[bytes], Path], seconds: float) -> dict[str, Any]:
    proc, out = run
    if proc.wait(timeout=seconds + 60) != 0:
        raise RuntimeError(f"ghz exited {proc.returncode}")
    report = json.loads(out.read_text())
    statuses = dict(report.get("statusCodeDistribution") or {})
    ok = statuses.get("OK", 0)
    total_s = report["total"] / 1e9
    return {
        "count": ok,
        "rps": ok / total_s if total_s else 0.0,
        "errors": {k: v for k, v in statuses.items() if k != "OK"},
    }


def build_context(ghz: str, protoset: Path, workdir: Path, bench: Bench, seconds: float, rps: int) -> dict[str, Any]:
    return finish_build_context(start_build_context(ghz, protoset, workdir, bench, seconds, rps), seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0, help="bound of each ghz run")
    parser.add_argument(
        "--rps",
        type=int,
        default=0,
        help="ghz rate limit (calls/s); 0: saturate. A rate every server keeps up "
        "with makes each one run the same calls the same way (no batching that differs with its speed)",
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="run every server's ghz in the same window (with --rps, so the servers share the machine evenly)",
    )
    parser.add_argument("--fresh", action="store_true", help="new server processes every round")
    parser.add_argument("--settle", type=float, default=6.0, help="seconds counted after each run (export)")
    parser.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variants")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every telemetry server")
    parser.add_argument("--spy", default="", help="py-spy arguments after --pid (e.g. 'record --gil')")
    parser.add_argument(
        "--before", default="", help="a git revision: variants named NAME@before run its tree (A/B in one run)"
    )
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    if any(n.endswith("@before") for n in names) and not args.before:
        parser.error("a variant@before needs --before DIR")
    unknown = {n.removesuffix("@before") for n in names} - set(VARIANTS)
    if unknown or (not args.spy and "off" not in names):
        parser.error(f"variants are {', '.join(VARIANTS)} (off needed for ratios); got {args.only}")
    extra = dict(item.split("=", 1) for item in args.env)
    load_start = os.getloadavg()
    os.chdir(suite.ROOT)
    ghz, protoset = suite.ghz_binary(), suite.protoset()
    workdir = Path(tempfile.mkdtemp(prefix="ctxsplit-"))
    sink_server, sink, sink_port = start_sink()
    before_tree = workdir / "before"
    if args.before:  # the earlier tree, exported from git (generated code included: it is committed)
        before_tree.mkdir()
        archive = subprocess.run(["git", "archive", args.before], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before_tree)], input=archive, check=True)

    def start_servers(started: list[Bench]) -> None:
        """Start every variant's server into ``started`` (the caller's list: stopped however this ends)."""
        for name in names:
            base = name.removesuffix("@before")
            # A variant@before runs the tree of --before (its cwd: ``python -m contextsvc`` imports from there).
            os.chdir(before_tree if base != name else suite.ROOT)
            try:
                started.append(Bench(name.replace("@", "-"), environment(base, sink_port, extra), workdir))
                started[-1].name = name
            finally:
                os.chdir(suite.ROOT)
        for bench in started:  # warm every server (first calls build caches) outside the windows
            build_context(ghz, protoset, workdir, bench, 2.0, 0)
        time.sleep(args.settle)

    cpu: dict[str, list[float]] = {n: [] for n in names}
    main_cpu: dict[str, list[float]] = {n: [] for n in names}
    other_cpu: dict[str, list[float]] = {n: [] for n in names}
    rates: dict[str, list[float]] = {n: [] for n in names}
    benches: list[Bench] = []
    try:
        for round_no in range(1 if args.spy else args.rounds):
            if not benches or args.fresh:
                # Fresh processes each round: a process's own speed (its memory layout, say) then
                # varies from round to round instead of weighing on every round alike.
                for bench in benches:
                    bench.stop()
                benches.clear()
                start_servers(benches)
            turn = round_no % len(benches)
            order = benches[turn:] + benches[:turn]
            # Together: every server's run in the same window (what other processes do to the
            # machine then falls on all alike); else one after the other.
            for group in [order] if args.together else [[b] for b in order]:
                spies = []
                if args.spy:
                    for bench in group:
                        out = workdir / f"{bench.name}.txt"
                        spy_cmd = [
                            "py-spy", *args.spy.split(), "--pid", str(bench.pid), "-r", "200",
                            "-d", str(int(args.seconds)), "--format", "raw", "-o", str(out), "--nonblocking",
                        ]  # fmt: skip
                        spies.append(subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    time.sleep(0.5)
                before = {b.name: (suite.cpu_seconds(b.pid), thread_cpu(b.pid)) for b in group}
                runs = [start_build_context(ghz, protoset, workdir, b, args.seconds, args.rps) for b in group]
                results = [finish_build_context(r, args.seconds) for r in runs]
                time.sleep(args.settle)
                for bench, m in zip(group, results, strict=True):
                    total_before, (main_before, other_before) = before[bench.name]
                    main_after, other_after = thread_cpu(bench.pid)
                    calls = max(1, m["count"])
                    cpu[bench.name].append(1000 * (suite.cpu_seconds(bench.pid) - total_before) / calls)
                    main_cpu[bench.name].append(1000 * (main_after - main_before) / calls)
                    other_cpu[bench.name].append(1000 * (other_after - other_before) / calls)
                    rates[bench.name].append(m["rps"])
                    print(
                        f"round {round_no + 1} {bench.name:17s} {m['rps']:6.0f}/s "
                        f"cpu {cpu[bench.name][-1]:.3f} ms/call (main {main_cpu[bench.name][-1]:.3f}, "
                        f"others {other_cpu[bench.name][-1]:.3f}) load {os.getloadavg()[0]:.2f} errors {m['errors']}",
                        flush=True,
                    )
                for spy, bench in zip(spies, group, strict=False):
                    spy.wait(timeout=120)
                    print(f"\n==== py-spy {args.spy} on {bench.name}")
                    summarize(workdir / f"{bench.name}.txt", 45)
    finally:
        for bench in benches:
            bench.stop()
        sink_server.stop(0)
        if os.environ.get("KEEP_WORKDIR") is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.spy:
        return
    load_end = os.getloadavg()
    lines = [
        "| telemetry | BuildContext calls/s | server CPU ms/call | main thread | other threads "
        "| CPU vs off (median of per-round ratios) | rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        per_round = [on / off for on, off in zip(cpu[name], cpu["off"], strict=True)]
        lines.append(
            f"| {label(name)} | {statistics.median(rates[name]):.0f} | {statistics.median(cpu[name]):.3f} "
            f"| {statistics.median(main_cpu[name]):.3f} | {statistics.median(other_cpu[name]):.3f} "
            f"| **{statistics.median(per_round):.3f}** | {', '.join(f'{r:.2f}' for r in per_round)} |"
        )
    notes = [
        f"- Load average (1/5/15 min) {load_start[0]:.2f}/{load_start[1]:.2f}/{load_start[2]:.2f} at the start, "
        f"{load_end[0]:.2f}/{load_end[1]:.2f}/{load_end[2]:.2f} at the end.",
        f"- Spans received by the sink: {sink.spans:,} in {sink.exports:,} exports (traces and metrics).",
        *(f"- Every telemetry server also had `{item}`." for item in args.env),
        *([f"- Variants marked before ran the tree of {args.before} from the same run."] if args.before else []),
    ]
    print("\n".join([*lines, "", *notes]))
    if args.record:
        record(lines, notes, args)


def record(lines: list[str], notes: list[str], args: argparse.Namespace) -> None:
    command = "python bench/load/telemetry_split.py " + " ".join(sys.argv[1:])
    body = "\n".join(
        [
            SECTION,
            "",
            f"{dt.date.today().isoformat()} · `{command.strip()}` · {suite.machine()} · commit "
            f"{suite.git_head()} · {args.rounds} rounds of {args.seconds:g} s, "
            f"{'every server loaded in the same window' if args.together else 'servers in rotating order'}, "
            "memory store, 200-message session, ghz 50 concurrent on one connection"
            f"{f' at {args.rps} calls/s' if args.rps else ''}"
            f"{', new server processes every round' if args.fresh else ''}; server CPU (utime + stime from "
            f"/proc) from the run's start to {args.settle:g} s after its end.",
            "",
            *lines,
            "",
            *notes,
            "",
        ]
    )
    text = RESULTS.read_text()
    if SECTION + "\n" in text:
        head, _, rest = text.partition(SECTION + "\n")
        tail = rest.partition("\n## ")
        text = head + body + (("\n## " + tail[2]) if tail[1] else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
