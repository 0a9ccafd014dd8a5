"""Which replica a new request goes to: weighted scorers (scheduler_service/engine/scorers), top
total wins.

    total(replica) = sum over scorers of weight * score(request, replica)      score in [0, 1]

Ties (equal totals, e.g. an idle set, or no replica caching the prompt) go to the replica holding
the fewest requests, then round robin, so that equal replicas share the load evenly.
"""

from __future__ import annotations

from typing import Sequence

from scheduler_service.core.request import Request
from scheduler_service.engine import scorers
from scheduler_service.engine.scorers.base import ReplicaView

DEFAULT_WEIGHTS = "prefix_affinity=2,kv_usage=1,waiting_tokens=1"
_TIE = 1e-9


class Router:
    def __init__(self, weights: dict[str, float]):
        self.weights = dict(weights)
        self.scorers = [
            (scorers.resolve(name)(), weight) for name, weight in weights.items() if weight > 0
        ]
        self._turn = 0  # round robin among tied replicas

    @classmethod
    def from_spec(cls, spec: str) -> "Router":
        return cls(scorers.parse_weights(spec))

    def totals(self, request: Request, replicas: Sequence[ReplicaView]) -> list[float]:
        totals = [0.0] * len(replicas)
        for scorer, weight in self.scorers:
            for index, score in enumerate(scorer.score(request, replicas)):
                totals[index] += weight * score
        return totals

    def choose(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        """Index into replicas (non-empty) of the replica the request goes to."""
        if len(replicas) == 1:
            return 0
        totals = self.totals(request, replicas)
        best = max(totals)
        tied = [i for i, total in enumerate(totals) if total >= best - _TIE]
        count = len(replicas)
        turn = self._turn
        self._turn += 1
        return min(tied, key=lambda i: (len(replicas[i].scheduler.requests), (i - turn) % count))
