"""Which name the bundled gateway expects in its server's certificate, and the TLS settings' checks."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from pydantic import ValidationError

from contextsvc.config import GatewaySettings, Settings
from contextsvc.gateway.tls import (
    GatewayTLSError,
    ListenerTLS,
    bundled_upstream_tls,
    expected_name,
    listener_tls,
    standalone_upstream_tls,
)
from tests.support.certs import Authority, self_signed


@pytest.mark.parametrize(
    ("dns", "ips", "host", "name"),
    [
        (("localhost",), ("127.0.0.1",), "127.0.0.1", ""),  # the dialled address is named: no override
        (("localhost",), ("::1",), "[::1]", ""),
        (("ctx.example.com", "other.example.com"), (), "127.0.0.1", "ctx.example.com"),
        (("LOCALHOST",), (), "localhost", ""),
        (("*.example.com",), (), "10.0.0.1", "contextsvc.example.com"),
        ((), (), "127.0.0.1", "cn-only.example"),  # no SAN: the common name
    ],
)
def test_expected_name(dns: tuple[str, ...], ips: tuple[str, ...], host: str, name: str) -> None:
    cert = self_signed("cn-only.example", dns=dns, ips=ips).cert
    assert expected_name(cert, host) == name


def test_a_certificate_naming_only_other_addresses_needs_a_configured_name() -> None:
    with pytest.raises(GatewayTLSError, match="target_server_name"):
        expected_name(self_signed("x", dns=(), ips=("10.1.2.3",)).cert, "127.0.0.1")
    with pytest.raises(GatewayTLSError, match="not a PEM certificate"):
        expected_name(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", "127.0.0.1")


def test_bundled_tls_follows_the_server(tmp_path: Path) -> None:
    assert bundled_upstream_tls(Settings(), "127.0.0.1") is None
    cert, key = self_signed("svc", dns=("svc.internal",)).write(tmp_path, "svc")
    tls = bundled_upstream_tls(Settings(tls_cert=str(cert), tls_key=str(key)), "127.0.0.1")
    assert tls is not None and tls.ca_file == str(cert) and tls.server_name == "svc.internal"
    ca = Authority("ca")
    (tmp_path / "ca.pem").write_bytes(ca.pem)
    configured = Settings(
        tls_cert=str(cert),
        tls_key=str(key),
        gateway=GatewaySettings(target_ca=str(tmp_path / "ca.pem"), target_server_name="given.name"),
    )
    tls = bundled_upstream_tls(configured, "127.0.0.1")
    assert tls is not None and tls.ca_file == str(tmp_path / "ca.pem") and tls.server_name == "given.name"
    mutual = Settings(tls_cert=str(cert), tls_key=str(key), tls_client_ca=str(tmp_path / "ca.pem"))
    with pytest.raises(GatewayTLSError, match="target_client_cert"):
        bundled_upstream_tls(mutual, "127.0.0.1")


def test_standalone_tls_is_on_when_asked_or_implied(tmp_path: Path) -> None:
    assert standalone_upstream_tls(Settings()) is None
    assert standalone_upstream_tls(Settings(gateway=GatewaySettings(target_tls=True))) is not None
    implied = standalone_upstream_tls(Settings(gateway=GatewaySettings(target_server_name="svc")))
    assert implied is not None and implied.server_name == "svc" and implied.ca_file == ""
    with pytest.raises(GatewayTLSError, match=r"gateway\.target_ca .* cannot be read"):
        standalone_upstream_tls(Settings(gateway=GatewaySettings(target_ca=str(tmp_path / "missing.pem"))))


def test_pairs_go_together() -> None:
    with pytest.raises(ValidationError, match="target_client_cert and target_client_key"):
        GatewaySettings(target_client_cert="a.pem")
    with pytest.raises(ValidationError, match=r"gateway\.tls_cert and gateway\.tls_key"):
        GatewaySettings(tls_key="k.pem")


async def _served_certificate(context: ssl.SSLContext) -> bytes:
    """The DER certificate a TLS listener with ``context`` presents to a new connection."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        return bytes(der)
    finally:
        server.close()
        await server.wait_closed()


async def test_listener_certificate_is_reread_on_reload(tmp_path: Path) -> None:
    first, second = self_signed("first"), self_signed("second")
    cert, key = first.write(tmp_path, "gw")
    listener = ListenerTLS(str(cert), str(key))
    assert await _served_certificate(listener.context) == ssl.PEM_cert_to_DER_cert(first.cert.decode())
    second.write(tmp_path, "gw")
    assert listener.reload() is True
    assert await _served_certificate(listener.context) == ssl.PEM_cert_to_DER_cert(second.cert.decode())
    key.write_text("not a key")  # a broken pair is refused; the previous one keeps serving
    assert listener.reload() is False
    assert await _served_certificate(listener.context) == ssl.PEM_cert_to_DER_cert(second.cert.decode())
    with pytest.raises(GatewayTLSError, match="do not load as a pair"):
        ListenerTLS(str(cert), str(key))


def test_listener_tls_uses_the_servers_pair_only_when_bundled(tmp_path: Path) -> None:
    cert, key = self_signed("svc").write(tmp_path, "svc")
    served = Settings(tls_cert=str(cert), tls_key=str(key))
    assert listener_tls(Settings(), bundled=True) is None
    assert listener_tls(served, bundled=False) is None
    bundled = listener_tls(served, bundled=True)
    assert bundled is not None and bundled.cert == str(cert)
    gw_cert, gw_key = self_signed("gw").write(tmp_path, "gw")
    own = listener_tls(
        served.model_copy(update={"gateway": GatewaySettings(tls_cert=str(gw_cert), tls_key=str(gw_key))}),
        bundled=True,
    )
    assert own is not None and own.cert == str(gw_cert)


def test_target_files_that_are_not_certificates_are_refused_at_start(tmp_path: Path) -> None:
    # As the server refuses a bad tls_client_ca: in one line, before the gateway listens.
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("garbage\n")
    with pytest.raises(GatewayTLSError, match=r"gateway\.target_ca .*garbage\.pem holds no usable CA certificate"):
        standalone_upstream_tls(Settings(gateway=GatewaySettings(target_ca=str(garbage))))
    cert, _ = self_signed("svc").write(tmp_path, "svc")
    _, other_key = self_signed("other").write(tmp_path, "other")
    mismatched = GatewaySettings(target_client_cert=str(cert), target_client_key=str(other_key))
    with pytest.raises(GatewayTLSError, match="do not load as a pair"):
        standalone_upstream_tls(Settings(gateway=mismatched))
    server_cert, server_key = self_signed("server").write(tmp_path, "server")
    bundled = Settings(
        tls_cert=str(server_cert), tls_key=str(server_key), gateway=GatewaySettings(target_ca=str(garbage))
    )
    with pytest.raises(GatewayTLSError, match="holds no usable CA certificate"):
        bundled_upstream_tls(bundled, "127.0.0.1")
