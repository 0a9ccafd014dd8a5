"""The scorer interface: how good a place each replica is for one new request."""

from __future__ import annotations

import abc
from typing import Protocol, Sequence

from scheduler_service.core.request import Request
from scheduler_service.registry import Registry


class ReplicaView(Protocol):
    """What a scorer may read of a replica (scheduler_service/replicas.Replica)."""

    name: str

    @property
    def scheduler(self):  # scheduler_service.core.scheduler.Scheduler
        ...


class ReplicaScorer(abc.ABC):
    #: The name `--router-weights` knows the scorer by.
    name: str = ""

    @abc.abstractmethod
    def score(self, request: Request, replicas: Sequence[ReplicaView]) -> list[float]:
        """One score in [0, 1] per replica (1: the best place). Runs on the event loop at every
        admission, so it must be cheap: O(replicas), plus a prefix-hash lookup at most."""


# ---- the registry: `@register` puts a scorer under its name (scorers/__init__.py resolves) ----

SCORERS: Registry[type[ReplicaScorer]] = Registry("scorer", ReplicaScorer, "planserve.scorers")
register = SCORERS.register
