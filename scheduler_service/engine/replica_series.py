"""The per-replica Prometheus series (labelled `replica`) of a ReplicaSet: written by the set
(up, routed, drained) and by each replica's metrics (merged.py ReplicaMetrics)."""

from __future__ import annotations

import dataclasses
from typing import Any

from prometheus_client import Counter, Gauge

# (attribute, kind, name, help)
_SERIES = (
    (
        "up",
        Gauge,
        "planserve_replica_up",
        "1 while the replica's engine is connected and computing.",
    ),
    (
        "waiting",
        Gauge,
        "planserve_replica_num_requests_waiting",
        "Requests waiting on the replica.",
    ),
    (
        "running",
        Gauge,
        "planserve_replica_num_requests_running",
        "Sequences running on the replica.",
    ),
    (
        "kv_usage",
        Gauge,
        "planserve_replica_kv_cache_usage_ratio",
        "Fraction of the replica's usable KV blocks held.",
    ),
    (
        "routed",
        Counter,
        "planserve_replica_routed_requests",
        "New requests the router sent to the replica.",
    ),
    (
        "drained",
        Counter,
        "planserve_replica_drained_requests",
        "Requests moved off the replica (engine down or replica gone).",
    ),
    (
        "prompt_tokens",
        Counter,
        "planserve_replica_prompt_tokens",
        "Prompt tokens of samples finished there.",
    ),
    (
        "cached_tokens",
        Counter,
        "planserve_replica_prefix_cache_hit_tokens",
        "Prompt tokens of samples finished there served from its prefix cache.",
    ),
)


@dataclasses.dataclass(frozen=True)
class ReplicaSeries:
    up: Any
    waiting: Any
    running: Any
    kv_usage: Any
    routed: Any
    drained: Any
    prompt_tokens: Any
    cached_tokens: Any

    @classmethod
    def register(cls, registry) -> ReplicaSeries:
        """Every series, registered in `registry`."""
        return cls(
            **{
                attribute: kind(name, text, ["replica"], registry=registry)
                for attribute, kind, name, text in _SERIES
            }
        )
