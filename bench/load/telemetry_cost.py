"""What telemetry adds to one BuildContext, in microseconds of CPU, without the rest of the call.

    python bench/load/telemetry_cost.py                  # 15 repeats of 500 calls per variant
    python bench/load/telemetry_cost.py --record         # and write it under "## Telemetry cost in process"

The ghz comparison (telemetry_overhead.py) sets whole server processes against each other; on a
shared machine their CPU per call moves by more than the cost looked for. This isolates it: a
BuildContext's telemetry, with the real pieces and without the view work, in one process —

- the server interceptor ``serve`` installs (server span continuing the incoming metadata,
  RPC duration metric) around a handler that, like ``Engine.build_context``,
- opens ``view_span``, makes the four store calls a BuildContext makes (``get_session``,
  ``load_context``, ``get_session``, ``save_view``) through the store wrapper, and calls
  ``view_built`` (view attributes, fill metric);
- the spans go through the SDK's batch processor and the OTLP/gRPC exporter to a sink in a child
  process, flushed inside the measured window, so encoding and sending count.

The store is a stub answering at once, so what is timed is telemetry plus a constant call frame;
"variant minus off" is the added CPU per BuildContext. Each variant's figure is the lowest of the
repeats (CPU time of the process, all threads), the one least disturbed by other processes.

Variants: ``off`` (no exporter), ``otlp`` (traces and metrics, every trace sampled), ``otlp-0.1``
(``parentbased_traceidratio`` at 10 %); with ``--split`` also ``traces`` / ``traces-0.1`` /
``traces-0`` (metrics off; every trace, 10 %, none sampled) and ``metrics`` (traces off).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

from contextsvc import telemetry  # noqa: E402

SESSION = "00000000-0000-4000-8000-000000000000"


class _Metadatum(NamedTuple):  # the shape of grpc.aio's metadata entries: a (key, value) pair
    key: str
    value: str


#: what grpc.aio hands the interceptor for a ghz call: one metadata entry, no traceparent
METADATA = (_Metadatum("user-agent", "grpc-go/1.85.0"),)
METHOD = "/contextsvc.v1.ContextService/BuildContext"


class _Details:
    method = METHOD


class _Context:
    """The parts of a grpc.aio servicer context the interceptor reads."""

    def invocation_metadata(self) -> tuple[_Metadatum, ...]:
        return METADATA

    def code(self) -> None:
        return None


class _Store:
    """Answers at once: the four calls a BuildContext makes on its store."""

    async def get_session(self, session_id: str, *, caller: Any = None) -> str:
        return session_id

    async def load_context(self, session_id: str, *, caller: Any = None) -> list[Any]:
        return []

    async def save_view(self, session_id: str, view: Any = None) -> None:
        return None


def sink_main() -> None:
    """The child process: an OTLP receiver that discards, until stdin closes."""
    from telemetry_overhead import start_sink

    sink_server, _sink, port = start_sink()
    print(port, flush=True)
    sys.stdin.read()
    sink_server.stop(0)


def built(env: dict[str, str]) -> telemetry.Telemetry:
    """A private Telemetry as ``serve`` would configure it from ``env`` (set only while building)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    try:
        return telemetry.build(telemetry._wanted("traces"), telemetry._wanted("metrics"))
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)


class Variant:
    def __init__(self, name: str, tel: telemetry.Telemetry) -> None:
        self.name = name
        self.tel = tel
        store: Any = tel.wrap_store(_Store())  # type: ignore[arg-type]

        async def build_context(request: Any, context: Any) -> str:
            with telemetry.view_span(SESSION):
                await store.get_session(SESSION, caller=None)
                await store.load_context(SESSION, caller=None)
                await store.get_session(SESSION, caller=None)
                await store.save_view(SESSION, None)
                telemetry.view_built("bench", 200, 20_000, 0.005)
                return "view"

        self.handler: Any = build_context
        self.ready = False
        self.cpu_us: list[float] = []

    async def _wrapped(self) -> Any:
        import grpc

        async def continuation(details: Any) -> Any:
            return grpc.unary_unary_rpc_method_handler(self.handler)

        handler = continuation
        for interceptor in reversed(self.tel.server_interceptors()):
            handler = _chain(interceptor, handler)
        return (await handler(_Details())).unary_unary

    async def measure(self, calls: int) -> None:
        telemetry.set_current(self.tel)
        call = await self._wrapped()
        request, context = object(), _Context()
        started = time.process_time()
        for _ in range(calls):
            await call(request, context)
        await asyncio.to_thread(self.tel.flush)
        self.cpu_us.append(1e6 * (time.process_time() - started) / calls)


def _chain(interceptor: Any, continuation: Any) -> Any:
    async def next_(details: Any) -> Any:
        return await interceptor.intercept_service(continuation, details)

    return next_


