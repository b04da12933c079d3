"""telemetry_cost.py's harness, the telemetry module of an earlier commit against the current one.

    python bench/load/telemetry_cost_before.py                 # every trace sampled
    python bench/load/telemetry_cost_before.py --sampled 0.1   # parentbased_traceidratio 10 %

    python bench/load/telemetry_cost_before.py --rev cb66003   # against round 2 (bench/RESULTS.md)

The earlier module (``git show REV:contextsvc/telemetry.py``, default a4b5bc4: the
``opentelemetry-instrumentation-grpc`` interceptor, a span per store call; cb66003: store events,
the SDK's spans and OTLP encoder) is loaded beside the
current one; each keeps its own "current" telemetry, so both run in one process, in rotating order,
with the same stub handler, sink and flushing. That API only installs one global tracer provider
per process, hence one sampling setting per run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import telemetry_cost as tc
from opentelemetry import trace

from contextsvc import telemetry as current


class Side:
    """One variant: a telemetry module, its Telemetry, and how to flush its spans."""

    def __init__(self, name: str, module: Any, tel: Any, flush: Any) -> None:
        self.name, self.module, self.tel, self.flush = name, module, tel, flush
        self.cpu_us: list[float] = []
        store = tel.wrap_store(tc._Store())

        async def build_context(request: Any, context: Any) -> str:
            with module.view_span(tc.SESSION):
                await store.get_session(tc.SESSION, caller=None)
                await store.load_context(tc.SESSION, caller=None)
                await store.get_session(tc.SESSION, caller=None)
                await store.save_view(tc.SESSION, None)
                module.view_built("bench", 200, 20_000, 0.005)
                return "view"

        self.handler = build_context

    _wrapped = tc.Variant._wrapped

    async def measure(self, calls: int) -> None:
        self.module._current = self.tel
        call = await self._wrapped()
        request, context = object(), _Context()
        started = time.process_time()
        for _ in range(calls):
            await call(request, context)
        if self.flush is not None:
            await asyncio.to_thread(self.flush)
        self.cpu_us.append(1e6 * (time.process_time() - started) / calls)


class _Context(tc._Context):
    def peer(self) -> str:  # the earlier interceptor parses it
        return "ipv4:127.0.0.1:51234"


def load_earlier(rev: str, workdir: Path) -> Any:
    source = subprocess.run(
        ["git", "show", f"{rev}:contextsvc/telemetry.py"], capture_output=True, text=True, check=True, cwd=tc.HERE
    ).stdout
    path = workdir / "telemetry_earlier.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("telemetry_earlier", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["telemetry_earlier"] = module
    spec.loader.exec_module(module)
    return module


async def run(sides: list[Side], calls: int, repeats: int) -> None:
    for side in sides:
        await side.measure(calls)
        side.cpu_us.clear()
    for repeat in range(repeats):
        shift = repeat % len(sides)
        for side in sides[shift:] + sides[:shift]:
            await side.measure(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="a4b5bc4")
    parser.add_argument("--sampled", type=float, default=1.0, help="share of traces sampled")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    sink = subprocess.Popen(
        [sys.executable, tc.__file__, "--sink"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tc.HERE
    )
    try:
        assert sink.stdout is not None
        port = int(sink.stdout.readline())
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
        if args.sampled < 1:
            env |= {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(args.sampled)}
        with tempfile.TemporaryDirectory(prefix="ctxtelbefore-") as tmp:
            earlier = load_earlier(args.rev, Path(tmp))
            now_on = tc.built(env)
            for key in [k for k in os.environ if k.startswith("OTEL_")]:
                del os.environ[key]
            os.environ.update(env)
            try:
                earlier_on = earlier.configure()  # installs the global tracer provider it traces with
            finally:
                for key in env:
                    del os.environ[key]
            provider: Any = trace.get_tracer_provider()
            sides = [
                Side("off", current, current.Telemetry(), None),
                Side(f"now, {args.sampled:.0%} sampled", current, now_on, now_on.flush),
                Side(f"{args.rev}, {args.sampled:.0%} sampled", earlier, earlier_on, provider.force_flush),
            ]
            try:
                asyncio.run(run(sides, args.calls, args.repeats))
            finally:
                now_on.shutdown()
                earlier_on.shutdown()
    finally:
        if sink.stdin is not None:
            sink.stdin.close()
        sink.wait(timeout=30)
    print("\n".join(tc.table(sides)))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
