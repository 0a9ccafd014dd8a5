"""The step-batched histogram reads as prometheus_client's Histogram does for the same values:
the same buckets (a value on a bound counts in that bucket), count and sum, in the text a scrape
gets, whether the values come one at a time or a step at a time."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from scheduler_service.metrics_batch import StepHistogram

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


def _scrape(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_a_step_at_a_time_reads_as_prometheus_histogram():
    rng = random.Random(3)
    values = [rng.expovariate(20.0) for _ in range(500)] + list(BUCKETS) + [0.0, 7.5, 1e9]
    reference, batched = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("vllm:gap_seconds", "Gaps.", buckets=BUCKETS, registry=reference)
    step_histogram = StepHistogram("vllm:gap_seconds", "Gaps.", BUCKETS, batched)
    for value in values:
        histogram.observe(value)
    for start in range(0, len(values), 37):  # steps of uneven size, one of them empty
        step_histogram.observe_many(values[start : start + 37])
    step_histogram.observe_many([])
    assert _scrape(batched) == _scrape(reference)
    assert f"vllm:gap_seconds_count {float(len(values))}" in _scrape(batched)
