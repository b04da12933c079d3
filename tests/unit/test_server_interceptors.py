"""The server's interceptor chain: what every call passes through, in order, and nothing idle.

Each interceptor and each admission costs every call (Health/Check included), so the chain holds
only what the settings switch on: with authentication off, one guard admits a call past the serving
gate and the quotas; with every quota off (the default), no quota admission is asked at all.
"""

from __future__ import annotations

import pytest

from contextsvc import telemetry
from contextsvc.api.auth import AuthInterceptor
from contextsvc.api.decoding import DecodeGuard
from contextsvc.api.gate import ServingGate
from contextsvc.api.quotas import Quotas
from contextsvc.clock import SystemClock
from contextsvc.config import QuotaSettings, Settings
from contextsvc.core.session import Principal
from contextsvc.engine.authn import Authenticator
from contextsvc.server import _interceptors
from contextsvc.stores.memory import MemoryStore


async def _no_sessions(caller: Principal) -> int:
    return 0


def _chain(*, auth: bool, quotas_on: bool) -> tuple[list[object], ServingGate, Quotas]:
    gate = ServingGate()
    quotas = Quotas(QuotaSettings(calls_per_second=5.0 if quotas_on else 0.0), count_sessions=_no_sessions)
    settings = Settings()
    authenticator = Authenticator(MemoryStore(settings), settings.auth, SystemClock()) if auth else None
    chain = _interceptors(telemetry.Telemetry(), gate, authenticator, quotas, 10, settings.auth.stream_check_seconds)
    return list(chain), gate, quotas


def _guard(interceptor: object) -> DecodeGuard:
    assert isinstance(interceptor, DecodeGuard)
    return interceptor


@pytest.mark.parametrize("quotas_on", [False, True])
def test_without_authentication_one_guard_admits_past_the_gate_and_the_quotas(quotas_on: bool) -> None:
    chain, gate, quotas = _chain(auth=False, quotas_on=quotas_on)
    assert len(chain) == 1
    guard = _guard(chain[0])
    assert guard._admissions == ((gate, quotas) if quotas_on else (gate,))
    assert guard._decoding


def test_with_authentication_quotas_come_after_it_and_only_when_on() -> None:
    chain, gate, quotas = _chain(auth=True, quotas_on=True)
    assert [type(i) for i in chain] == [DecodeGuard, AuthInterceptor, DecodeGuard]
    assert _guard(chain[0])._admissions == (gate,)
    assert _guard(chain[2])._admissions == (quotas,)
    assert not _guard(chain[2])._decoding  # the bytes were checked by the first guard

    chain, gate, _ = _chain(auth=True, quotas_on=False)
    assert [type(i) for i in chain] == [DecodeGuard, AuthInterceptor]
    assert _guard(chain[0])._admissions == (gate,)
