"""Strict priority: a higher `Request.priority` goes first, and may preempt lower ones."""

from __future__ import annotations

from typing import Sequence

from scheduler_service.core.policies._heap import HeapPolicy, waiting_order
from scheduler_service.core.policies.base import register
from scheduler_service.core.request import Request


@register
class PriorityPolicy(HeapPolicy):
    """Higher priority first, then arrival; preempts running work of lower priority.

    Order key: (-priority, 0 if preempted else 1, waiting_order), so a preempted request goes
    ahead of fresh requests of its own priority but never ahead of a higher one, and a
    first-token target orders requests within a priority. Victim: the lowest priority, latest
    arrival among them.
    """

    name = "priority"

    def __init__(self) -> None:
        super().__init__()

    def key(self, request: Request, preempted: bool) -> tuple:
        return (-request.priority, 0 if preempted else 1, *waiting_order(request))

    def select_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (-r.priority, r.arrival_time, r.request_id))

    def may_preempt_for(self, waiting: Request, victim: Request) -> bool:
        # Strictly lower only: preempting an equal priority would let two requests evict each
        # other back and forth.
        return victim.priority < waiting.priority
