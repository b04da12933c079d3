"""The RPC duration histogram, aggregated by the interceptor and handed to the SDK's reader when it collects.

``rpc.server.call.duration`` is the one metric recorded on every call, sampled or not. Through the
SDK (1.45) one measurement builds a ``Measurement``, asks the exemplar filter, copies and hashes the
attribute dict and takes the aggregation's lock: ~15-30 µs, against ~1 µs for adding to a bucket
count here (bench/RESULTS.md, "Telemetry split"). The SDK offers no metric producer to merge data
aggregated elsewhere (an open proposal upstream), so the readers ``telemetry`` builds are the SDK's
own with one addition (``with_histograms``): when the reader collects, each ``OwnHistogram`` adds
its data points to what the SDK collected, as the SDK's explicit-bucket histogram would have made
them — same boundaries (a value on a boundary counts in the bucket it closes), count, sum, min and
max, the reader's temporality (cumulative from the first measurement, or delta since the last
collection) — under the meter's scope. What is lost against the SDK's instrument: exemplars.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from time import time_ns
from typing import Any, TypeVar

from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricReader,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

__all__ = ["OwnHistogram", "with_histograms"]

_R = TypeVar("_R", bound=MetricReader)


class _Cell:
    """One attribute set's measurements since the last collection."""

    __slots__ = ("attributes", "count", "counts", "max", "min", "sum")

    def __init__(self, attributes: Mapping[str, Any], buckets: int) -> None:
        self.attributes = dict(attributes)
        self.counts = [0] * buckets
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf


