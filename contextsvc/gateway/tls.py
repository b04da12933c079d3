"""TLS on both sides of the gateway: to the service it calls, and on its own listener (https/wss).

To the service:
- the standalone gateway (``contextsvc gateway --target``) uses TLS when ``gateway.target_tls`` is
  on or any ``gateway.target_*`` file or name is set: it trusts ``target_ca`` (else the system
  roots), expects ``target_server_name`` in the certificate (else the target's host), and presents
  ``target_client_cert``/``target_client_key`` to a service requiring mutual TLS;
- the bundled gateway (``serve --gateway``) follows its own server: when the server serves TLS it
  trusts ``target_ca`` or else the server's own certificate (a self-signed one works, and so does a
  chain, since a trusted leaf is accepted as it is), and expects ``target_server_name`` or else a
  name the certificate carries (the dialled address when the certificate names it, otherwise its
  first DNS name): the bundled gateway dials its server's listen address, which a certificate made
  for a DNS name does not list.

The listener serves TLS with ``gateway.tls_cert``/``gateway.tls_key``; a bundled gateway whose
server serves TLS uses the server's pair when those are empty. SIGHUP rereads the files.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
from pathlib import Path

from contextsvc.config import Settings
from contextsvc.gateway.upstream import UpstreamTLS
from contextsvc.transport import TransportError, ssl_problem

log = logging.getLogger(__name__)


class GatewayTLSError(TransportError):
    """TLS settings of the gateway that cannot work; the message is one line, for the CLI. A
    configuration error, as the server's own ``TransportError``: ``serve`` and ``gateway`` both
    exit 2 on it, as on any other refused setting."""


def certificate_names(pem: bytes) -> tuple[list[str], list[str]]:
    """DNS names and IP addresses a PEM certificate (the first of a chain) is valid for: its
    subjectAltName entries, or its common name when it has none."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise GatewayTLSError(f"not a PEM certificate: {exc}") from None
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        common = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        return ([str(common[0].value)] if common else []), []
    dns = [str(n) for n in san.get_values_for_type(x509.DNSName)]
    ips = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    return dns, ips


def _strip(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def expected_name(pem: bytes, host: str) -> str:
    """The name to check the server's certificate against when dialling ``host``: empty (the host
    itself) when the certificate names it, else a DNS name the certificate carries."""
    dns, ips = certificate_names(pem)
    host = _strip(host)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host.lower() in (d.lower() for d in dns):
            return ""
    else:
        if any(ipaddress.ip_address(ip) == address for ip in ips):
            return ""
    for name in dns:
        if not name.startswith("*."):
            return name
    for name in dns:
        return "contextsvc" + name[1:]  # any name under the wildcard matches it
    raise GatewayTLSError(
        f"the server's certificate names neither {host} nor any DNS name; set gateway.target_server_name"
    )


def _check_file(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise GatewayTLSError(f"{setting} {path} cannot be read: {exc.strerror or exc}") from None


def _check_ca(path: str, setting: str) -> None:
    """The file holds a CA certificate ssl can use (checked at start, as the server checks its
    ``tls_client_ca``: gRPC would only find out at the first call)."""
    _check_file(path, setting)
    if problem := ssl_problem(ca=path):
        raise GatewayTLSError(f"{setting} {path} holds no usable CA certificate: {problem}")


def _check_client_pair(cert: str, key: str) -> None:
    _check_file(cert, "gateway.target_client_cert")
    _check_file(key, "gateway.target_client_key")
    if problem := ssl_problem(cert=cert, key=key):
        raise GatewayTLSError(
            f"gateway.target_client_cert {cert} and gateway.target_client_key {key} do not load as a pair: {problem}"
        )


def standalone_upstream_tls(settings: Settings) -> UpstreamTLS | None:
    """TLS to ``gateway.target`` for ``contextsvc gateway``, or None for plaintext."""
    gs = settings.gateway
    if not gs.upstream_tls:
        return None
    if gs.target_ca:
        _check_ca(gs.target_ca, "gateway.target_ca")
    if gs.target_client_cert:  # and its key: the settings hold both or neither
        _check_client_pair(gs.target_client_cert, gs.target_client_key)
    return UpstreamTLS(
        ca_file=gs.target_ca,
        client_cert=gs.target_client_cert,
        client_key=gs.target_client_key,
        server_name=gs.target_server_name,
    )


def bundled_upstream_tls(settings: Settings, host: str) -> UpstreamTLS | None:
    """TLS for the bundled gateway calling its own server at ``host`` (None: the server is plaintext)."""
    if not settings.tls_cert:
        return None
    gs = settings.gateway
    if settings.tls_client_ca and not gs.target_client_cert:
        raise GatewayTLSError(
            "the server requires client certificates (tls_client_ca): give the bundled gateway one with "
            "gateway.target_client_cert and gateway.target_client_key"
        )
    ca = gs.target_ca or settings.tls_cert
    _check_ca(ca, "gateway.target_ca" if gs.target_ca else "tls_cert")
    if gs.target_client_cert:
        _check_client_pair(gs.target_client_cert, gs.target_client_key)
    name = gs.target_server_name or expected_name(_check_file(settings.tls_cert, "tls_cert"), host)
    return UpstreamTLS(ca_file=ca, client_cert=gs.target_client_cert, client_key=gs.target_client_key, server_name=name)


class ListenerTLS:
    """The gateway listener's certificate: an ``ssl.SSLContext`` whose pair can be reread (SIGHUP);
    new handshakes use the new pair, open connections keep theirs."""

    def __init__(self, cert: str, key: str, *, settings: tuple[str, str] = ("gateway.tls_cert", "gateway.tls_key")):
        self.cert = cert
        self.key = key
        #: the settings naming the pair, in messages: the gateway's own, or the server's it borrows.
        self._names = settings
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load()

    def _load(self) -> None:
        # Worded as the server words its own pair (``transport.CertificateReloader``).
        cert_name, key_name = self._names
        _check_file(self.cert, cert_name)
        _check_file(self.key, key_name)
        try:
            self.context.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            raise GatewayTLSError(
                f"{cert_name} {self.cert} and {key_name} {self.key} do not load as a pair: {exc}"
            ) from None

    def reload(self) -> bool:
        try:
            self._load()
        except GatewayTLSError as exc:
            log.error("gateway certificate reload failed; still serving the previous one", extra={"error": str(exc)})
            return False
        log.info("gateway certificates reloaded", extra={"cert": self.cert})
        return True


def listener_tls(settings: Settings, *, bundled: bool) -> ListenerTLS | None:
    gs = settings.gateway
    if gs.tls_cert:
        return ListenerTLS(gs.tls_cert, gs.tls_key)
    if bundled and settings.tls_cert:
        return ListenerTLS(settings.tls_cert, settings.tls_key, settings=("tls_cert", "tls_key"))
    return None
