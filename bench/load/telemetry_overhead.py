"""What telemetry costs BuildContext: off (no OTEL_* variable) against on (OTLP to a local sink).

    python bench/load/telemetry_overhead.py            # 3 alternating rounds, print the table
    python bench/load/telemetry_overhead.py --record   # and write it under "## Telemetry overhead"

Two ``contextsvc serve`` processes on the memory store, identical but for the environment: one with
no ``OTEL_*`` variable, one exporting traces and metrics over OTLP/gRPC to a sink this script runs on
loopback (it accepts and discards, like a collector that keeps up). Each round measures, per server,
``Health/Check`` and then ``BuildContext`` on a 200-message session with ghz (the suite's settings:
50 concurrent, one connection, one client CPU); the figure compared is BuildContext calls/s as a share
of the same server's Health/Check, so machine noise between rounds cancels out. Server CPU per
BuildContext is counted from the start of its run until ``--settle`` seconds after its end, so it
includes the batch export of the run's spans; before the run the script waits as long, so the spans
of the Health/Check run before it are exported outside the window (they were not, before
December 2026: up to 2,048 health spans were encoded inside the BuildContext window).

"Off" must cost nothing against a build without telemetry: with no exporter the server installs no
interceptor and wraps no port, and what remains are the engine's no-op hooks. Their cost per
BuildContext is timed in process and set against the server CPU per call measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import run as suite  # the load suite's ghz runner, protoset, CPU accounting
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from workload import Seeder

from tests.support.server import ServerProcess

RESULTS = suite.ROOT / "bench" / "RESULTS.md"
SECTION = "## Telemetry overhead"


class Sink(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """An OTLP receiver that counts and discards."""

    def __init__(self) -> None:
        self.spans = 0
        self.exports = 0

    def Export(self, request: Any, context: Any) -> Any:
        self.exports += 1
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()
        return metrics_service_pb2.ExportMetricsServiceResponse()


def start_sink() -> tuple[grpc.Server, Sink, int]:
    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, sink, port


class Bench:
    """One server process with its seeded session and the pid whose CPU is measured."""

    def __init__(self, name: str, env: dict[str, str], workdir: Path) -> None:
        config = workdir / f"{name}.toml"
        config.write_text(suite.SERVER_CONFIG)
        self.name = name
        self.proc = ServerProcess("memory", extra_args=["--config", str(config), "--log-level", "WARNING"], env=env)
        self.proc.start()
        assert self.proc.proc is not None
        self.address = self.proc.address
        self.pid = self.proc.proc.pid
        seeder = Seeder(self.address, "bench")
        try:
            self.session = seeder.session(200, profile="bench")
        finally:
            seeder.close()

    def stop(self) -> None:
        try:
            self.proc.terminate()
        except Exception:
            self.proc.kill()


def noop_hook_us(rounds: int = 200_000) -> float:
    """Microseconds per BuildContext spent in the engine's telemetry hooks with telemetry off."""
    from contextsvc import telemetry

    started = time.perf_counter()
    for _ in range(rounds):
        with telemetry.view_span("00000000-0000-4000-8000-000000000000"):
            telemetry.view_built("bench", 200, 20_000, 0.5)
    return 1e6 * (time.perf_counter() - started) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="bound of each ghz run")
    parser.add_argument("--record", action="store_true")
    parser.add_argument(
        "--sampled",
        type=float,
        default=0.0,
        help="also run a third server sampling this share of traces (OTEL_TRACES_SAMPLER=parentbased_traceidratio)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=6.0,
        help="seconds waited after each Health/Check run and counted after each BuildContext run "
        "(longer than the batch processor's 5 s delay)",
    )
    args = parser.parse_args()
    args.load_start = os.getloadavg()[0]
    os.chdir(suite.ROOT)
    ghz = suite.ghz_binary()
    protoset = suite.protoset()
    workdir = Path(tempfile.mkdtemp(prefix="ctxtel-"))
    sink_server, sink, sink_port = start_sink()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    on_env = {
        **base_env,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "contextsvc-bench",
    }
    benches = [Bench("off", base_env, workdir), Bench("otlp", on_env, workdir)]
    if args.sampled:
        sampled_env = {
            **on_env,
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": str(args.sampled),
        }
        benches.append(Bench(f"otlp-{args.sampled:g}", sampled_env, workdir))
    loader = suite.Loader(ghz, protoset, workdir, quick=False)
    run = suite.Run(label="200 messages", max_calls=20_000, max_seconds=args.seconds)
    ratios: dict[str, list[float]] = {b.name: [] for b in benches}
    rates: dict[str, list[float]] = {b.name: [] for b in benches}
    cpu: dict[str, list[float]] = {b.name: [] for b in benches}
    try:
        for round_no in range(args.rounds):
            # Alternate the order so neither server always runs on the warmer machine.
            for bench in benches[round_no % len(benches) :] + benches[: round_no % len(benches)]:
                server = _AsServer(bench)
                health = loader.health(server, run)  # type: ignore[arg-type]
                # The spans of the Health/Check run wait up to OTEL_BSP_SCHEDULE_DELAY (5 s) in the
                # batch processor: let them go out before the BuildContext window opens, and keep the
                # window open as long after the run, so it holds the export of BuildContext's own
                # spans and no one else's (every server waits alike).
                time.sleep(args.settle)
                before = suite.cpu_seconds(bench.pid)
                m = loader.ghz_run(server, f"{suite.SERVICE}.BuildContext", [{"session_id": bench.session}], run)  # type: ignore[arg-type]
                time.sleep(args.settle)
                m["cpu_ms_per_call"] = 1000 * (suite.cpu_seconds(bench.pid) - before) / max(1, m["count"])
                ratios[bench.name].append(m["rps"] / health if health else 0.0)
                rates[bench.name].append(m["rps"])
                cpu[bench.name].append(m["cpu_ms_per_call"])
                print(
                    f"round {round_no + 1} {bench.name:5s} BuildContext {m['rps']:8.0f}/s health {health:8.0f}/s "
                    f"ratio {ratios[bench.name][-1]:.3f} cpu {m['cpu_ms_per_call']:.3f} ms/call errors {m['errors']}",
                    flush=True,
                )
    finally:
        for bench in benches:
            bench.stop()
        sink_server.stop(0)
        shutil.rmtree(workdir, ignore_errors=True)
    hook_us = noop_hook_us()
    off_cpu = statistics.median(cpu["off"])
    off_cpu_us = 1000 * off_cpu
    lines = [
        "| telemetry | BuildContext calls/s | server CPU ms/call | CPU vs off | added CPU µs/call | "
        "BuildContext / Health/Check |",
        "|---|---|---|---|---|---|",
    ]
    labels = {"off": "off (no OTEL_* variable)", "otlp": "OTLP traces + metrics, every trace (gRPC, local sink)"}
    for bench in benches:
        c = statistics.median(cpu[bench.name])
        label = labels.get(bench.name, f"OTLP, {args.sampled:.0%} of traces sampled")
        added = "—" if bench.name == "off" else f"{1000 * (c - off_cpu):.0f}"
        lines.append(
            f"| {label} | {statistics.median(rates[bench.name]):.0f} | {c:.3f} | {c / off_cpu:.2f} | {added} "
            f"| {statistics.median(ratios[bench.name]):.3f} |"
        )
    paired = []
    for bench in benches[1:]:
        per_round = [on / off for on, off in zip(cpu[bench.name], cpu["off"], strict=True)]
        label = labels.get(bench.name, f"OTLP, {args.sampled:.0%} of traces sampled")
        paired.append(
            f"{label}: {statistics.median(per_round):.2f} (rounds: {', '.join(f'{r:.2f}' for r in per_round)})"
        )
    notes = [
        f"- Load average (1 min) {args.load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.",
        "- Server CPU per call against off's in the same round (median of the rounds): " + "; ".join(paired) + ".",
        f"- Spans received by the sink during the run: {sink.spans:,} in {sink.exports:,} exports.",
        "- Compare CPU per call (medians of the rounds): telemetry also traces Health/Check, so the ratio to "
        "the floor hides its cost; on a shared machine the CPU per call of separate processes moves by a few "
        "hundred µs, so the added µs here are coarse — `bench/load/telemetry_cost.py` times them in one process.",
        f"- Off against a build without telemetry: the engine's no-op hooks cost {hook_us:.2f} µs per BuildContext "
        f"(in process, {hook_us / off_cpu_us:.2%} of the {off_cpu_us:.0f} µs of server CPU per call measured off); "
        "no interceptor, no wrapper.",
    ]
    print("\n".join([*lines, "", *notes]))
    if args.record:
        record(lines, notes, args)


class _AsServer:
    """What the suite's Loader needs of a server: its address and pid."""

    def __init__(self, bench: Bench) -> None:
        self.address = bench.address
        self.pid = bench.pid


def record(lines: list[str], notes: list[str], args: argparse.Namespace) -> None:
    command = "python bench/load/telemetry_overhead.py " + " ".join(sys.argv[1:])
    body = "\n".join(
        [
            SECTION,
            "",
            f"{dt.date.today().isoformat()} · `{command.strip()}` · {suite.machine()} · "
            f"{args.rounds} rounds of {args.seconds:g} s, servers in rotating order, memory store, "
            f"200-message session; server CPU counted from the BuildContext run's start to {args.settle:g} s "
            "after its end (the export of its spans), after waiting as long for Health/Check's spans to go out.",
            "",
            *lines,
            "",
            *notes,
            "",
        ]
    )
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    if SECTION in text:
        head, _, rest = text.partition(SECTION)
        tail = rest.partition("\n## ")
        text = head + body + (("\n## " + tail[2]) if tail[1] else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
