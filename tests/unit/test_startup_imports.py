"""What a ``serve`` start imports (issue #9, start-up time): modules that a start does not need stay
unimported until first used, so each start does not pay for them.

A fresh interpreter (a subprocess, so that nothing this test process imported counts) imports the
CLI and the server, starts the server on a files store in a temporary directory, and reports the
modules it holds once the server is started, and how many objects the start froze.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from contextsvc.config import Settings

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import asyncio, gc, json, sys
gc.disable()  # as the entry point (contextsvc._launch) does
from contextsvc import cli, server
from contextsvc.config import load_settings

async def main():
    settings = load_settings(store="files:" + sys.argv[1], listen="127.0.0.1:0", log_level="WARNING")
    running = await server.start(settings, freeze=True)  # as `serve` does
    loaded = sorted(sys.modules)
    frozen = gc.get_freeze_count()
    collecting = gc.isenabled()
    threshold = gc.get_threshold()
    await server.stop(running, 1.0)
    print(json.dumps({"modules": loaded, "frozen": frozen, "collecting": collecting, "threshold": threshold}))

asyncio.run(main())
"""

#: never needed to reach SERVING with the files store and no OTEL_* variables.
LAZY = (
    "httpx",  # summarizers over HTTP: on first call
    "asyncpg",  # the PostgreSQL store
    "contextsvc.stores.postgres",
    "PIL",  # image sizing: on the first image
    "tokenizers",  # exact counting: only with tokens.tokenizer_files, on first use
    "rank_bm25",  # recall
    "snowballstemmer",
    "websockets",  # the gateway
    "contextsvc.gateway",
    "cryptography",
    "numpy",
    "opentelemetry",  # the API too: bound by telemetry._load_api only once an exporter is named
    "opentelemetry.sdk.trace",  # the trace SDK (and our span factory): only with a traces exporter named
    "contextsvc.telemetry_spans",
    "opentelemetry.sdk.metrics",  # the SDK's exporters and readers: only with an exporter named
    "opentelemetry.exporter",
    "opentelemetry.instrumentation",
    "contextsvc.telemetry_metrics",
    "contextsvc.telemetry_otlp",
    "contextsvc.core.maintenance",  # the planner: imported by the first run, one interval after the start
    "contextsvc.store_tools",  # fsck / maintain
    "contextsvc.client",
    "pydantic_settings",  # not used: config.environment_values reads the variables
    "tomllib",  # only with a config file
)


def _started(tmp_path: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and not k.startswith("CONTEXTSVC_")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "data")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_a_started_server_has_not_imported_what_it_does_not_need(tmp_path: Path) -> None:
    started = _started(tmp_path)
    loaded = set(started["modules"])
    assert "contextsvc.stores.files" in loaded and "grpc" in loaded  # the probe did start a server
    eager = sorted(m for m in loaded if any(m == lazy or m.startswith(lazy + ".") for lazy in LAZY))
    assert eager == []
    # What the start made is out of the cyclic collector's reach (server._freeze_startup_objects).
    assert started["frozen"] > 10_000
    # The collector, paused by the entry point for the start, runs again once the server is up,
    # its youngest generation at hot_path.gc_young_threshold and the older two at Python's own.
    assert started["collecting"] is True
    assert started["threshold"] == [Settings().hot_path.gc_young_threshold, *gc.get_threshold()[1:]]
    assert started["threshold"][0] > 700
