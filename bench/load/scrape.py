"""What the benchmarks read from a server's /metrics: its samples by name, and a histogram's
quantile from its buckets (Prometheus' text format, as scheduler_service/metrics.py writes it)."""

from __future__ import annotations

import math
import urllib.request
from typing import Optional


def samples(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Every sample of the page at `url`: {"name{labels}": value} ("name" alone without labels)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        return parse(answer.read().decode())


def parse(text: str) -> dict[str, float]:
    found = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        found[name] = float(value)
    return found


def quantile(found: dict[str, float], histogram: str, q: float) -> Optional[float]:
    """The q-quantile of a histogram without labels, interpolated inside its bucket (the
    bucket's lower bound to its upper, as Prometheus' histogram_quantile does); None when it
    holds no observation."""
    prefix = f'{histogram}_bucket{{le="'
    buckets = sorted(
        (math.inf if key[len(prefix) : -2] == "+Inf" else float(key[len(prefix) : -2]), count)
        for key, count in found.items()
        if key.startswith(prefix)
    )
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return None
    low, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= q * total:
            if math.isinf(upper):
                return low
            return low + (upper - low) * (q * total - below) / max(count - below, 1e-9)
        low, below = upper, count
    return None
