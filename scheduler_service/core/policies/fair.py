"""Per-tenant fairness by tokens served: the Virtual Token Counter (VTC).

Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Each tenant has a
counter of the service it received, in weighted tokens:

    counter[tenant] += input_weight * prompt tokens + output_weight * output tokens

(`on_scheduled`, as the plan is built: the tokens below the prompt length count as input, the
rest as output; generated tokens recomputed after a preemption count as output). The default
weights, input 1.0 and output 2.0, follow the paper's observation that a decoded token costs
more than a prefilled one (it takes a step of its own).

The next request is the first waiting request (preempted ones first, then by first-token
target and arrival: _heap.waiting_order) of the waiting tenant with the smallest counter, so a
target orders a tenant's own requests and never wins a tenant more than its share. A tenant
that had nothing waiting and gets a new request is lifted to at least the smallest counter of
the tenants that do have requests waiting (or, with none waiting, to the counter of the tenant
whose request last left the queue), so that time spent idle is not banked as credit to starve
the others later.
"""

from __future__ import annotations

import collections
from typing import Iterator, Optional, Sequence

from scheduler_service.core.policies._heap import LazyHeap, waiting_key
from scheduler_service.core.policies.base import SchedulingPolicy, register
from scheduler_service.core.request import Request


@register
class FairPolicy(SchedulingPolicy):
    """Per-tenant fairness (VTC): the tenant with the least weighted tokens served goes next.

    Options: `input_weight` (1.0) and `output_weight` (2.0), the counter cost of a prompt and
    of an output token. Victim: a running request of the tenant with the largest counter, its
    latest arrival.

    `peek` scans the tenants with waiting requests, O(tenants): counters move every step for
    every running request, so a heap of tenants would need re-keying as often as it is read.
    """

    name = "fair"

    def __init__(self, *, input_weight: float = 1.0, output_weight: float = 2.0) -> None:
        for field, value in (("input_weight", input_weight), ("output_weight", output_weight)):
            if not value >= 0:
                raise ValueError(f"{field} must be >= 0, got {value}")
        self.input_weight = float(input_weight)
        self.output_weight = float(output_weight)
        self.counters: collections.defaultdict[str, float] = collections.defaultdict(float)
        # Only tenants with at least one waiting request have a queue here.
        self._queues: dict[str, LazyHeap] = {}
        self._num_waiting = 0
        self._last_left: Optional[str] = None
        # (now, version) -> the answer, so that pop(now) returns what peek(now) did even if
        # counters moved in between; any queue change bumps the version.
        self._version = 0
        self._peeked: Optional[tuple[float, int, Request]] = None

    # ---- the waiting queue ----------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.tenant not in self._queues:
            self._lift(request.tenant)
        self._push(request, preempted=False)

    def add_preempted(self, request: Request) -> None:
        self._push(request, preempted=True)

    def put_back(self, request: Request) -> None:
        """A skipped request returns without the idle-tenant lift (it never left)."""
        self._push(request, preempted=request.num_preemptions > 0)

    def peek(self, now: float) -> Optional[Request]:
        if self._peeked is not None and self._peeked[:2] == (now, self._version):
            return self._peeked[2]
        best = None
        for tenant, queue in self._queues.items():
            key, seq, head = queue.peek_entry()  # never empty: emptied queues are dropped
            rank = (self.counters[tenant], key, seq)
            if best is None or rank < best[0]:
                best = (rank, head)
        request = None if best is None else best[1]
        self._peeked = (now, self._version, request) if request is not None else None
        return request

    def pop(self, now: float) -> Request:
        request = self.peek(now)
        if request is None:
            raise IndexError("pop from an empty queue")
        self.remove(request)
        self._last_left = request.tenant
        return request

    def remove(self, request: Request) -> None:
        queue = self._queues.get(request.tenant)
        if queue is None:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        queue.remove(request)
        if not queue:
            del self._queues[request.tenant]
        self._num_waiting -= 1
        self._version += 1

    def __len__(self) -> int:
        return self._num_waiting

    def __iter__(self) -> Iterator[Request]:
        return iter([r for queue in self._queues.values() for r in queue])

    # ---- preemption and accounting ----------------------------------------------------------

    def select_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (self.counters[r.tenant], r.arrival_time, r.request_id))

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        """Charges the tenant; call before `num_computed_tokens` advances by `num_tokens`."""
        prompt_left = max(0, len(request.prompt_token_ids) - request.num_computed_tokens)
        num_input = min(num_tokens, prompt_left)
        self.counters[request.tenant] += self.input_weight * num_input + self.output_weight * (
            num_tokens - num_input
        )

    # ---- helpers ----------------------------------------------------------------------------

    def _push(self, request: Request, preempted: bool) -> None:
        queue = self._queues.get(request.tenant)
        if queue is None:
            queue = self._queues[request.tenant] = LazyHeap()
        queue.push(request, waiting_key(request, preempted))
        self._num_waiting += 1
        self._version += 1

    def _lift(self, tenant: str) -> None:
        """VTC's rule for a tenant that becomes active: no credit for idle time."""
        if self._queues:
            floor = min(self.counters[t] for t in self._queues)
        elif self._last_left is not None:
            floor = self.counters[self._last_left]
        else:
            return
        if self.counters[tenant] < floor:
            self.counters[tenant] = floor
