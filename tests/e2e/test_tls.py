"""TLS and mutual TLS over real sockets (DESIGN §5.10), with certificates made by the test.

A server with ``--tls-cert/--tls-key`` serves TLS only; with ``--tls-client-ca`` it also demands a
client certificate that CA signed. SIGHUP rereads the files: new connections get the new
certificate, and a pair that does not load leaves the old one in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
from contextsvc.config import Settings
from contextsvc.core.credentials import issue
from contextsvc.stores.token_access import token_store_at
from tests.support.certs import Authority, Pem, self_signed
from tests.support.server import ServerProcess

pytestmark = pytest.mark.e2e

CALL_S = 10.0


@dataclass
class Pki:
    folder: Path
    server_ca: Authority
    client_ca: Authority
    stranger_ca: Authority
    cert: Path
    key: Path
    client_ca_file: Path
    alice: Pem
    stranger: Pem


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    folder = tmp_path / "pki"
    server_ca, client_ca, stranger_ca = Authority("server CA"), Authority("client CA"), Authority("stranger CA")
    cert, key = server_ca.server().write(folder, "server")
    client_ca_file = folder / "clients.pem"
    client_ca_file.write_bytes(client_ca.pem)
    return Pki(
        folder=folder,
        server_ca=server_ca,
        client_ca=client_ca,
        stranger_ca=stranger_ca,
        cert=cert,
        key=key,
        client_ca_file=client_ca_file,
        alice=client_ca.client("alice-laptop"),
        stranger=stranger_ca.client("mallory"),
    )


def _token(data: Path) -> str:
    async def make() -> str:
        async with token_store_at(f"files:{data}", Settings()) as store:
            issued = issue(user="alice", is_admin=False, now=datetime.now(UTC), expire_time=None)
            await store.add_api_token(issued.record)
            return issued.secret

    return asyncio.run(make())


def _serve(tmp_path: Path, pki: Pki, *, mutual: bool, auth: str = "auto") -> Iterator[ServerProcess]:
    args = ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--auth", auth]
    if mutual:
        args += ["--tls-client-ca", str(pki.client_ca_file)]
    with ServerProcess(f"files:{tmp_path / 'data'}", extra_args=args).start() as proc:
        yield proc


def _health(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CALL_S)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def _trusting(ca: Authority, client: Pem | None = None) -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=ca.pem)
    return grpc.ssl_channel_credentials(root_certificates=ca.pem, private_key=client.key, certificate_chain=client.cert)


def test_tls_carries_tokens_and_refuses_plaintext_and_untrusted_certificates(tmp_path: Path, pki: Pki) -> None:
    token = _token(tmp_path / "data")
    for proc in _serve(tmp_path, pki, mutual=False, auth="tokens"):
        assert _health(proc.address, _trusting(pki.server_ca)) == grpc.StatusCode.OK
        assert _health(proc.address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
        assert _health(proc.address, _trusting(pki.stranger_ca)) == grpc.StatusCode.UNAVAILABLE

        with grpc.secure_channel(proc.address, _trusting(pki.server_ca)) as channel:
            stub = ContextServiceStub(channel)
            md = [("authorization", f"Bearer {token}")]
            session = stub.CreateSession(pb.CreateSessionRequest(name="over tls"), metadata=md, timeout=CALL_S)
            assert session.user_id == "alice"
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetSession(pb.GetSessionRequest(session_id=session.id), timeout=CALL_S)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert token not in proc.stderr_text


def test_mutual_tls_requires_a_client_certificate_the_ca_signed(tmp_path: Path, pki: Pki) -> None:
    for proc in _serve(tmp_path, pki, mutual=True):
        assert _health(proc.address, _trusting(pki.server_ca, pki.alice)) == grpc.StatusCode.OK
        assert _health(proc.address, _trusting(pki.server_ca)) == grpc.StatusCode.UNAVAILABLE  # no client cert
        wrong = _health(proc.address, _trusting(pki.server_ca, pki.stranger))  # signed by another CA
        assert wrong == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(proc.address, _trusting(pki.server_ca, pki.alice)) as channel:
            stub = ContextServiceStub(channel)
            assert stub.CreateSession(pb.CreateSessionRequest(name="mtls"), timeout=CALL_S).user_id == "anonymous"


def _wait_for_log(proc: ServerProcess, text: str, count: int) -> None:
    deadline = time.monotonic() + 20
    while proc.stderr_text.count(text) < count:
        assert time.monotonic() < deadline, f"no {text!r} in the log: {proc.stderr_text[-2000:]}"
        time.sleep(0.05)


def test_sighup_rereads_the_certificates_and_keeps_the_old_ones_when_the_new_do_not_load(
    tmp_path: Path, pki: Pki
) -> None:
    for proc in _serve(tmp_path, pki, mutual=False):
        assert proc.proc is not None
        assert _health(proc.address, _trusting(pki.server_ca)) == grpc.StatusCode.OK

        renewed_ca = Authority("renewed server CA")
        renewed_ca.server().write(pki.folder, "server")  # same paths, new certificate and key
        proc.proc.send_signal(signal.SIGHUP)
        _wait_for_log(proc, "certificates reloaded", 1)
        assert _health(proc.address, _trusting(renewed_ca)) == grpc.StatusCode.OK
        assert _health(proc.address, _trusting(pki.server_ca)) == grpc.StatusCode.UNAVAILABLE

        pki.key.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
        proc.proc.send_signal(signal.SIGHUP)
        _wait_for_log(proc, "certificate reload failed", 1)
        assert proc.proc.poll() is None
        assert _health(proc.address, _trusting(renewed_ca)) == grpc.StatusCode.OK


def test_an_expired_certificate_is_served_with_one_warning_naming_its_not_after(tmp_path: Path) -> None:
    pem = self_signed("old", ips=("127.0.0.1",), expired=True)
    cert, key = pem.write(tmp_path, "old")
    not_after = x509.load_pem_x509_certificate(pem.cert).not_valid_after_utc.isoformat()
    with ServerProcess("memory", extra_args=["--tls-cert", str(cert), "--tls-key", str(key)]).start() as server:
        server.terminate()  # it started: the warning was written before it listened
    warnings = [line for line in server.stderr_text.splitlines() if '"level": "warning"' in line]
    assert len(warnings) == 1 and "server certificate expired" in warnings[0], server.stderr_text
    assert json.loads(warnings[0])["not_after"] == not_after


def test_failed_handshakes_add_no_lines_of_grpcs_own_format_to_the_log(tmp_path: Path, pki: Pki) -> None:
    """Every failed TLS handshake (a plaintext client, a port scanner, a balancer's TCP check) made
    gRPC's C core write ``I1208 … ssl_transport_security.cc] Handshake failed …`` on stderr: lines
    that are not our JSON, one per connection anyone could open."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    args = ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key)]
    proc = ServerProcess("memory", extra_args=args)
    proc.env = env  # the operator's environment, without a GRPC_VERBOSITY of its own
    with proc.start():
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", proc.port), timeout=5) as raw:
                raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                raw.settimeout(5)
                with contextlib.suppress(OSError):
                    raw.recv(100)
        assert _health(proc.address, None) != grpc.StatusCode.OK  # a plaintext client, refused
        assert proc.terminate() == 0
    lines = proc.stderr_text.strip().splitlines()
    assert lines and all(line.startswith("{") for line in lines), proc.stderr_text
    for line in lines:
        json.loads(line)
