"""The Execute stream's I/O off the event loop: plans out and results in on gRPC's threads.

On grpc.aio every write and read on the Execute stream is a completion the event loop picks up
in its turn, behind every client stream's write that is ready before it: at 256 streams the
engine loop got one result per pass over all the streams, so steps went at the pace of the
client writes, never faster, and a stream never had two steps' outputs to merge. Here the
stream is a synchronous gRPC call: `send` queues the plan for gRPC's request thread (no wait),
a reader thread takes each result as it arrives and hands it to the loop with one
call_soon_threadsafe, and `receive` returns at once when the result is already in. So the
engine loop takes every result that came in during a pass of the streams (and sends the next
plans) in one turn, and the streams that fell behind merge what they missed
(api/streams.py take_waiting).
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from typing import Optional, Union

import grpc

from planserve.v1 import engine_pb2, engine_pb2_grpc

_END = object()  # the request iterator's end: the stream is dropped


class StreamEnded(Exception):
    """The model service ended the stream (`error` None: it closed it without a status)."""

    def __init__(self, error: Optional[grpc.RpcError]):
        super().__init__(repr(error) if error is not None else "closed")
        self.error = error


_Arrival = Union[engine_pb2.ExecuteResponse, StreamEnded]


class ExecuteStream:
    """One Execute call. Results come back in the order plans were sent."""

    def __init__(self, stub: engine_pb2_grpc.EngineServiceStub):
        self._loop = asyncio.get_running_loop()
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        self._arrived: collections.deque[_Arrival] = collections.deque()
        self._waiter: Optional[asyncio.Future] = None
        self._call = stub.Execute(iter(self._plans.get, _END))
        self._reader = threading.Thread(target=self._read, name="execute-reader", daemon=True)
        self._reader.start()

    def send(self, request: engine_pb2.ExecuteRequest) -> None:
        self._plans.put(request)

    async def receive(self) -> engine_pb2.ExecuteResponse:
        """The next result; StreamEnded when the stream ended instead."""
        while not self._arrived:
            self._waiter = self._loop.create_future()
            await self._waiter
        item = self._arrived.popleft()
        if isinstance(item, StreamEnded):
            self._arrived.appendleft(item)  # every later receive ends the same way
            raise item
        return item

    def cancel(self) -> None:
        self._plans.put(_END)
        self._call.cancel()

    def _read(self) -> None:
        """The reader thread: every result, then how the stream ended, onto the loop."""
        try:
            for response in self._call:
                self._post(response)
            self._post(StreamEnded(None))
        except grpc.RpcError as error:
            self._post(StreamEnded(error))

    def _post(self, item: _Arrival) -> None:
        try:
            self._loop.call_soon_threadsafe(self._arrive, item)
        except RuntimeError:  # the loop closed (the server stopped): nobody waits
            pass

    def _arrive(self, item: _Arrival) -> None:
        self._arrived.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
