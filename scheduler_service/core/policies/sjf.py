"""Shortest job first, with aging so that long requests do not starve."""

from __future__ import annotations

from scheduler_service.core.policies._heap import HeapPolicy, waiting_order
from scheduler_service.core.policies.base import register
from scheduler_service.core.request import Request


def remaining_tokens(request: Request) -> int:
    """Tokens still to compute (the prompt, and generated tokens a preemption dropped) plus
    tokens still to generate: the work left, in tokens, if it runs to max_new_tokens."""
    to_generate = max(0, request.stopping.max_new_tokens - len(request.output_token_ids))
    return request.num_tokens_to_compute + to_generate


@register
class SJFPolicy(HeapPolicy):
    """Shortest remaining work first, aged by `aging_tokens_per_s` per second of waiting.

    The effective size of a request at time `now` is

        remaining_tokens - aging_tokens_per_s * (now - arrival_time)

    Every waiting request ages at the same rate, so the `now` terms cancel when two requests
    are compared: the order is that of the fixed key

        remaining_tokens + aging_tokens_per_s * arrival_time

    which a heap keeps in O(log n) per operation, with no scan at `peek`. (remaining_tokens
    does not change while a request waits.) A request that has waited `s` seconds overtakes
    fresh ones up to `aging_tokens_per_s * s` tokens shorter, so nothing starves; rate 0 is
    pure SJF. Exact ties: preempted first, then waiting_order (first-token target, arrival).
    """

    name = "sjf"

    def __init__(self, *, aging_tokens_per_s: float = 100.0) -> None:
        if not aging_tokens_per_s >= 0:
            raise ValueError(f"aging_tokens_per_s must be >= 0, got {aging_tokens_per_s}")
        super().__init__()
        self.aging_tokens_per_s = float(aging_tokens_per_s)

    def key(self, request: Request, preempted: bool) -> tuple:
        size = remaining_tokens(request) + self.aging_tokens_per_s * request.arrival_time
        return (size, 0 if preempted else 1, *waiting_order(request))

    def effective_size(self, request: Request, now: float) -> float:
        """The aged size at `now` (for logs and tests; the order does not need it)."""
        return remaining_tokens(request) - self.aging_tokens_per_s * (now - request.arrival_time)