class _Total:
    """One attribute set's cumulative figures (cumulative temporality)."""

    __slots__ = ("count", "counts", "max", "min", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf


class OwnHistogram:
    """An explicit-bucket histogram with the SDK ``Histogram``'s ``record(amount, attributes)``.

    ``record`` runs on the event loop, ``collect`` on the reader's thread; one lock keeps every
    measurement in exactly one collection.
    """

    def __init__(
        self, name: str, *, unit: str, description: str, boundaries: Sequence[float], scope: InstrumentationScope
    ) -> None:
        self.name = name
        self.unit = unit
        self.description = description
        self.scope = scope
        self._bounds = tuple(float(b) for b in boundaries)
        self._buckets = len(self._bounds) + 1
        self._lock = threading.Lock()
        #: attribute content -> cell
        self._cells: dict[frozenset[tuple[str, Any]], _Cell] = {}
        #: id(first attribute dict of a cell) -> (that dict, the cell); the dict is kept so its id is not reused
        self._by_id: dict[int, tuple[Mapping[str, Any], _Cell]] = {}
        #: attribute content -> cumulative figures, and when the first measurement came
        self._totals: dict[frozenset[tuple[str, Any]], _Total] = {}
        self._started = time_ns()
        self._last_collection = self._started

    def _cell(self, attributes: Mapping[str, Any]) -> _Cell:
        key = frozenset(attributes.items())
        with self._lock:
            cell = self._cells.get(key)
            if cell is None:
                cell = self._cells[key] = _Cell(attributes, self._buckets)
                # The first dict given for an attribute set is found by identity from then on (the
                # interceptor hands the same dict for a method and code every time); one per cell,
                # so bounded as the cells are (methods x status codes).
                self._by_id[id(attributes)] = (attributes, cell)
        return cell

    def record(self, amount: float, attributes: Mapping[str, Any] | None = None, context: Any = None) -> None:
        """One measurement (seconds, say); a negative or non-finite one is dropped, as the SDK does."""
        del context  # no exemplars
        if not 0 <= amount < math.inf:
            return
        attributes = attributes if attributes is not None else {}
        found = self._by_id.get(id(attributes))
        cell = found[1] if found is not None and found[0] is attributes else self._cell(attributes)
        with self._lock:
            cell.counts[bisect_left(self._bounds, amount)] += 1
            cell.count += 1
            cell.sum += amount
            if amount < cell.min:
                cell.min = amount
            if amount > cell.max:
                cell.max = amount

    def collect(self, temporality: AggregationTemporality, now: int | None = None) -> Metric | None:
        """The metric for one collection (None: no data point), taking what was recorded since the last."""
        taken: list[tuple[frozenset[tuple[str, Any]], dict[str, Any], list[int], int, float, float, float]] = []
        with self._lock:
            for key, cell in self._cells.items():
                if cell.count:
                    taken.append((key, cell.attributes, cell.counts, cell.count, cell.sum, cell.min, cell.max))
                    cell.counts = [0] * self._buckets
                    cell.count = 0
                    cell.sum = 0.0
                    cell.min, cell.max = math.inf, -math.inf
            now = now if now is not None else time_ns()
            since, self._last_collection = self._last_collection, now
        points: list[HistogramDataPoint] = []
        if temporality == AggregationTemporality.DELTA:
            for _key, attributes, counts, count, total, low, high in taken:
                points.append(self._point(attributes, since, now, counts, count, total, low, high))
        else:
            for key, _attributes, counts, count, total, low, high in taken:
                cumulative = self._totals.get(key)
                if cumulative is None:
                    cumulative = self._totals[key] = _Total(self._buckets)
                cumulative.counts = [a + b for a, b in zip(cumulative.counts, counts, strict=True)]
                cumulative.count += count
                cumulative.sum += total
                cumulative.min = min(cumulative.min, low)
                cumulative.max = max(cumulative.max, high)
            for key, c in self._totals.items():
                points.append(
                    self._point(self._cells[key].attributes, self._started, now, c.counts, c.count, c.sum, c.min, c.max)
                )
        if not points:
            return None
        return Metric(
            name=self.name,
            description=self.description,
            unit=self.unit,
            data=Histogram(data_points=points, aggregation_temporality=temporality),
        )

    def _point(
        self,
        attributes: dict[str, Any],
        start: int,
        now: int,
        counts: list[int],
        count: int,
        total: float,
        low: float,
        high: float,
    ) -> HistogramDataPoint:
        return HistogramDataPoint(
            attributes=attributes,
            start_time_unix_nano=start,
            time_unix_nano=now,
            count=count,
            sum=total,
            bucket_counts=tuple(counts),
            explicit_bounds=self._bounds,
            min=low,
            max=high,
        )


def _merged(data: MetricsData, extra: list[Metric], resource: Resource, scope: InstrumentationScope) -> MetricsData:
    """``data`` with ``extra`` added under ``resource`` and ``scope`` (new objects; ``data`` is not changed)."""
    resources = list(data.resource_metrics)
    for i, rm in enumerate(resources):
        if rm.resource is resource or rm.resource == resource:
            scopes = list(rm.scope_metrics)
            for j, sm in enumerate(scopes):
                if sm.scope == scope:
                    scopes[j] = ScopeMetrics(scope=sm.scope, metrics=[*sm.metrics, *extra], schema_url=sm.schema_url)
                    break
            else:
                scopes.append(ScopeMetrics(scope=scope, metrics=extra, schema_url=scope.schema_url or ""))
            resources[i] = ResourceMetrics(resource=rm.resource, scope_metrics=scopes, schema_url=rm.schema_url)
            break
    else:
        resources.append(
            ResourceMetrics(
                resource=resource,
                scope_metrics=[ScopeMetrics(scope=scope, metrics=extra, schema_url=scope.schema_url or "")],
                schema_url=resource.schema_url,
            )
        )
    return MetricsData(resource_metrics=resources)


def _histogram_temporality(reader: MetricReader) -> AggregationTemporality:
    """The temporality ``reader`` collects histograms with (its exporter's preference, or cumulative)."""
    # Keyed by the SDK's instrument classes (Histogram or its internal subclass).
    chosen: dict[type, AggregationTemporality] = getattr(reader, "_instrument_class_temporality", {})
    for kind, temporality in chosen.items():
        if issubclass(kind, HistogramInstrument):
            return temporality
    return AggregationTemporality.CUMULATIVE


def with_histograms(reader_type: type[_R]) -> type[_R]:
    """A subclass of the SDK reader ``reader_type`` whose every collection also takes its histograms'.

    Construct it as ``reader_type`` and give it ``histograms`` and ``resource`` afterwards
    (``attach``). A collection where the SDK had nothing to report still reports the histograms.
    """

    class _Reader(reader_type):  # type: ignore[valid-type,misc]
        _own: tuple[OwnHistogram, ...] = ()
        _own_resource: Resource | None = None
        _own_lock: threading.Lock
        _received: bool = False

        def attach(self, histograms: Sequence[OwnHistogram], resource: Resource) -> None:
            self._own = tuple(histograms)
            self._own_resource = resource
            self._own_lock = threading.Lock()

        def collect(self, timeout_millis: float = 10_000) -> None:
            if not self._own:
                super().collect(timeout_millis=timeout_millis)
                return
            with self._own_lock:  # the ticker, a flush and the shutdown may collect at once
                self._received = False
                super().collect(timeout_millis=timeout_millis)
                if not self._received and getattr(self, "_collect", None) is not None:
                    self._receive_metrics(MetricsData(resource_metrics=[]), timeout_millis=timeout_millis)

        def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> None:
            if self._own and self._own_resource is not None:
                self._received = True
                temporality = _histogram_temporality(self)
                extra = [m for m in (h.collect(temporality) for h in self._own) if m is not None]
                if not extra and not metrics_data.resource_metrics:
                    return  # nothing at all to report (the SDK would not have called)
                if extra:
                    metrics_data = _merged(metrics_data, extra, self._own_resource, self._own[0].scope)
            super()._receive_metrics(metrics_data, timeout_millis=timeout_millis, **kwargs)

    _Reader.__name__ = _Reader.__qualname__ = f"{reader_type.__name__}WithHistograms"
    return _Reader
