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

from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from scheduler_service.core.request import RequestStatus

# Trailing metadata key of the retry hint on RESOURCE_EXHAUSTED (milliseconds, decimal).
RETRY_AFTER_KEY = "retry-after-ms"
STATUS_DETAILS_KEY = "grpc-status-details-bin"
MIN_RETRY_AFTER_MS = 100
MAX_RETRY_AFTER_MS = 30_000


def retry_trailing_metadata(code, message: str, retry_after_ms: int) -> tuple:
    """The retry hint twice: `retry-after-ms` for any client, and the standard rich status
    (`grpc-status-details-bin`: a google.rpc.Status with a google.rpc.RetryInfo) that
    `grpc_status.rpc_status.from_call` and Google's client libraries read. The rich status
    repeats the call's code and message, as gRPC requires."""
    info = error_details_pb2.RetryInfo()
    info.retry_delay.FromMilliseconds(retry_after_ms)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return (
        (RETRY_AFTER_KEY, str(retry_after_ms)),
        (STATUS_DETAILS_KEY, status.SerializeToString()),
    )


def num_waiting_tokens(scheduler) -> int:
    """Tokens the waiting requests (fresh and preempted) still have to compute to be admitted."""
    return sum(
        r.num_tokens_to_compute
        for r in scheduler.requests.values()
        if r.status is RequestStatus.WAITING
    )


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

    def __init__(self, max_chunks: int, on_overflow: Callable[[], object]):
        super().__init__()
        self.max_chunks = max_chunks
        self._on_overflow = on_overflow
        self.overflowed = False

    def put_nowait(self, item) -> None:
        if self.overflowed:
            return
        if self.qsize() >= self.max_chunks:
            self.overflowed = True
            super().put_nowait(
                Overflowed(
                    f"stream buffer full: the client left {self.max_chunks} chunks unread "
                    f"(max_stream_buffer_chunks {self.max_chunks}); request aborted"
                )
            )
            self._on_overflow()
            return
        super().put_nowait(item)
