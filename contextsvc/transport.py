"""How the server may listen: loopback, TLS, mutual TLS, and whether callers need a token.

The rule (DESIGN §5.10): authentication may be off only on loopback. ``auth.mode = auto`` (the
default) turns tokens on as soon as the listen address is not loopback; listening beyond
loopback without TLS, or with ``auth.mode = none``, refuses to start with one line naming
``--insecure``, the flag that allows it (behind a TLS-terminating proxy, say).

Certificates are read at start and again on SIGHUP (``CertificateReloader.reload``): the new
pair is checked first and, if it loads, used for every handshake from then on (gRPC's dynamic
server credentials ask the fetcher before each new connection); a pair that does not load is
logged and the old one stays in use.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import grpc

from contextsvc.config import AuthMode, Settings

log = logging.getLogger(__name__)


class TransportError(ValueError):
    """The listen/TLS settings cannot be used: beyond loopback unprotected, or certificate files
    that do not load. The message is one line, for the CLI."""


@dataclass(slots=True, frozen=True)
class Transport:
    """What ``check_transport`` decided."""

    loopback: bool
    auth_required: bool
    tls: bool
    mutual_tls: bool

    def describe(self) -> str:
        tls = "mutual TLS" if self.mutual_tls else "TLS" if self.tls else "plaintext"
        return f"{tls}, {'API tokens required' if self.auth_required else 'no authentication'}"


def listen_host(listen: str) -> str:
    host = listen.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; every other name counts as the network."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_transport(settings: Settings) -> Transport:
    """Apply the loopback rule; ``TransportError`` (one line) when the settings break it."""
    loopback = is_loopback(listen_host(settings.listen))
    mode = settings.auth.mode
    auth = mode is AuthMode.TOKENS or (mode is AuthMode.AUTO and not loopback)
    tls = bool(settings.tls_cert)
    if not loopback and not settings.insecure:
        if not auth:
            raise TransportError(
                f"refusing to listen on {settings.listen} with auth mode 'none': beyond loopback every caller "
                "would be admin; use auth mode 'auto' or 'tokens', or pass --insecure to allow it"
            )
        if not tls:
            raise TransportError(
                f"refusing to listen on {settings.listen} without TLS: API tokens would cross the network in "
                "clear; give --tls-cert and --tls-key, or pass --insecure to allow it (e.g. behind a TLS proxy)"
            )
    return Transport(loopback=loopback, auth_required=auth, tls=tls, mutual_tls=bool(settings.tls_client_ca))


def check_bindable(listen: str) -> None:
    """Bind the listen address ourselves, for a moment, before gRPC does: a port in use (or an
    address that is not this host's, a name that does not resolve, a port below 1024 without the
    right) is one line, ``OSError("cannot listen on HOST:PORT: <why>")``. gRPC's own refusal
    comes after its C core printed a line of its own format on stderr (not one of our JSON
    lines) and says only "Failed to bind ... set GRPC_VERBOSITY=debug". Like gRPC, a name that
    resolves to several addresses is usable when one of them is; port 0 is always free."""
    port = int(listen.rpartition(":")[2])
    if port == 0:
        return
    name = listen_host(listen)
    try:
        found = socket.getaddrinfo(name or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {listen}: {name!r} does not resolve ({exc.strerror})") from None
    problems: list[str] = []
    for family, kind, proto, _, address in found:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError as exc:  # an address family this host lacks (IPv6 off)
            problems.append(exc.strerror or str(exc))
            continue
        with probe:
            # As gRPC binds: SO_REUSEADDR (a port in TIME_WAIT is free), no SO_REUSEPORT.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                problems.append(exc.strerror or str(exc))
                continue
        return
    raise OSError(f"cannot listen on {listen}: {problems[0] if problems else 'no address to bind'}")


class CertificateReloader:
    """The server's certificate, key and (mutual TLS) client CAs, reloadable while serving."""

    def __init__(self, cert: str, key: str, client_ca: str = "") -> None:
        self._cert = Path(cert)
        self._key = Path(key)
        self._client_ca = Path(client_ca) if client_ca else None
        self._lock = threading.Lock()  # the fetcher runs on a gRPC thread
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self.reloads = 0
        #: when the certificate in use (the chain's first) expires.
        self.not_after: datetime | None = None
        self._initial = self._load()

    @property
    def mutual(self) -> bool:
        return self._client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        # The fetcher may return None ("no change"), which the stubs' type does not admit.
        fetch = cast(Callable[[], grpc.ServerCertificateConfiguration], self._fetch)
        return grpc.dynamic_ssl_server_credentials(self._initial, fetch, require_client_authentication=self.mutual)

    def reload(self) -> bool:
        """Read the files again (SIGHUP). False, with one error line, if they do not load."""
        try:
            config = self._load()
        except ValueError as exc:
            log.error("certificate reload failed; still serving the previous certificate", extra={"error": str(exc)})
            return False
        with self._lock:
            self._pending = config
            self.reloads += 1
        log.info("certificates reloaded", extra={"cert": str(self._cert), "reloads": self.reloads})
        self.warn_if_expired()
        return True

    def warn_if_expired(self) -> None:
        """One warning line when the certificate has expired: it loads (so serving goes on, as
        with any pair that loads), but every client checking it refuses the handshake."""
        if self.not_after is not None and self.not_after <= datetime.now(UTC):
            log.warning(
                "server certificate expired: clients checking it refuse the handshake",
                extra={"cert": str(self._cert), "not_after": self.not_after.isoformat()},
            )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            config, self._pending = self._pending, None
        return config

    def _load(self) -> grpc.ServerCertificateConfiguration:
        """Read and check the PEM files; TransportError naming the file that is wrong."""
        cert = _read(self._cert, "tls_cert")
        key = _read(self._key, "tls_key")
        ca = _read(self._client_ca, "tls_client_ca") if self._client_ca is not None else None
        problem = ssl_problem(cert=self._cert, key=self._key)
        if problem:
            raise TransportError(f"tls_cert {self._cert} and tls_key {self._key} do not load as a pair: {problem}")
        if self._client_ca is not None and (problem := ssl_problem(ca=self._client_ca)):
            raise TransportError(f"tls_client_ca {self._client_ca} holds no usable CA certificate: {problem}")
        config = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
        self.not_after = _not_after(cert)
        return config


def ssl_problem(
    *, cert: str | Path | None = None, key: str | Path | None = None, ca: str | Path | None = None
) -> str | None:
    """What ssl finds wrong with a certificate and key as a pair, or with a CA file (None: they
    load). Checked at start: gRPC only finds out at the first handshake, and not which part."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        if cert is not None:
            context.load_cert_chain(cert, key)
        if ca is not None:
            context.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        return str(exc) or type(exc).__name__
    return None


def _not_after(chain: bytes) -> datetime | None:
    """When the chain's first certificate (the server's own) expires (None: ssl took what this
    parser does not)."""
    from cryptography import x509  # only with TLS on

    try:
        return x509.load_pem_x509_certificate(chain).not_valid_after_utc
    except ValueError:
        return None


def _read(path: Path, setting: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TransportError(f"{setting} {path} cannot be read: {exc.strerror or exc}") from None
