"""Where a call's server CPU goes: one ``contextsvc serve`` under ghz, sampled by py-spy.

    python bench/load/pyspy_profile.py                              # BuildContext, 200 messages, memory
    python bench/load/pyspy_profile.py --call AppendMessages --store files --seconds 15
    python bench/load/pyspy_profile.py --call turns --sessions 50 --messages 40 --store files --durability fsync
    python bench/load/pyspy_profile.py --call Health                # the floor, for comparison
    python bench/load/pyspy_profile.py --client opaque              # ghz keeps the view's messages as bytes
    python bench/load/pyspy_profile.py --call turns --sessions 50 --messages 40   # the agent turn loop
    python bench/load/pyspy_profile.py --call turns --sessions 50 --messages 40 --profile small  # compressing
    python bench/load/pyspy_profile.py --call turns --sessions 50 --messages 40 --profile default --incoming
    python bench/load/pyspy_profile.py --call stream --store postgres --messages 4   # 50 watchers' fan-out

Starts the server like ``run.py`` does, seeds one session (or ``--sessions``), warms it, then runs
ghz (``--cpus 1 --connections 1``, 50 concurrent) for ``--seconds`` while ``py-spy record`` samples
the server. Prints server CPU per call, then the functions with the most samples: "self" (the
function's own frames) and "total" (anywhere on the stack), as percentages of all samples.
``--raw FILE`` keeps py-spy's collapsed stacks for a flame graph.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401 - this checkout's contextsvc
from run import (
    HEALTH,
    SERVICE,
    Run,
    call_data,
    cpu_seconds,
    drivers_command,
    ghz_binary,
    opaque_protoset,
    protoset,
    start_server,
    turn_driver_binary,
)
from workload import Seeder


def _frame(f: str) -> str:
    """``function (file:line)`` -> ``function (file)``: one entry per function."""
    name, sep, where = f.partition(" (")
    return f"{name} ({where.split(':')[0]})" if sep else f


def summarize(collapsed: Path, top: int) -> None:
    self_n: collections.Counter[str] = collections.Counter()
    total_n: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        samples += n
        frames = [_frame(f) for f in stack.split(";")]
        self_n[frames[-1]] += n
        for f in set(frames):
            total_n[f] += n
    print(f"\n{samples} samples")
    for title, counter in (("self", self_n), ("total", total_n)):
        print(f"\n-- {title} --")
        for name, n in counter.most_common(top):
            print(f"{100 * n / samples:6.1f}%  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--call", default="BuildContext", help="BuildContext | AppendMessages | Health | turns | stream"
    )
    parser.add_argument(
        "--turn-driver", choices=["auto", "go", "python"], default="auto", help="client of --call turns"
    )
    parser.add_argument("--store", default="memory")
    parser.add_argument(
        "--durability", choices=("batch", "fsync"), default="batch", help="the files store's (serve's default: fsync)"
    )
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument(
        "--profile", default="bench", help="the seeded sessions' profile (run.py SERVER_CONFIG; small: 8,192 tokens)"
    )
    parser.add_argument("--long-every", type=int, default=0, help="one tool result in N is long (Run.long_every)")
    parser.add_argument("--incoming", action="store_true", help="turns: the user message goes with BuildContext")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--raw", type=Path, help="keep py-spy's collapsed stacks here")
    parser.add_argument("--client", default="decode", help="decode | opaque (see run.py's Run.client)")
    parser.add_argument("--native", action="store_true", help="py-spy --native (C frames of grpc too)")
    parser.add_argument("--threads", action="store_true", help="py-spy --threads (a frame per thread)")
    parser.add_argument("--no-spy", action="store_true", help="only CPU per call, no sampling")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="ctxprof-"))
    ghz, ps = ghz_binary(), (opaque_protoset() if args.client == "opaque" else protoset())
    server = start_server(args.store, workdir, args.durability)
    try:
        seeder = Seeder(server.address, "bench")
        sessions = [
            seeder.session(args.messages, profile=args.profile, long_every=args.long_every)
            for _ in range(args.sessions)
        ]
        seeder.warm(sessions)
        seeder.close()
        call = "BuildContext" if args.call in ("turns", "stream") else args.call
        run = Run(label="profile", call=call, messages=args.messages, concurrency=args.concurrency)
        method = HEALTH if args.call == "Health" else f"{SERVICE}.{args.call}"
        data = {} if args.call == "Health" else call_data(run, sessions)
        data_file = workdir / "data.json"
        data_file.write_text(json.dumps(data))
        out = workdir / "ghz.json"
        cmd = [
            ghz, "--insecure", "--protoset", str(ps), "--call", method, "--data-file", str(data_file),
            "-c", str(args.concurrency), "--connections", "1", "--cpus", "1", "-n", "10000000",
            "-z", f"{args.seconds}s", "--max-recv-message-size", "64MB", "--format", "json", "-o", str(out),
            # At the time bound ghz closes its connection under the calls in flight, which then
            # count as UNAVAILABLE ("use of closed network connection", one per concurrent
            # caller): leave them out, as run.py does.
            "--duration-stop", "ignore", server.address,
        ]  # fmt: skip
        driven = args.call in ("turns", "stream")  # a client of drivers.py's shape, not ghz
        if args.call == "turns":  # the agent turn loop (one client process; Go's unless told otherwise)
            driver = turn_driver_binary(args.turn_driver)
            cmd = drivers_command(
                server.address, sessions, args.seconds, 1_000_000, incoming=args.incoming, turn_driver=driver
            )
        elif args.call == "stream":  # 50 watchers (``--concurrency``) of the first session, one producer
            cmd = drivers_command(server.address, sessions[:1], args.seconds, 1_000_000, kind="stream")
            cmd += ["--watchers", str(args.concurrency)]
        collapsed = args.raw or workdir / "collapsed.txt"
        before = cpu_seconds(server.pid)
        load = subprocess.Popen(cmd, stdout=subprocess.PIPE if driven else None)
        spy = None
        if not args.no_spy:
            time.sleep(1.0)
            spy_cmd = [
                "py-spy", "record", "--pid", str(server.pid), "-r", str(args.rate), "-d", str(int(args.seconds - 2)),
                "--format", "raw", "-o", str(collapsed), *(["--threads"] if args.threads else []),
                *(["--native"] if args.native else ["--nonblocking"]),
            ]  # fmt: skip
            spy = subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, _, usage = os.wait4(load.pid, 0)
        load.returncode = 0
        cpu = cpu_seconds(server.pid) - before
        if spy is not None:
            spy.wait(timeout=60)
        if driven:
            assert load.stdout is not None
            report = json.loads(load.stdout.read())
            report["statusCodeDistribution"] = report.pop("errors", {})
            print(json.dumps(report.get("latency", {k: report[k] for k in ("lost", "ordered") if k in report})))
        else:
            report = json.loads(out.read_text())
        calls = report["count"]
        client_cpu = usage.ru_utime + usage.ru_stime
        print(
            f"{args.call} on {args.store}: {calls} calls, {report['rps']:.0f} calls/s, "
            f"server CPU {1000 * cpu / max(1, calls):.3f} ms/call, "
            f"client CPU {1000 * client_cpu / max(1, calls):.3f} ms/call, "
            f"statuses {report.get('statusCodeDistribution')}"
        )
        if spy is not None and collapsed.exists():
            summarize(collapsed, args.top)
    finally:
        server.stop()
        if os.environ.get("KEEP_WORKDIR") is None:
            shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
