"""Longest prefix match first: the request with the most prompt tokens already cached."""

from __future__ import annotations

from typing import Callable, Iterator, Optional

from scheduler_service.core.policies._heap import LazyHeap, waiting_key
from scheduler_service.core.policies.base import SchedulingPolicy, register
from scheduler_service.core.request import Request


@register
class LPMPolicy(SchedulingPolicy):
    """Longest cached prefix first (ties by waiting order); FCFS when more than `max_scan` wait.

    `prefix_match_len(request)` (passed by the scheduler) says how many prompt tokens the block
    pool has cached for a request. Cached blocks come and go, so the match is asked afresh at
    every `peek`: a scan of the whole queue, O(n) calls. Past `max_scan` (128) waiting requests
    that costs too much per step and the policy falls back to FCFS, as SGLang does. Admitting
    requests that share a cached prefix back to back keeps that prefix from being evicted.
    """

    name = "lpm"

    def __init__(self, *, prefix_match_len: Callable[[Request], int], max_scan: int = 128) -> None:
        if not callable(prefix_match_len):
            raise TypeError(f"prefix_match_len must be callable, got {prefix_match_len!r}")
        if max_scan < 0:
            raise ValueError(f"max_scan must be >= 0, got {max_scan}")
        self.prefix_match_len = prefix_match_len
        self.max_scan = max_scan
        self._queue = LazyHeap()  # in FCFS order: the fallback, and the tie-break
        # (now, version) -> the answer, so that pop(now) returns what peek(now) did even if
        # the cache changed in between (the scheduler allocates between the two).
        self._version = 0
        self._peeked: Optional[tuple[float, int, Request]] = None

    def add(self, request: Request) -> None:
        self._queue.push(request, waiting_key(request, preempted=False))
        self._version += 1

    def add_preempted(self, request: Request) -> None:
        self._queue.push(request, waiting_key(request, preempted=True))
        self._version += 1

    def peek(self, now: float) -> Optional[Request]:
        if self._peeked is not None and self._peeked[:2] == (now, self._version):
            return self._peeked[2]
        if len(self._queue) > self.max_scan:
            request = self._queue.peek()
        else:
            best = None
            for key, seq, candidate in self._queue.entries():
                rank = (-self.prefix_match_len(candidate), key, seq)
                if best is None or rank < best[0]:
                    best = (rank, candidate)
            request = None if best is None else best[1]
        self._peeked = (now, self._version, request) if request is not None else None
        return request

    def pop(self, now: float) -> Request:
        request = self.peek(now)
        if request is None:
            raise IndexError("pop from an empty queue")
        self.remove(request)
        return request

    def remove(self, request: Request) -> None:
        self._queue.remove(request)
        self._version += 1

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
