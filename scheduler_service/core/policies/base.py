"""The policy interface: the order of the waiting queue, who is preempted, who may be admitted.

A policy owns the waiting queue (so that each can keep the structure its order needs: a deque,
a heap, per-tenant queues) and answers three questions for the scheduler:

  * which waiting request goes next (`peek` / `pop`);
  * which running request gives way when blocks or slots run out (`select_victim`), and
    whether a waiting request is worth preempting a running one for (`may_preempt_for`);
  * optionally, whether to hold back a request that would fit (`admission_veto`).

A request may carry a first-token target (`Request.first_token_due`, from ttft_target_ms or a
trusted x-slo-ttft-ms). Every built-in ranks first by its own rule (priority, deadline, tenant
share, size, cached prefix) and then by `_heap.waiting_order`: earliest target first, requests
without one after, arrival within each. So the target composes below priority and fairness,
and it only orders: nothing is ended or refused for missing it.

The scheduler tells the policy what happened (`on_scheduled`, `on_finished`) so that stateful
orders (per-tenant fairness) can keep their counters. Every method runs on the event loop
thread, once per request per step at most; none may block.
"""

from __future__ import annotations

import abc
from typing import Iterator, Optional, Sequence

from scheduler_service.core.request import Request
from scheduler_service.registry import Registry


class SchedulingPolicy(abc.ABC):
    #: The name the registry knows the policy by (`--policy NAME`).
    name: str = ""

    # ---- the waiting queue ----------------------------------------------------------------

    @abc.abstractmethod
    def add(self, request: Request) -> None:
        """A new request arrives."""

    @abc.abstractmethod
    def add_preempted(self, request: Request) -> None:
        """A preempted request comes back; it goes ahead of fresh requests of equal rank."""

    @abc.abstractmethod
    def peek(self, now: float) -> Optional[Request]:
        """The request to admit next, without removing it; None when empty."""

    @abc.abstractmethod
    def pop(self, now: float) -> Request:
        """Removes and returns what `peek(now)` returned."""

    @abc.abstractmethod
    def remove(self, request: Request) -> None:
        """Removes a waiting request (aborted, or its deadline passed)."""

    def put_back(self, request: Request) -> None:
        """A request popped in this step and not admitted (skipped for its LoRA adapter,
        core/lora_admission.py) returns to its place. Default: added again as it came (a
        preempted one ahead of fresh ones); a policy whose `add` changes state overrides it."""
        if request.num_preemptions:
            self.add_preempted(request)
        else:
            self.add(request)

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in no particular order."""

    # ---- preemption -----------------------------------------------------------------------

    def select_victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when blocks run out. Default: the latest arrival."""
        return max(running, key=lambda r: (r.arrival_time, r.request_id))

    def may_preempt_for(self, waiting: Request, victim: Request) -> bool:
        """Whether `victim` (running) may be preempted so that `waiting` can be admitted.

        Default: never; only ranks that outrank running work (priority) say yes.
        """
        return False

    # ---- optional hooks -------------------------------------------------------------------

    def admission_veto(self, request: Request, running: Sequence[Request]) -> bool:
        """True holds `request` back this step even though it would fit. Default: never."""
        return False

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        """`request` got `num_tokens` of this step's budget."""

    def on_finished(self, request: Request) -> None:
        """`request` left the scheduler (finished, aborted or expired)."""


# ---- the registry: `@register` puts a policy under its name (policies/__init__.py resolves) ----

POLICIES: Registry[type[SchedulingPolicy]] = Registry(
    "policy", SchedulingPolicy, "planserve.policies"
)
register = POLICIES.register
