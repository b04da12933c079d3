"""The RPC duration histogram aggregated outside the SDK: what a reader collects equals what the SDK's
own explicit-bucket histogram would have recorded, each measurement is collected exactly once, and
none is lost between collections (also while another thread records)."""

from __future__ import annotations

import math
import random
import threading
from typing import Any

import pytest
from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from contextsvc import telemetry
from contextsvc.telemetry_metrics import OwnHistogram, with_histograms

BOUNDS = telemetry._DURATION_BUCKETS
SCOPE = "contextsvc"
ATTRS = [
    {"rpc.system": "grpc", "rpc.service": "s", "rpc.method": "BuildContext", "rpc.grpc.status_code": 0},
    {"rpc.system": "grpc", "rpc.service": "s", "rpc.method": "GetSession", "rpc.grpc.status_code": 5},
    {"rpc.system": "grpc", "rpc.service": "s", "rpc.method": "Check", "rpc.grpc.status_code": 0},
]


def _setup(temporality: AggregationTemporality) -> tuple[Any, Any, OwnHistogram]:
    """A reader holding both an SDK histogram ("sdk") and ours ("own"), same boundaries."""
    resource = Resource.create({"service.name": "t"})
    reader = with_histograms(InMemoryMetricReader)(preferred_temporality={HistogramInstrument: temporality})
    own = OwnHistogram("own", unit="s", description="d", boundaries=BOUNDS, scope=InstrumentationScope(SCOPE))
    reader.attach([own], resource)  # type: ignore[attr-defined]
    provider = MeterProvider(resource=resource, metric_readers=[reader])
    sdk = provider.get_meter(SCOPE).create_histogram("sdk", unit="s", explicit_bucket_boundaries_advisory=BOUNDS)
    return reader, sdk, own


def _points(reader: Any) -> dict[str, dict[frozenset[Any], Any]]:
    """metric name -> attribute set -> data point, from one collection."""
    data = reader.get_metrics_data()
    out: dict[str, dict[frozenset[Any], Any]] = {}
    if data is None:
        return out
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            assert sm.scope.name == SCOPE
            for metric in sm.metrics:
                assert metric.name not in out, "one metric per name per collection"
                out[metric.name] = {frozenset(p.attributes.items()): p for p in metric.data.data_points}
    return out


def _values(rng: random.Random, n: int) -> list[float]:
    # Every boundary exactly (a value on a boundary closes that bucket), zero, beyond the last one,
    # and log-uniform durations between.
    return [*BOUNDS, 0.0, 120.0, *(10 ** rng.uniform(-5, 2) for _ in range(n))]


def _same(a: Any, b: Any) -> None:
    assert dict(a.attributes) == dict(b.attributes)
    assert a.count == b.count
    assert a.sum == pytest.approx(b.sum, rel=1e-12)
    assert tuple(a.bucket_counts) == tuple(b.bucket_counts)
    assert tuple(a.explicit_bounds) == tuple(float(x) for x in b.explicit_bounds)
    assert a.min == b.min and a.max == b.max
    assert a.time_unix_nano > 0 and a.start_time_unix_nano <= a.time_unix_nano


@pytest.mark.parametrize("temporality", [AggregationTemporality.CUMULATIVE, AggregationTemporality.DELTA])
def test_collected_points_equal_the_sdk_histograms(temporality: AggregationTemporality) -> None:
    reader, sdk, own = _setup(temporality)
    rng = random.Random(7)
    for collection in range(3):
        for attrs in ATTRS[: 1 + collection]:  # an attribute set appears in later collections only
            for value in _values(rng, 200):
                sdk.record(value, attrs)
                own.record(value, attrs)
        got = _points(reader)
        assert set(got["own"]) == set(got["sdk"])
        for key, point in got["own"].items():
            _same(point, got["sdk"][key])
        assert all(p.count == len(BOUNDS) + 202 for p in got["own"].values()) or (
            temporality is AggregationTemporality.CUMULATIVE
        )


def test_delta_collects_each_measurement_exactly_once() -> None:
    reader, _sdk, own = _setup(AggregationTemporality.DELTA)
    own.record(0.002, ATTRS[0])
    own.record(0.003, ATTRS[0])
    first = _points(reader)["own"]
    assert [p.count for p in first.values()] == [2]
    assert "own" not in _points(reader)  # nothing new: no point, nothing counted twice
    own.record(0.004, ATTRS[0])
    (third,) = _points(reader)["own"].values()
    assert third.count == 1 and third.sum == pytest.approx(0.004)
    assert third.start_time_unix_nano >= next(iter(first.values())).time_unix_nano


def test_cumulative_keeps_reporting_the_totals() -> None:
    reader, _sdk, own = _setup(AggregationTemporality.CUMULATIVE)
    own.record(0.002, ATTRS[0])
    (a,) = _points(reader)["own"].values()
    (b,) = _points(reader)["own"].values()  # no new measurement: the same totals again
    own.record(70.0, ATTRS[0])
    (c,) = _points(reader)["own"].values()
    assert (a.count, b.count, c.count) == (1, 1, 2)
    assert c.bucket_counts[-1] == 1 and c.max == 70.0 and c.min == 0.002
    assert a.start_time_unix_nano == c.start_time_unix_nano


def test_nothing_is_lost_while_another_thread_records() -> None:
    reader, _sdk, own = _setup(AggregationTemporality.DELTA)
    n, stop = 30_000, threading.Event()
    collected: list[int] = []

    def collect() -> None:
        while not stop.is_set():
            points = _points(reader).get("own", {})
            collected.append(sum(p.count for p in points.values()))

    collector = threading.Thread(target=collect)
    collector.start()
    try:
        for i in range(n):
            own.record(0.001 * (i % 7), ATTRS[i % 3])
    finally:
        stop.set()
        collector.join(timeout=30)
    collected.append(sum(p.count for p in _points(reader).get("own", {}).values()))
    assert sum(collected) == n
    assert len(collected) > 2  # collections did run meanwhile


def test_reported_when_the_sdk_has_nothing_else() -> None:
    reader, _sdk, own = _setup(AggregationTemporality.CUMULATIVE)
    assert reader.get_metrics_data() is None or not _points(reader)  # nothing recorded: nothing reported
    own.record(0.01, ATTRS[2])
    (point,) = _points(reader)["own"].values()
    assert point.count == 1


def test_values_the_sdk_refuses_are_dropped() -> None:
    reader, _sdk, own = _setup(AggregationTemporality.DELTA)
    for bad in (-1.0, math.nan, math.inf):
        own.record(bad, ATTRS[0])
    own.record(0.5, ATTRS[0])
    (point,) = _points(reader)["own"].values()
    assert point.count == 1 and point.sum == 0.5


def test_equal_attributes_in_new_dicts_share_one_point() -> None:
    reader, _sdk, own = _setup(AggregationTemporality.DELTA)
    for _ in range(5):
        own.record(0.001, dict(ATTRS[0]))  # a fresh dict each time, as a caller may pass
    own.record(0.001, ATTRS[0])
    (point,) = _points(reader)["own"].values()
    assert point.count == 6
    assert len(own._by_id) == 1  # fresh dicts are looked up by content, not remembered one by one


def test_configured_metering_uses_its_own_rpc_duration() -> None:
    tel = telemetry.build("", "console")
    try:
        assert type(tel.instruments.rpc_duration) is OwnHistogram
    finally:
        tel.shutdown()
