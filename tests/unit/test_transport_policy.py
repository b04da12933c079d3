"""The loopback rule (DESIGN §5.10): where authentication may be off, where TLS is required."""

from __future__ import annotations

import pytest

from contextsvc.config import AuthMode, Settings
from contextsvc.transport import TransportError, check_transport, is_loopback, listen_host


@pytest.mark.parametrize(
    ("listen", "loopback"),
    [
        ("127.0.0.1:1", True),
        ("127.8.9.10:1", True),
        ("[::1]:1", True),
        ("localhost:1", True),
        ("0.0.0.0:1", False),
        ("[::]:1", False),
        ("10.0.0.5:1", False),
        ("example.internal:1", False),
    ],
)
def test_loopback_addresses(listen: str, loopback: bool) -> None:
    assert is_loopback(listen_host(listen)) is loopback


def test_auto_mode_is_off_on_loopback_and_on_elsewhere() -> None:
    local = check_transport(Settings(listen="127.0.0.1:0"))
    assert (local.loopback, local.auth_required, local.tls) == (True, False, False)
    remote = check_transport(Settings(listen="0.0.0.0:0", tls_cert="c.pem", tls_key="k.pem"))
    assert (remote.loopback, remote.auth_required, remote.tls) == (False, True, True)
    assert check_transport(Settings(listen="127.0.0.1:0", auth={"mode": "tokens"})).auth_required


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"listen": "0.0.0.0:50051"}, "without TLS"),
        ({"listen": "0.0.0.0:50051", "tls_cert": "c", "tls_key": "k", "auth": {"mode": "none"}}, "auth mode 'none'"),
        ({"listen": "[::]:50051", "auth": {"mode": "none"}}, "auth mode 'none'"),
    ],
)
def test_beyond_loopback_unprotected_refuses_in_one_line_naming_insecure(settings: dict, needle: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(TransportError) as caught:
        check_transport(Settings(**settings))
    message = str(caught.value)
    assert needle in message and "--insecure" in message and "\n" not in message
    allowed = check_transport(Settings(**settings, insecure=True))
    assert not allowed.loopback


def test_insecure_keeps_tokens_on_in_auto_mode() -> None:
    t = check_transport(Settings(listen="0.0.0.0:1", insecure=True))
    assert t.auth_required and not t.tls
    assert Settings(auth={"mode": "none"}).auth.mode is AuthMode.NONE


def test_tls_settings_go_in_pairs() -> None:
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        Settings(tls_cert="c.pem")
    with pytest.raises(ValueError, match="tls_client_ca"):
        Settings(tls_client_ca="ca.pem")


def test_tls_and_auth_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXTSVC_TLS_CERT", "/etc/c.pem")
    monkeypatch.setenv("CONTEXTSVC_TLS_KEY", "/etc/k.pem")
    monkeypatch.setenv("CONTEXTSVC_TLS_CLIENT_CA", "/etc/ca.pem")
    monkeypatch.setenv("CONTEXTSVC_AUTH__MODE", "tokens")
    monkeypatch.setenv("CONTEXTSVC_AUTH__CACHE_SECONDS", "1.5")
    s = Settings()
    assert (s.tls_cert, s.tls_key, s.tls_client_ca) == ("/etc/c.pem", "/etc/k.pem", "/etc/ca.pem")
    assert s.auth.mode is AuthMode.TOKENS and s.auth.cache_seconds == 1.5
