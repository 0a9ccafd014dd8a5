"""Earliest deadline first."""

from __future__ import annotations

import math
from typing import Sequence

from scheduler_service.core.policies._heap import HeapPolicy, waiting_order
from scheduler_service.core.policies.base import register
from scheduler_service.core.request import Request


def _deadline(request: Request) -> float:
    return math.inf if request.deadline is None else request.deadline


@register
class EDFPolicy(HeapPolicy):
    """Earliest deadline first; requests without one after all that have one, then arrival.

    Order key: (deadline or +inf, 0 if preempted else 1, waiting_order). Victim: the latest
    deadline (none counts as latest), then the latest arrival. The policy only orders: the
    scheduler finishes a request whose deadline passed (finish reason DEADLINE).
    """

    name = "edf"

    def __init__(self) -> None:
        super().__init__()

    def key(self, request: Request, preempted: bool) -> tuple:
        return (_deadline(request), 0 if preempted else 1, *waiting_order(request))

    def select_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (_deadline(r), r.arrival_time, r.request_id))
