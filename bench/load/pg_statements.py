"""Where PostgreSQL's own time goes in the served agent turn loop, statement by statement.

    python bench/load/pg_statements.py                          # 50 agents, default profile, 15 s
    python bench/load/pg_statements.py --seconds 40             # long enough for every session to compact
    python bench/load/pg_statements.py --profile bench --top 12

Starts a private cluster with ``pg_stat_statements`` loaded (planning tracked too), one
``contextsvc serve`` on it configured as ``run.py`` configures it, seeds ``--sessions`` sessions,
and runs the turn loop's driver (the Go one when ``go`` is on PATH) for ``--seconds``. Prints
turns/s, the server's and PostgreSQL's CPU per turn (``run.database_cpu_seconds``), then per
statement: calls, time running, time planning and how many plans were made (a statement
planned at nearly every call pays its planning every time), and per call the rows it returned or
changed, the WAL it wrote and the shared buffers it touched. Then the tables' inserts, updates
(HOT among them) and sizes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401 - this checkout's contextsvc
from run import SERVER_CONFIG, cpu_seconds, database_cpu_seconds, drivers_command, turn_driver_binary
from workload import Seeder

from tests.support.postgres import PgCluster, query
from tests.support.server import ServerProcess

STATEMENTS = """
SELECT calls, total_exec_time, total_plan_time, plans, rows, wal_bytes, shared_blks_hit + shared_blks_read AS blocks,
       regexp_replace(query, '\\s+', ' ', 'g') AS query
  FROM pg_stat_statements
 WHERE query NOT LIKE '%pg_stat_statements%'
 ORDER BY total_exec_time + total_plan_time DESC
 LIMIT $1"""

TABLES = """
SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, pg_total_relation_size(relid) AS bytes
  FROM pg_stat_user_tables WHERE n_tup_ins + n_tup_upd + n_tup_del > 0 ORDER BY relname"""


def _with_statements(cluster: PgCluster) -> str:
    """Start ``cluster`` with pg_stat_statements loaded (a restart: it must be preloaded)."""
    url = cluster.start()
    query(url, "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
    cluster.stop()
    url = cluster.start()
    # Known only once the library is loaded; connections opened after the reload plan with it.
    query(url, "ALTER SYSTEM SET pg_stat_statements.track_planning = on")
    query(url, "SELECT pg_reload_conf()")
    query(url, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    return url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--messages", type=int, default=40)
    parser.add_argument("--profile", default="default", help="the seeded sessions' profile (run.py SERVER_CONFIG)")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--incoming", action="store_true", help="the user message goes with BuildContext")
    parser.add_argument("--turn-driver", choices=["auto", "go", "python"], default="auto")
    parser.add_argument("--top", type=int, default=20, help="statements shown")
    parser.add_argument("--width", type=int, default=110, help="characters of each statement shown")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="ctxpgstat-"))
    cluster = PgCluster.create()
    server: ServerProcess | None = None
    try:
        url = _with_statements(cluster)
        config = workdir / "settings.toml"
        config.write_text(SERVER_CONFIG)
        server = ServerProcess(url, extra_args=["--config", str(config), "--log-level", "WARNING"]).start()
        assert server.proc is not None
        seeder = Seeder(server.address, "bench")
        sessions = [seeder.session(args.messages, profile=args.profile) for _ in range(args.sessions)]
        seeder.warm(sessions)
        seeder.close()
        query(url, "SELECT pg_stat_statements_reset()")
        driver = turn_driver_binary(args.turn_driver)
        cmd = drivers_command(
            server.address, sessions, args.seconds, 10_000_000, incoming=args.incoming, turn_driver=driver
        )
        server_before, database_before, began = cpu_seconds(server.proc.pid), database_cpu_seconds(cluster), time.time()
        done = subprocess.run(cmd, check=True, timeout=args.seconds + 120, capture_output=True, text=True)
        server_cpu = cpu_seconds(server.proc.pid) - server_before
        database_cpu = (database_cpu_seconds(cluster) or 0.0) - (database_before or 0.0)
        turns = max(1, json.loads(done.stdout)["count"])
        print(
            f"{turns} turns, {turns / (time.time() - began):.0f}/s; CPU ms per turn: server "
            f"{1000 * server_cpu / turns:.2f}, PostgreSQL {1000 * database_cpu / turns:.2f}\n"
        )
        print(
            "| calls | running ms | planning ms | plans | µs a turn | rows a call | WAL bytes a call | buffers a call "
            "| statement |\n|---|---|---|---|---|---|---|---|---|"
        )
        for r in query(url, STATEMENTS, args.top):
            calls = max(1, r["calls"])
            print(
                f"| {r['calls']} | {r['total_exec_time']:.0f} | {r['total_plan_time']:.0f} | {r['plans']} "
                f"| {1000 * (r['total_exec_time'] + r['total_plan_time']) / turns:.1f} "
                f"| {r['rows'] / calls:.1f} | {int(r['wal_bytes']) // calls} | {r['blocks'] // calls} "
                f"| `{r['query'][: args.width]}` |"
            )
        print("\n| table | inserts | updates | of which HOT | deletes | size (kB) |\n|---|---|---|---|---|---|")
        for r in query(url, TABLES):
            print(
                f"| {r['relname']} | {r['n_tup_ins']} | {r['n_tup_upd']} | {r['n_tup_hot_upd']} "
                f"| {r['n_tup_del']} | {r['bytes'] // 1024} |"
            )
    finally:
        if server is not None:
            server.terminate()
        cluster.remove()
        shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
