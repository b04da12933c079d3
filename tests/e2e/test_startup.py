"""Start-up failures (issue 13, item 7).

A store that cannot be reached at start is transient: the server listens, health says NOT_SERVING,
ContextService calls get UNAVAILABLE (STORE_NOT_READY) with a retry delay, and it turns SERVING
by itself once the store answers. With ``store_start_timeout_seconds`` it gives up: one line,
exit 1. A store that is misconfigured is one line and exit 1 at once. Never a traceback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contextsvc._gen.v1 import context_service_pb2 as pb
from tests.support.postgres import PgCluster, postgres_dsn, with_database
from tests.support.rpc import error_details
from tests.support.server import ServerProcess


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(channel: grpc.Channel, service: str = "") -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(reply.status)


LIVENESS = "contextsvc.liveness"

__all__ = ["postgres_dsn"]


def test_unreachable_postgres_serves_not_serving_then_serving_when_it_answers() -> None:
    cluster = PgCluster.create()
    try:
        url = cluster.start()
        cluster.stop()  # the port is now closed; the cluster comes back on the same port below
        server = ServerProcess(url, env={"CONTEXTSVC_STORE_RETRY_MAX_SECONDS": "0.5"}).start()
        try:
            with server.channel() as ch:
                assert _health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
                # The process is alive all along: liveness and startup probes must not restart it.
                assert _health(ch, LIVENESS) == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.RpcError) as caught:
                    server.stub(ch).CreateSession(pb.CreateSessionRequest(name="early"), timeout=5)
                details = error_details(caught.value)
                assert details["code"] == grpc.StatusCode.UNAVAILABLE
                assert details["reason"] == "STORE_NOT_READY"

                cluster.start()
                deadline = time.monotonic() + 30
                while _health(ch) != health_pb2.HealthCheckResponse.SERVING:
                    assert time.monotonic() < deadline, server.stderr_text[-2000:]
                    time.sleep(0.2)
                sid = server.stub(ch).CreateSession(pb.CreateSessionRequest(name="late"), timeout=10).id
                assert server.stub(ch).GetSession(pb.GetSessionRequest(session_id=sid), timeout=10).name == "late"

                # The database going away while serving: NOT_SERVING (a balancer's readiness probe
                # takes the replica out), and SERVING again once it answers.
                cluster.stop()
                deadline = time.monotonic() + 30
                while _health(ch) != health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() < deadline, server.stderr_text[-2000:]
                    time.sleep(0.2)
                assert _health(ch, LIVENESS) == health_pb2.HealthCheckResponse.SERVING
                cluster.start()
                deadline = time.monotonic() + 30
                while _health(ch) != health_pb2.HealthCheckResponse.SERVING:
                    assert time.monotonic() < deadline, server.stderr_text[-2000:]
                    time.sleep(0.2)
                assert server.stub(ch).GetSession(pb.GetSessionRequest(session_id=sid), timeout=10).name == "late"
            assert server.terminate() == 0
        finally:
            server.kill()
        log = server.stderr_text
        assert "Traceback" not in log
        assert '"event": "store not reachable; serving NOT_SERVING until it answers"' in log
        assert '"event": "store reachable; SERVING"' in log
        assert '"event": "store cannot write: health NOT_SERVING"' in log
    finally:
        cluster.remove()


def _serve(store: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "contextsvc", "serve", "--listen", "127.0.0.1:0", "--store", store],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        check=False,
    )


def test_store_that_never_answers_within_the_start_timeout_is_one_line_and_exit_1(tmp_path: Path) -> None:
    # The URL's password (from a secret, in a deployment) never reaches stdout or a log line.
    url = f"postgresql://postgres:s3cretPW@127.0.0.1:{_closed_port()}/postgres?password=alsoSecret"
    done = _serve(url, tmp_path, CONTEXTSVC_STORE_START_TIMEOUT_SECONDS="1", CONTEXTSVC_STORE_RETRY_MAX_SECONDS="0.3")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    # One line naming the store (without its password), the setting and the last cause.
    named = url.replace("s3cretPW", "***").replace("alsoSecret", "***")
    assert last.startswith(
        f"contextsvc: the store {named} did not answer within 1 s (store_start_timeout_seconds): "
        "PostgreSQL unavailable: "
    ), done.stderr
    assert "listening on" in done.stdout and "postgres:***@" in done.stdout + done.stderr
    assert "s3cretPW" not in done.stdout + done.stderr and "alsoSecret" not in done.stdout + done.stderr
    # The first warning says when the start will end, so an operator reading it knows the wait is bounded.
    first = next(json.loads(line) for line in done.stderr.splitlines() if "serving NOT_SERVING until" in line)
    assert first["gives_up_after_seconds"] == 1


@pytest.mark.parametrize(
    ("store", "expected"),
    [
        ("nosuch://x", "unknown store URL"),
        ("files:{tmp}/a-file/data", "cannot open the store"),
        # A mistyped scheme still holds a real password: the one line names the URL without it.
        ("postgresql+asyncpg://app:hunter2@db/x", "unknown store URL 'postgresql+asyncpg://app:***@db/x'"),
        # A URL the driver refuses to use is no outage: retrying it would wait NOT_SERVING for ever.
        ("postgresql://app:hunter2@127.0.0.1:1/x?sslmode=bogus", "the PostgreSQL URL is not usable: `sslmode`"),
    ],
)
def test_misconfigured_store_is_one_line_and_exit_1(tmp_path: Path, store: str, expected: str) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    done = _serve(store.format(tmp=tmp_path), tmp_path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("contextsvc: ") and expected in lines[0], done.stderr
    assert "hunter2" not in done.stderr + done.stdout


@pytest.mark.parametrize(
    ("misplaced", "expected"),
    [
        # A file where the store keeps a folder: not "[Errno 17] File exists".
        ("blobs", "blobs is a file where a directory is expected"),
        ("sessions", "sessions is a file where a directory is expected"),
        # A folder where the store keeps a file (a session's log, its mark, the lock).
        ("sessions/0b6f1d2e-3c4a-4b5c-8d6e-7f8091a2b3c4.jsonl", ".jsonl is a directory where a file is expected"),
        ("lock", "lock is a directory where a file is expected"),
    ],
)
def test_a_data_directory_holding_the_wrong_kind_of_entry_names_it(
    tmp_path: Path, misplaced: str, expected: str
) -> None:
    data = tmp_path / "data"
    (data / "sessions").mkdir(parents=True)
    path = data / misplaced
    if path.exists():
        path.rmdir()
    if misplaced in ("blobs", "sessions"):
        path.write_text("not a directory")
    else:
        path.mkdir()
    done = _serve(f"files:{data}", tmp_path)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("contextsvc: cannot open the store") and expected in last, done.stderr
    assert str(path) in last and "Traceback" not in done.stderr


def test_a_mistyped_token_store_is_one_line_and_exit_1(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "contextsvc",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            "memory",
            "--auth",
            "tokens",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CONTEXTSVC_AUTH__TOKEN_STORE": "postgresql+asyncpg://app:hunter2@db/x"},
        check=False,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("contextsvc: auth.token_store: unknown store URL"), done.stderr
    assert "hunter2" not in done.stderr + done.stdout and "Traceback" not in done.stderr


def test_an_unreadable_tokenizer_file_is_one_line_and_exit_1(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent.json"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[tokens.tokenizer_files]\n"gpt-4o" = "{missing}"\n')
    done = _serve("memory", tmp_path, CONTEXTSVC_CONFIG=str(cfg))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert (
        lines[0] == f"contextsvc: tokens.tokenizer_files['gpt-4o']: {missing} cannot be read: No such file or directory"
    )
    assert "listening on" not in done.stdout


def test_a_bundled_gateway_port_in_use_is_one_line_before_the_server_says_it_listens(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        serve = ["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--gateway", f"127.0.0.1:{port}"]
        done = subprocess.run(
            [sys.executable, "-m", "contextsvc", *serve],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 1
    assert "listening on" not in done.stdout, done.stdout
    lines = done.stderr.strip().splitlines()
    assert lines == [f"contextsvc: cannot listen on 127.0.0.1:{port} (gateway): Address already in use"], done.stderr


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # Taken for OTLP over HTTP to the default endpoint, in silence.
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER: unknown exporter 'jaeger'"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "gprc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL: unknown protocol 'gprc'",
        ),
        # These three were a traceback.
        (
            {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "metrics"},
            "OTEL_EXPORTER_PROMETHEUS_PORT: must be a port number, got 'metrics'",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "console", "OTEL_PROPAGATORS": "tracecontext,b3multi-typo"},
            "OTEL_PROPAGATORS: Propagator b3multi-typo not found",
        ),
        # ... and this one "[Errno 98] Address already in use", naming nothing.
        (
            {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1"},
            "cannot listen on 127.0.0.1:{port} for the Prometheus scrape endpoint",
        ),
    ],
)
def test_an_otel_variable_nothing_can_take_is_one_line_naming_it_and_exit_1(
    tmp_path: Path, env: dict[str, str], expected: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**env, "OTEL_EXPORTER_PROMETHEUS_PORT": env.get("OTEL_EXPORTER_PROMETHEUS_PORT", str(port))}
        clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "contextsvc", "serve", "--listen", "127.0.0.1:0", "--store", "memory"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**clean, **env},
        )
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the server started: {err[-1000:]}")
    assert proc.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("contextsvc: telemetry: "), err
    assert expected.format(port=port) in lines[0], err
    assert "listening on" not in out


def test_a_tokenizer_file_that_is_no_tokenizer_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """Readable but not a tokenizer.json: the server started SERVING and every call of the model
    was FAILED_PRECONDITION (TOKENIZER_UNAVAILABLE) until an operator read the log."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    garbage = tmp_path / "tokenizer.json"
    garbage.write_text('{"model": "not a tokenizer"}')
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[tokens.tokenizer_files]\n"gpt-4o" = "{garbage}"\n')
    done = _serve("memory", tmp_path, CONTEXTSVC_CONFIG=str(cfg))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"contextsvc: tokens.tokenizer_files['gpt-4o']: {garbage} is not a tokenizer.json: ")
    assert "listening on" not in done.stdout

    # A real one still starts (and is the one the first count uses).
    Tokenizer(WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")).save(str(garbage))
    proc = ServerProcess("memory", env={"CONTEXTSVC_CONFIG": str(cfg)}).start()
    assert proc.terminate() == 0


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("bogus_param=1", 'unrecognized configuration parameter "bogus_param" (SQLSTATE 42704)'),
        ("statement_timeout=soon", 'invalid value for parameter "statement_timeout": "soon" (SQLSTATE 22023)'),
    ],
)
def test_a_postgres_url_the_server_refuses_is_one_line_saying_why(
    tmp_path: Path, postgres_dsn: str, query: str, expected: str
) -> None:
    """A server parameter in the URL that PostgreSQL refuses at connect: the start stopped with a
    log line carrying a traceback and "store error (42704)", which says nothing of the URL."""
    url = postgres_dsn + ("&" if "?" in postgres_dsn else "?") + query
    done = _serve(url, tmp_path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("contextsvc: cannot open the store "), done.stderr
    assert f"PostgreSQL refused to open the store: {expected}" in lines[0], done.stderr
    assert "listening on" not in done.stdout


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_grpc_port_in_use_is_one_line_and_nothing_from_grpcs_core(tmp_path: Path, host: str) -> None:
    """gRPC's C core printed its own line (``E1208 ... add_port.cc:83] Failed to add port ...``,
    not one of our JSON lines) before ours, which said only "Failed to bind ...; set
    GRPC_VERBOSITY=debug"."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        listen = f"{host}:{port}"
        done = subprocess.run(
            [sys.executable, "-m", "contextsvc", "serve", "--listen", listen, "--store", "memory", "--insecure"],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"},
            check=False,
        )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"contextsvc: cannot listen on {listen}: Address already in use"]
    assert "listening on" not in done.stdout


def test_an_address_that_is_not_this_hosts_is_one_line(tmp_path: Path) -> None:
    listen = "nosuchhost.invalid:5000"
    done = subprocess.run(
        [sys.executable, "-m", "contextsvc", "serve", "--listen", listen, "--store", "memory", "--insecure"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"contextsvc: cannot listen on {listen}: "), done.stderr
    assert "does not resolve" in lines[0]


@pytest.mark.parametrize(
    ("database", "user", "expected"),
    [
        ("no_such_database", None, 'database "no_such_database" does not exist (SQLSTATE 3D000)'),
        ("postgres", "no_such_role", 'role "no_such_role" does not exist (SQLSTATE 28000)'),
    ],
)
def test_a_database_or_role_that_does_not_exist_is_one_line_at_once(
    tmp_path: Path, postgres_dsn: str, database: str, user: str | None, expected: str
) -> None:
    """A running server that answers "no such database" (or role) was taken for an outage: the
    start listened NOT_SERVING and retried for ever. No retry mends it: one line naming the URL
    (without its password) and PostgreSQL's answer, exit 1, before listening."""
    url = with_database(postgres_dsn, database, user=user)
    parts = url.split("://", 1)
    user_part, _, host = parts[1].partition("@")
    url = f"{parts[0]}://{user_part.split(':')[0]}:pw-s3cret@{host}"
    started = time.monotonic()
    done = _serve(url, tmp_path, CONTEXTSVC_STORE_START_TIMEOUT_SECONDS="0")  # 0: it would wait for ever
    assert time.monotonic() - started < 30
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    named = url.replace("pw-s3cret", "***")
    assert len(lines) == 1, done.stderr
    assert lines[0] == f"contextsvc: cannot open the store {named}: PostgreSQL refused to open the store: {expected}"
    assert "listening on" not in done.stdout and "pw-s3cret" not in done.stdout + done.stderr


def test_a_store_that_never_answers_gives_up_by_default() -> None:
    """The default bound: without store_start_timeout_seconds set, a start kept retrying for ever."""
    from contextsvc.config import Settings

    assert 0 < Settings().store_start_timeout_seconds <= 600


def test_files_store_settings_given_to_another_store_are_one_warning(tmp_path: Path) -> None:
    """``--durability batch`` (or ``[files]`` settings) on a memory or PostgreSQL store were ignored
    in silence: an operator took the durability for set."""
    proc = ServerProcess(
        "memory", extra_args=["--durability", "batch"], env={"CONTEXTSVC_FILES__CACHE_MB": "10"}
    ).start()
    assert proc.terminate() == 0
    lines = [json.loads(line) for line in proc.stderr_text.splitlines() if "files store given" in line]
    assert len(lines) == 1 and lines[0]["settings"] == ["durability", "files"], proc.stderr_text
    quiet = ServerProcess(f"files:{tmp_path / 'data'}", extra_args=["--durability", "batch"]).start()
    assert quiet.terminate() == 0
    assert "files store given" not in quiet.stderr_text
