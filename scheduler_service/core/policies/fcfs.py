"""First come, first served: the order of arrival (a first-token target goes first, by its due
time: _heap.waiting_order)."""

from __future__ import annotations

from scheduler_service.core.policies._heap import HeapPolicy, waiting_key
from scheduler_service.core.policies.base import register
from scheduler_service.core.request import Request


@register
class FCFSPolicy(HeapPolicy):
    """Arrival order, earliest first-token target first; preempted requests go back ahead of
    fresh ones. Victim: latest arrival."""

    name = "fcfs"

    def __init__(self) -> None:
        super().__init__()

    def key(self, request: Request, preempted: bool) -> tuple:
        return waiting_key(request, preempted)
