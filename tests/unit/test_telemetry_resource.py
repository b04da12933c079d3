"""The resource every span and metric is exported with (docs/telemetry.md, "Turning it on"):
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` as the SDK reads them, and the service
name ``contextsvc`` only when neither names one."""

from __future__ import annotations

from typing import Any

import pytest

from contextsvc import telemetry


def _service_attributes(monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, Any]:
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_RESOURCE_DETECTORS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    built = telemetry.build("console", "", service_version="9.9")
    try:
        assert built.spans is not None
        return dict(built.spans.resource.attributes)
    finally:
        built.shutdown()


def test_default_service_name_without_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    attributes = _service_attributes(monkeypatch)
    assert attributes["service.name"] == "contextsvc"
    assert attributes["service.version"] == "9.9"


def test_service_name_from_resource_attributes_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    attributes = _service_attributes(
        monkeypatch, OTEL_RESOURCE_ATTRIBUTES="service.name=ctx-eu,deployment.environment=staging"
    )
    assert attributes["service.name"] == "ctx-eu"
    assert attributes["deployment.environment"] == "staging"


def test_otel_service_name_wins_over_resource_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    attributes = _service_attributes(
        monkeypatch, OTEL_SERVICE_NAME="ctx-main", OTEL_RESOURCE_ATTRIBUTES="service.name=ctx-eu"
    )
    assert attributes["service.name"] == "ctx-main"
