"""The gateway with TLS on both sides, against real processes (docs/websocket.md "TLS").

- ``serve --tls-cert … --tls-key … --gateway``: the bundled gateway reaches its own TLS server (it
  trusts the server's certificate and expects a name the certificate carries) and serves https/wss
  with the same pair; a browser-protocol client gets ``session_sync`` and live events over wss.
- ``contextsvc gateway --target-ca … --target …`` in front of a TLS server, with a plaintext listener;
  without the CA (or with a wrong expected name) the service is unreachable and sockets close 1013.
- A server requiring client certificates: the bundled gateway presents the one its settings name,
  and refuses to start, in one line, without one.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.asyncio.client import ClientConnection, connect

from contextsvc.client import ContextClient, TLSOptions
from tests.support.certs import Authority, self_signed
from tests.support.gateway import Process, recv, recv_type

pytestmark = pytest.mark.e2e

NAME = "contextsvc.test"  # the only name in the bundled server's certificate: not the address it dials


async def close_code(ws: ClientConnection, wait: float = 20.0) -> int | None:
    try:
        while True:
            await asyncio.wait_for(ws.recv(), wait)
    except Exception:
        pass
    return ws.close_code


def trusting(cert: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(cert))
    return context


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Process, Path]]:
    folder = tmp_path_factory.mktemp("pki")
    cert, key = self_signed(NAME, dns=(NAME,)).write(folder, "server")
    proc = Process(
        [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            "memory",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--gateway",
            "127.0.0.1:0",
        ]
    ).start()
    try:
        yield proc, cert
    finally:
        proc.kill()


async def test_bundled_gateway_over_tls_serves_wss_with_sync_and_live_events(
    bundled: tuple[Process, Path],
) -> None:
    proc, cert = bundled
    assert proc.gateway_scheme == "https"
    tls = TLSOptions(root_certificates=cert.read_bytes(), server_name=NAME)
    async with ContextClient(proc.grpc_address, tls=tls, timeout=10) as client:
        sid = (await client.create_session(name="over tls"))["id"]
        url = proc.ws_url(sid)
        assert url.startswith("wss://")
        async with connect(url, ssl=trusting(cert), server_hostname=NAME) as ws:
            sync = await recv(ws)
            assert sync["type"] == "session_sync" and sync["session"]["name"] == "over tls"
            await client.append_messages(sid, [{"role": "user", "content": "from grpc"}])
            live = await recv_type(ws, "messages_appended")
            assert live["sequence_numbers"] == [1] and live["event_id"] > 0
            await ws.send(json.dumps({"type": "message", "content": "from the browser", "id": "m"}))
            ack = await recv_type(ws, "message_ack")
            assert ack["id"] == "m" and ack["sequence_numbers"] == [2]
        stored = await client.list_messages(sid)
        assert [m["content"] for m in stored["messages"]] == ["from grpc", "from the browser"]


async def test_bundled_tls_gateway_serves_the_page_over_https_only(bundled: tuple[Process, Path]) -> None:
    proc, cert = bundled

    def get(url: str, context: ssl.SSLContext | None) -> int:
        with urllib.request.urlopen(url, timeout=10, context=context) as resp:
            return int(resp.status)

    context = trusting(cert)
    context.check_hostname = False  # urllib cannot send another SNI name; the chain is still checked
    assert await asyncio.to_thread(get, f"{proc.http_url}/healthz", context) == 200
    with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP to a TLS port
        await asyncio.to_thread(get, f"http://{proc.gateway_address}/healthz", None)
    with pytest.raises(ssl.SSLError):  # a client that does not trust the certificate is refused
        async with connect(proc.ws_url("x"), ssl=ssl.create_default_context(), server_hostname=NAME):
            pass


@pytest.fixture
def tls_service(tmp_path: Path) -> Iterator[tuple[Process, Path, Authority]]:
    ca = Authority("service CA")
    cert, key = ca.server().write(tmp_path, "server")  # names localhost, 127.0.0.1, ::1
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca.pem)
    service = Process(
        ["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--tls-cert", str(cert), "--tls-key", str(key)]
    ).start()
    try:
        yield service, ca_file, ca
    finally:
        service.kill()


async def test_standalone_gateway_calls_a_tls_service_with_its_ca(tls_service: tuple[Process, Path, Authority]) -> None:
    service, ca_file, ca = tls_service
    gateway = Process(
        ["gateway", "--listen", "127.0.0.1:0", "--target", service.grpc_address, "--target-ca", str(ca_file)]
    ).start()
    # The same service through a gateway that does not speak TLS to it, and one expecting another name.
    plaintext = Process(["gateway", "--listen", "127.0.0.1:0", "--target", service.grpc_address]).start()
    wrong_name = Process(
        [
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--target",
            service.grpc_address,
            "--target-ca",
            str(ca_file),
            "--target-server-name",
            "somebody-else.test",
        ],
        env={"CONTEXTSVC_GATEWAY__UPSTREAM_MAX_ATTEMPTS": "1"},
    ).start()
    try:
        assert gateway.gateway_scheme == "http"  # its own listener is plaintext: no --tls-cert
        async with ContextClient(service.grpc_address, tls=TLSOptions(root_certificates=ca.pem), timeout=10) as c:
            sid = (await c.create_session(name="behind tls"))["id"]
            async with connect(gateway.ws_url(sid)) as ws:
                sync = await recv(ws)
                assert sync["type"] == "session_sync" and sync["session"]["name"] == "behind tls"
                await c.append_messages(sid, [{"role": "user", "content": "hello"}])
                assert (await recv_type(ws, "messages_appended"))["sequence_numbers"] == [1]
        for broken in (plaintext, wrong_name):
            async with connect(broken.ws_url(sid)) as ws:
                assert await close_code(ws) == 1013
            assert "service unreachable" in broken.stderr_text  # the operator sees why
    finally:
        for proc in (gateway, plaintext, wrong_name):
            proc.kill()


def test_bundled_gateway_with_mutual_tls_presents_its_client_certificate(tmp_path: Path) -> None:
    server_ca, client_ca = Authority("server CA"), Authority("client CA")
    cert, key = server_ca.server().write(tmp_path, "server")
    gw_cert, gw_key = client_ca.client("gateway").write(tmp_path, "gateway")
    clients = tmp_path / "clients.pem"
    clients.write_bytes(client_ca.pem)
    ca_file = tmp_path / "server-ca.pem"
    ca_file.write_bytes(server_ca.pem)
    args = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--store",
        "memory",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--tls-client-ca",
        str(clients),
        "--gateway",
        "127.0.0.1:0",
    ]
    refused = subprocess.run(
        [sys.executable, "-m", "contextsvc", *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert refused.returncode == 2 and "gateway.target_client_cert" in refused.stderr
    # Refused before the server listened: one line, no port announced, no shutdown.
    assert "listening on" not in refused.stdout and "grace period" not in refused.stderr
    assert refused.stderr.strip().count("\n") == 0, refused.stderr

    proc = Process(
        args,
        env={
            "CONTEXTSVC_GATEWAY__TARGET_CA": str(ca_file),
            "CONTEXTSVC_GATEWAY__TARGET_CLIENT_CERT": str(gw_cert),
            "CONTEXTSVC_GATEWAY__TARGET_CLIENT_KEY": str(gw_key),
        },
    ).start()
    try:
        alice = client_ca.client("alice")
        tls = TLSOptions(root_certificates=server_ca.pem, certificate_chain=alice.cert, private_key=alice.key)

        async def check() -> None:
            async with ContextClient(proc.grpc_address, tls=tls, timeout=10) as c:
                sid = (await c.create_session(name="mutual"))["id"]
            context = ssl.create_default_context(cafile=str(ca_file))
            async with connect(proc.ws_url(sid), ssl=context) as ws:
                sync = await recv(ws)
                assert sync["type"] == "session_sync" and sync["session"]["name"] == "mutual"

        asyncio.run(check())
    finally:
        proc.kill()
