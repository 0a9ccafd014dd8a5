"""The built-in scorers: load (KV usage, waiting tokens), cache affinity, and a random baseline."""

from __future__ import annotations

import random
from typing import Sequence

from scheduler_service.core.request import Request
from scheduler_service.engine.scorers.base import ReplicaScorer, ReplicaView, register


@register
class KVUsage(ReplicaScorer):
    """1 - the fraction of the replica's usable KV blocks held by sequences."""

    name = "kv_usage"

    def score(self, request: Request, replicas: Sequence[ReplicaView]) -> list[float]:
        scores = []
        for replica in replicas:
            kv = replica.scheduler.kv
            usable = kv.num_usable_blocks
            scores.append(kv.num_free_blocks / usable if usable else 0.0)
        return scores


def pending_tokens(scheduler) -> int:
    """Tokens the replica still has to compute for the requests it holds (waiting prompts,
    unfinished prefills): the work ahead of a new request there."""
    return sum(r.num_tokens_to_compute for r in scheduler.requests.values())


@register
class WaitingTokens(ReplicaScorer):
    """Fewest tokens ahead: 1 for the replica with the least pending work, falling linearly to 0
    for the one with the most."""

    name = "waiting_tokens"

    def score(self, request: Request, replicas: Sequence[ReplicaView]) -> list[float]:
        pending = [pending_tokens(replica.scheduler) for replica in replicas]
        most = max(pending)
        return [1.0 - p / most if most else 1.0 for p in pending]


@register
class PrefixAffinity(ReplicaScorer):
    """The share of the request's prompt already cached on the replica (its prefix blocks' hashes
    in that replica's block pool): the replica holding the longest cached prefix scores highest."""

    name = "prefix_affinity"

    def score(self, request: Request, replicas: Sequence[ReplicaView]) -> list[float]:
        length = max(1, len(request.prompt_token_ids))
        return [
            replica.scheduler.kv.num_cached_prefix_tokens(request) / length for replica in replicas
        ]


@register
class Random(ReplicaScorer):
    """A uniform random score: alone, random routing (the baseline the others are measured
    against); with a small weight, a tie breaker."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._random = random.Random(seed)

    def score(self, request: Request, replicas: Sequence[ReplicaView]) -> list[float]:
        return [self._random.random() for _ in replicas]


@register
class LoraAffinity(ReplicaScorer):
    """LoRA adapter affinity (llm-d's LoRA-affinity scorer): for a request on an adapter, 1 where
    the adapter already runs (it takes no new place), 0.75 where it is loaded and a place is free,
    0.5 where a place is free (it loads there first), 0.25 where it is loaded but every place is
    taken, else 0. Every replica scores 0 for a base-model request."""

    name = "lora_affinity"

    def score(self, request: Request, replicas: Sequence[ReplicaView]) -> list[float]:
        name = request.lora_name
        if not name:
            return [0.0] * len(replicas)
        scores = []
        for replica in replicas:
            loras = replica.scheduler.loras
            place_free = len(loras.running) < loras.max_loras
            if name in loras.running:
                scores.append(1.0)
            elif name in loras.resident:
                scores.append(0.75 if place_free else 0.25)
            else:
                scores.append(0.5 if place_free else 0.0)
        return scores
