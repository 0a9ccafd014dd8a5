"""First come, first served: the order of arrival."""

from __future__ import annotations

from scheduler_service.core.policies._heap import HeapPolicy, fcfs_key
from scheduler_service.core.policies.base import register
from scheduler_service.core.request import Request


@register
class FCFSPolicy(HeapPolicy):
    """Arrival order; preempted requests go back ahead of fresh ones. Victim: latest arrival."""

    name = "fcfs"

    def __init__(self) -> None:
        super().__init__()

    def key(self, request: Request, preempted: bool) -> tuple:
        return fcfs_key(request, preempted)
