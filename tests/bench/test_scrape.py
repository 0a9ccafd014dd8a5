"""bench/load/scrape.py reads the text the scheduler's /metrics serves (its own renderer over a
real registry): every sample by name, and a histogram's quantile from its buckets."""
from __future__ import annotations

import pytest

from bench.load import scrape
from scheduler_service.metrics import Metrics
from scheduler_service.metrics_text import TextRenderer

FORWARD = "planserve_model_forward_seconds"


def rendered(forward_ms: list[float]) -> dict[str, float]:
    metrics = Metrics()
    for ms in forward_ms:
        metrics.on_forward(int(ms * 1e6))
    return scrape.parse(TextRenderer(metrics.registry).render().decode())


def test_samples_by_name_with_their_labels():
    found = rendered([1.0, 3.0, 4.0, 12.0])
    assert found[f"{FORWARD}_count"] == 4.0
    assert found[f"{FORWARD}_sum"] == pytest.approx(0.020)
    assert found[f'{FORWARD}_bucket{{le="0.005"}}'] == 3.0
    assert found[f'{FORWARD}_bucket{{le="+Inf"}}'] == 4.0
    assert "planserve_steps_total" in found and not any(k.startswith("#") for k in found)


def test_a_quantile_is_interpolated_inside_its_bucket():
    # Buckets 0-2.5 ms (1 observation), 2.5-5 ms (2 more): the median, the second of four, lies
    # a third of the way into the second bucket by Prometheus' linear rule.
    found = rendered([1.0, 3.0, 4.0, 12.0])
    assert scrape.quantile(found, FORWARD, 0.5) == pytest.approx(0.0025 + 0.0025 * (2 - 1) / 2)
    assert scrape.quantile(found, FORWARD, 0.25) == pytest.approx(0.0025)
    assert 0.01 < scrape.quantile(found, FORWARD, 1.0) <= 0.0125
    assert scrape.quantile(rendered([]), FORWARD, 0.5) is None