async def run(calls: int, repeats: int, sink_port: int, split: bool = False) -> list[Variant]:
    otlp = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "contextsvc-bench",
    }
    sampled = {**otlp, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
    variants = [
        Variant("off", telemetry.Telemetry()),
        Variant("otlp", built(otlp)),
        Variant("otlp-0.1", built(sampled)),
    ]
    if split:  # each signal alone, and a trace the sampler always drops
        variants += [
            Variant("traces", built({**otlp, "OTEL_METRICS_EXPORTER": "none"})),
            Variant("traces-0.1", built({**sampled, "OTEL_METRICS_EXPORTER": "none"})),
            Variant("traces-0", built({**sampled, "OTEL_TRACES_SAMPLER_ARG": "0", "OTEL_METRICS_EXPORTER": "none"})),
            Variant("metrics", built({**otlp, "OTEL_TRACES_EXPORTER": "none"})),
        ]
    try:
        for v in variants:  # warm up: caches, the exporter's channel
            await v.measure(calls)
            v.cpu_us.clear()
        for repeat in range(repeats):
            shift = repeat % len(variants)
            for v in variants[shift:] + variants[:shift]:
                await v.measure(calls)
    finally:
        for v in variants:
            v.tel.shutdown()
        telemetry.set_current(telemetry.Telemetry())
    return variants


def primitives(repeats: int, number: int = 2000) -> dict[str, float]:
    """For scale, on this machine and in this run: the SDK's own cost of one span and one
    histogram measurement (lowest of ``repeats``), so the figures above read in those units."""
    import timeit

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Discard(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    tracer = provider.get_tracer("bench")
    meters = MeterProvider(metric_readers=[InMemoryMetricReader()])
    histogram = meters.get_meter("bench").create_histogram("bench")
    attributes: dict[str, Any] = {"rpc.system": "grpc", "rpc.service": "s", "rpc.method": "m"}
    attributes["rpc.grpc.status_code"] = 0

    def lowest(fn: Any) -> float:
        return 1e6 * min(timeit.repeat(fn, number=number, repeat=repeats)) / number

    try:
        return {
            "one SDK span (start_span + end, no attributes)": lowest(lambda: tracer.start_span("s").end()),
            "one histogram measurement (4 attributes)": lowest(lambda: histogram.record(0.5, attributes)),
        }
    finally:
        provider.shutdown()
        meters.shutdown()


def table(variants: list[Variant]) -> list[str]:
    off = min(variants[0].cpu_us)
    lines = ["| telemetry | CPU µs per call (lowest repeat) | added vs off, µs |", "|---|---|---|"]
    for v in variants:
        low = min(v.cpu_us)
        lines.append(f"| {v.name} | {low:.1f} | {'—' if v is variants[0] else f'{low - off:.0f}'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=500, help="calls per variant per repeat")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--record", action="store_true", help="write the table into bench/RESULTS.md")
    parser.add_argument(
        "--split",
        action="store_true",
        help="also traces alone (every trace, 10 %%, none sampled) and metrics alone",
    )
    parser.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.load_start = os.getloadavg()[0]
    if args.sink:
        sink_main()
        return
    sink = subprocess.Popen(
        [sys.executable, __file__, "--sink"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE
    )
    try:
        assert sink.stdout is not None
        port = int(sink.stdout.readline())
        variants = asyncio.run(run(args.calls, args.repeats, port, args.split))
    finally:
        if sink.stdin is not None:
            sink.stdin.close()
        sink.wait(timeout=30)
    lines = table(variants)
    notes = [f"- For scale, in the same run: {name}: {us:.1f} µs." for name, us in primitives(args.repeats).items()]
    print("\n".join([*lines, "", *notes]))
    if args.record:
        record(lines, notes, args)


def record(lines: list[str], notes: list[str], args: argparse.Namespace) -> None:
    import datetime as dt

    from run import machine

    results = HERE.parents[1] / "bench" / "RESULTS.md"
    section = "## Telemetry cost in process"
    command = "python bench/load/telemetry_cost.py " + " ".join(a for a in sys.argv[1:])
    body = "\n".join(
        [
            section,
            "",
            f"{dt.date.today().isoformat()} · `{command.strip()}` · {machine()} · {args.repeats} repeats of "
            f"{args.calls} calls per variant, rotating order; a BuildContext's telemetry with a stub store "
            f"(see the script's docstring); load average (1 min) {args.load_start:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end.",
            "",
            *lines,
            "",
            *notes,
            "",
        ]
    )
    text = results.read_text()
    if section in text:
        head, _, rest = text.partition(section)
        tail = rest.partition("\n## ")
        text = head + body + (("\n## " + tail[2]) if tail[1] else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    results.write_text(text)


if __name__ == "__main__":
    main()
