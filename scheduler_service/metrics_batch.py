"""A Prometheus histogram that takes a step's observations at once.

The inter-token histogram gets one observation per output chunk: at 256 streams, 256 a step.
prometheus_client's Histogram takes a lock and walks its buckets in Python for each one; here a
step's values are counted into the buckets with one numpy search, under one lock. A scrape
(the metrics server's thread, or the serving port's /metrics) reads the same family
prometheus_client's Histogram would give: cumulative `le` buckets ending at +Inf, `_count`,
`_sum`.
"""

from __future__ import annotations

import threading
from typing import Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class StepHistogram:
    """Observed a step at a time (`observe_many`); registered in `registry` as a collector."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ):
        bounds = sorted(float(b) for b in buckets)
        if bounds[-1] != float("inf"):
            bounds.append(float("inf"))
        self._name, self._documentation = name, documentation
        self._bounds = np.asarray(bounds)
        self._labels = [floatToGoString(b) for b in bounds]
        self._counts = np.zeros(len(bounds), dtype=np.int64)
        self._sum = 0.0
        self._lock = threading.Lock()  # a scrape may read on another thread
        registry.register(self)

    def observe_many(self, values: Sequence[float]) -> None:
        """Each value counts in the first bucket whose bound is >= it (Prometheus' `le`)."""
        if not len(values):
            return
        array = np.asarray(values, dtype=np.float64)
        found = np.bincount(np.searchsorted(self._bounds, array), minlength=len(self._bounds))
        total = float(array.sum())
        with self._lock:
            self._counts += found
            self._sum += total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            cumulative = np.cumsum(self._counts).tolist()
            total = self._sum
        yield HistogramMetricFamily(
            self._name,
            self._documentation,
            buckets=list(zip(self._labels, cumulative)),
            sum_value=total,
        )

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._documentation)]
