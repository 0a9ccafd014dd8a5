"""The waiting queue. First come, first served; preempted requests go back to the front.

Other orders (priority, shortest job, deadline, per-tenant fairness) come as policy plugins
behind this same small interface.
"""
from __future__ import annotations

import collections
from typing import Iterator, Optional

from scheduler_service.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._requests: collections.deque[Request] = collections.deque()

    def add(self, request: Request) -> None:
        self._requests.append(request)

    def add_preempted(self, request: Request) -> None:
        """A preempted request resumes before every request that has not started yet."""
        self._requests.appendleft(request)

    def peek(self) -> Optional[Request]:
        return self._requests[0] if self._requests else None

    def pop(self) -> Request:
        return self._requests.popleft()

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)
