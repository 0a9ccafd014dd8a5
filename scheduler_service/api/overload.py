"""Overload protection of the public API: the waiting queue's token bound, the retry hint sent
with RESOURCE_EXHAUSTED, and the bounded per-stream output buffer of a client that stops reading.

A stream's outputs wait in its buffer until the servicer hands them to gRPC, which blocks once the
client's HTTP/2 flow-control window is full. Outputs a client has not read yet merge into one
chunk per sample, so a slow reader costs one message per read, not one per step. A client that
stops reading would still keep its request running (and its KV blocks): past `max_chunks` unread
outputs of one sample the stream's requests are aborted (their blocks are freed in the next
step) and the stream ends with RESOURCE_EXHAUSTED naming the bound, once gRPC takes the chunks
already queued.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Hashable, Optional

from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from scheduler_service.core.request import RequestOutput
from scheduler_service.text.outputs import merge

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


class _Unread:
    """A sample's outputs the client has not read yet, merged into one, and how many."""

    __slots__ = ("key", "item", "count")

    def __init__(self, key: Hashable, item: object):
        self.key, self.item, self.count = key, item, 1


def _sample_of(item: object) -> Optional[Hashable]:
    return item.index if isinstance(item, RequestOutput) else None


def _merge_outputs(first: Any, then: Any) -> Any:
    return merge(first, then)


class StreamBuffer(asyncio.Queue):
    """A stream's output queue in which a sample's unread outputs merge into one chunk (a
    client that reads slower than steps come gets fewer, larger chunks, and a Session carrying
    hundreds of requests holds one entry per request, not one per request and step). Past
    `max_chunks` unread outputs of one sample, the put calls `on_overflow` (abort the stream's
    requests) once, queues an Overflowed marker and drops everything after it.

    `key` says which items merge (equal keys: one sample of one request; None: never, e.g. a
    marker or an error) and `combine` merges two of them, the earlier first."""

    def __init__(
        self,
        max_chunks: int,
        on_overflow: Callable[[], object],
        key: Callable[[Any], Optional[Hashable]] = _sample_of,
        combine: Callable[[Any, Any], Any] = _merge_outputs,
    ):
        super().__init__()
        self.max_chunks = max_chunks
        self._on_overflow = on_overflow
        self._key = key
        self._combine = combine
        self._unread: dict[Hashable, _Unread] = {}
        self.overflowed = False

    def put_nowait(self, item) -> None:
        if self.overflowed:
            return
        key = self._key(item)
        if key is None:
            super().put_nowait(item)
            return
        unread = self._unread.get(key)
        if unread is None:
            unread = self._unread[key] = _Unread(key, item)
            super().put_nowait(unread)
        elif unread.count >= self.max_chunks:
            self.overflowed = True
            super().put_nowait(
                Overflowed(
                    f"stream buffer full: the client left {self.max_chunks} chunks unread "
                    f"(max_stream_buffer_chunks {self.max_chunks}); request aborted"
                )
            )
            self._on_overflow()
        else:
            unread.item = self._combine(unread.item, item)
            unread.count += 1

    def _get(self):
        entry = super()._get()  # asyncio.Queue's own hook
        if isinstance(entry, _Unread):
            del self._unread[entry.key]
            return entry.item
        return entry
