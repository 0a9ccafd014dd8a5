"""Overload protection of the public API: the waiting queue's token bound, the retry hint sent
with RESOURCE_EXHAUSTED, and the bounded per-stream output buffer of a client that stops reading.

A stream's outputs wait in its buffer until the servicer hands them to gRPC, which blocks once the
client's HTTP/2 flow-control window is full. A client that stops reading would otherwise make the
buffer grow by one chunk per step for as long as its request runs (and keep its KV blocks): past
`max_chunks` unread chunks the request is aborted (its blocks are freed in the next step) and the
stream ends with RESOURCE_EXHAUSTED naming the bound, once gRPC takes the chunks already queued.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from scheduler_service.request import RequestStatus

# Trailing metadata key of the retry hint on RESOURCE_EXHAUSTED (milliseconds, decimal).
RETRY_AFTER_KEY = "retry-after-ms"
MIN_RETRY_AFTER_MS = 100
MAX_RETRY_AFTER_MS = 30_000


def num_waiting_tokens(scheduler) -> int:
    """Tokens the waiting requests (fresh and preempted) still have to compute to be admitted."""
    return sum(r.num_tokens_to_compute for r in scheduler.requests.values()
               if r.status is RequestStatus.WAITING)


def retry_after_ms(num_waiting_tokens: int, tokens_per_s: float) -> int:
    """When a rejected request might get in: the time the engine needs to compute what waits, at
    the recent rate, clamped to [MIN_RETRY_AFTER_MS, MAX_RETRY_AFTER_MS]."""
    if tokens_per_s <= 0:
        return 1000
    estimate = int(1000 * num_waiting_tokens / tokens_per_s)
    return max(MIN_RETRY_AFTER_MS, min(MAX_RETRY_AFTER_MS, estimate))


class Overflowed:
    """The marker a StreamBuffer yields after the chunks it kept: end the stream."""

    def __init__(self, message: str):
        self.message = message


class StreamBuffer(asyncio.Queue):
    """An output queue holding at most `max_chunks` unread chunks. The put that would exceed it
    calls `on_overflow` (abort the stream's requests) once, queues an Overflowed marker and drops
    everything after it."""

    def __init__(self, max_chunks: int, on_overflow: Callable[[], None]):
        super().__init__()
        self.max_chunks = max_chunks
        self._on_overflow = on_overflow
        self.overflowed = False

    def put_nowait(self, item) -> None:
        if self.overflowed:
            return
        if self.qsize() >= self.max_chunks:
            self.overflowed = True
            super().put_nowait(Overflowed(
                f"stream buffer full: the client left {self.max_chunks} chunks unread "
                f"(max_stream_buffer_chunks {self.max_chunks}); request aborted"))
            self._on_overflow()
            return
        super().put_nowait(item)
