"""Which exporters the standard OTEL_* variables turn on, and that "off" installs nothing."""

from __future__ import annotations

import pytest

from contextsvc import telemetry

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("env", "traces", "metrics"),
    [
        ({}, "", ""),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, "otlp", "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, "otlp", ""),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_METRICS_EXPORTER": "none"}, "otlp", ""),
        ({"OTEL_METRICS_EXPORTER": "prometheus"}, "", "prometheus"),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, "console", ""),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SDK_DISABLED": "true"}, "", ""),
    ],
)
def test_exporters_follow_the_standard_variables(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], traces: str, metrics: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert telemetry._wanted("traces") == traces
    assert telemetry._wanted("metrics") == metrics


def test_protocol_defaults_to_http_protobuf_and_per_signal_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    assert telemetry._protocol("traces") == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert telemetry._protocol("traces") == "grpc"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert telemetry._protocol("traces") == "http/protobuf"
    assert telemetry._protocol("metrics") == "grpc"


def test_off_installs_no_interceptor_and_wraps_nothing() -> None:
    off = telemetry.configure()
    assert not off.enabled
    assert off.server_interceptors() == []
    sentinel: object = object()
    assert off.wrap_store(sentinel) is sentinel  # type: ignore[arg-type]
    assert off.wrap_bus(sentinel) is sentinel  # type: ignore[arg-type]
    assert off.wrap_summarizers(sentinel) is sentinel  # type: ignore[arg-type]
    # The engine's hooks are safe to call with nothing configured.
    with telemetry.view_span("s") as span:
        telemetry.view_built("m", 3, 100, 0.5)
        assert not span.is_recording()
    telemetry.note_genai_usage(10, 2)
