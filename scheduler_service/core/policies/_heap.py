"""A heap of waiting requests with lazy removal, and the policy base for orders that are one key.

Removing from the middle of a heap is O(n), so `remove` only marks the entry dead (O(1)); dead
entries are dropped when they reach the top, and the heap is rebuilt once they outnumber the
live ones, so memory stays within twice the queue. `push`, `pop` and `peek` are O(log n)
amortised.

Each heap entry is a list `[key, seq, request]`. `seq` is unique (insertion order), so two
entries never compare their requests, and it breaks exact key ties first come, first served.
A removed entry has its request slot set to None.
"""

from __future__ import annotations

import abc
import heapq
import itertools
import math
from typing import Any, Iterator, Optional

from scheduler_service.core.policies.base import SchedulingPolicy
from scheduler_service.core.request import Request

_MIN_DEAD_TO_COMPACT = 64


class LazyHeap:
    """A min-heap of requests, each pushed with a key fixed for as long as it waits."""

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []
        # Request has eq=False, so this dict is keyed by identity.
        self._entries: dict[Request, list[Any]] = {}
        self._seq = itertools.count()
        self._num_dead = 0

    def push(self, request: Request, key: tuple) -> None:
        if request in self._entries:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        entry = [key, next(self._seq), request]
        self._entries[request] = entry
        heapq.heappush(self._heap, entry)

    def peek(self) -> Optional[Request]:
        self._drop_dead_top()
        return self._heap[0][2] if self._heap else None

    def peek_entry(self) -> tuple[tuple, int, Request]:
        """(key, seq, request) of the top, for callers that compare heads of several heaps.
        IndexError when empty (as pop)."""
        self._drop_dead_top()
        if not self._heap:
            raise IndexError("peek at an empty queue")
        key, seq, request = self._heap[0]
        return key, seq, request

    def pop(self) -> Request:
        self._drop_dead_top()
        if not self._heap:
            raise IndexError("pop from an empty queue")
        request = heapq.heappop(self._heap)[2]
        del self._entries[request]
        return request

    def remove(self, request: Request) -> None:
        entry = self._entries.pop(request, None)
        if entry is None:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        entry[2] = None
        self._num_dead += 1
        if self._num_dead > _MIN_DEAD_TO_COMPACT and self._num_dead > len(self._entries):
            self._heap = list(self._entries.values())
            heapq.heapify(self._heap)
            self._num_dead = 0

    def entries(self) -> Iterator[tuple[tuple, int, Request]]:
        """(key, seq, request) of every waiting request, in no particular order."""
        for key, seq, request in self._entries.values():
            yield key, seq, request

    def _drop_dead_top(self) -> None:
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
            self._num_dead -= 1

    def __contains__(self, request: Request) -> bool:
        return request in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._entries))


def waiting_order(request: Request) -> tuple[float, float]:
    """The order among waiting requests a policy ranks equal: the earliest first-token target
    (`Request.first_token_due`: arrival + ttft_target_ms, the gateway's x-slo-ttft-ms) first,
    requests without a target after every one with a target, arrival order within each. With no
    targets this is arrival order. Every built-in ends its key with it, so a target orders
    requests within a priority (and within a tenant under `fair`), never across them."""
    due = request.first_token_due
    return (math.inf if due is None else due, request.arrival_time)


def waiting_key(request: Request, preempted: bool) -> tuple:
    """Preempted requests first (they hold generated tokens and were admitted once), then
    `waiting_order`."""
    return (0 if preempted else 1, *waiting_order(request))


class HeapPolicy(SchedulingPolicy):
    """A policy whose order is one key per request, fixed while it waits: a `LazyHeap`.

    Subclasses define `key(request, preempted)`; the smallest key goes first.
    """

    def __init__(self) -> None:
        self._queue = LazyHeap()

    @abc.abstractmethod
    def key(self, request: Request, preempted: bool) -> tuple:
        """The sort key; `preempted` is True for a request that came back by `add_preempted`."""

    def add(self, request: Request) -> None:
        self._queue.push(request, self.key(request, preempted=False))

    def add_preempted(self, request: Request) -> None:
        self._queue.push(request, self.key(request, preempted=True))

    def peek(self, now: float) -> Optional[Request]:
        return self._queue.peek()

    def pop(self, now: float) -> Request:
        return self._queue.pop()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
