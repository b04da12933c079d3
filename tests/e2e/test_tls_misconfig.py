"""TLS files that do not work are a configuration error in every command that serves (issue: the
server exited 2 on them, a standalone or bundled gateway 1): exit 2, one line
``contextsvc: <setting> <file> <what is wrong>``, before anything listens."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.certs import self_signed
from tests.unit.test_tokens_cli import cli

_run = cli  # ``contextsvc`` as a subprocess, its output captured


SERVE = ("serve", "--listen", "127.0.0.1:0", "--store", "memory")
GATEWAY = ("gateway", "--listen", "127.0.0.1:0", "--target", "127.0.0.1:1")


def _files(tmp_path: Path) -> dict[str, str]:
    cert, key = self_signed("one").write(tmp_path, "one")
    _, other_key = self_signed("other").write(tmp_path, "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("garbage\n")
    return {
        "cert": str(cert),
        "key": str(key),
        "other_key": str(other_key),
        "garbage": str(garbage),
        "missing": str(tmp_path / "missing.pem"),
    }


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        # The server's own pair.
        ((*SERVE, "--tls-cert", "{missing}", "--tls-key", "{key}"), {}, "tls_cert {missing} cannot be read: "),
        (
            (*SERVE, "--tls-cert", "{cert}", "--tls-key", "{other_key}"),
            {},
            "tls_cert {cert} and tls_key {other_key} do not load as a pair: ",
        ),
        (
            (*SERVE, "--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-client-ca", "{garbage}"),
            {},
            "tls_client_ca {garbage} holds no usable CA certificate: ",
        ),
        # A bundled gateway's own listener pair.
        (
            (*SERVE, "--gateway", "127.0.0.1:0"),
            {"CONTEXTSVC_GATEWAY__TLS_CERT": "{missing}", "CONTEXTSVC_GATEWAY__TLS_KEY": "{key}"},
            "gateway.tls_cert {missing} cannot be read: ",
        ),
        (
            (*SERVE, "--gateway", "127.0.0.1:0"),
            {"CONTEXTSVC_GATEWAY__TLS_CERT": "{cert}", "CONTEXTSVC_GATEWAY__TLS_KEY": "{other_key}"},
            "gateway.tls_cert {cert} and gateway.tls_key {other_key} do not load as a pair: ",
        ),
        # A standalone gateway: its listener, and the CA it trusts for the service.
        (
            (*GATEWAY, "--tls-cert", "{missing}", "--tls-key", "{key}"),
            {},
            "gateway.tls_cert {missing} cannot be read: ",
        ),
        (
            (*GATEWAY, "--tls-cert", "{cert}", "--tls-key", "{missing}"),
            {},
            "gateway.tls_key {missing} cannot be read: ",
        ),
        (
            (*GATEWAY, "--tls-cert", "{cert}", "--tls-key", "{other_key}"),
            {},
            "gateway.tls_cert {cert} and gateway.tls_key {other_key} do not load as a pair: ",
        ),
        ((*GATEWAY, "--target-ca", "{garbage}"), {}, "gateway.target_ca {garbage} holds no usable CA certificate: "),
        ((*GATEWAY, "--target-ca", "{missing}"), {}, "gateway.target_ca {missing} cannot be read: "),
    ],
)
def test_tls_files_that_do_not_work_exit_2_in_one_line_in_serve_and_gateway(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], expected: str
) -> None:
    files = _files(tmp_path)
    done = _run(*(a.format(**files) for a in args), env={k: v.format(**files) for k, v in env.items()})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("contextsvc: " + expected.format(**files)), done.stderr
    assert "listening on" not in done.stdout and "Traceback" not in done.stderr


def test_a_standalone_gateway_ignores_the_servers_listen_and_tls_settings(tmp_path: Path) -> None:
    """The image sets CONTEXTSVC_LISTEN=0.0.0.0:50051 for the server; ``contextsvc gateway`` run
    from it (or beside a server sharing its environment, TLS files included) was refused with
    "refusing to listen on 0.0.0.0:50051 without TLS", a line about a server it does not run."""
    env = {
        **os.environ,
        "CONTEXTSVC_LISTEN": "0.0.0.0:50051",
        "CONTEXTSVC_TLS_CERT": str(tmp_path / "server-only.crt"),
        "CONTEXTSVC_TLS_KEY": str(tmp_path / "server-only.key"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "contextsvc", "gateway", "--listen", "127.0.0.1:0", "--target", "127.0.0.1:1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)  # bounded: a hung start fails here
        line = proc.stdout.readline() if ready else ""  # the announcement, or "" when it exited
        assert line.startswith("contextsvc gateway listening on http://127.0.0.1:"), proc.stderr.read()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 0
