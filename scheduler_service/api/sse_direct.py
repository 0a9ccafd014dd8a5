"""A streamed response's common chunk written to the client's socket where its output arrives.

A streamed HTTP response is a task: it waits on the request's queue, formats each output as a
server-sent event and hands it to Starlette, which passes it through the middlewares' send
wrappers to uvicorn, which frames it and writes it. At stream_interval 1 that is one task wake-up
and one trip through four layers per token and stream, twice what the socket write itself costs
(docs/benchmarks.md, "What a streamed HTTP chunk costs at the least").

`DirectSse` is the request's queue with one shortcut: an output that does not end its sample,
arriving while the response task waits with nothing queued and the socket has taken everything
written so far, is held, and written to the socket as soon as the code that delivered it yields
to the loop: formatted by the response's own code, framed as uvicorn frames a chunk, with any
more outputs that came meanwhile merged into it (`_Writes`). Every other output (the last of
each sample, anything arriving while the task is busy or the client is behind) goes through the
queue and the task, in order: a slow reader's outputs still merge (api/streams.py
take_waiting), a disconnect still cancels the task and aborts the request, and the bytes on the
wire are the same.

The socket is uvicorn's, found from the `send` it passed to the app (`KeepServerSend` keeps it in
the scope). `--no-sse-direct-writes` (SchedulerConfig.no_sse_direct_writes) turns it off. Where
the server is not uvicorn's httptools cycle with chunked framing (another server, h11, HTTP/1.0,
a test's in-process transport), `writer_of` finds none and every output takes the task's path.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Callable, Mapping, Optional

from scheduler_service.api.streams import merged
from scheduler_service.core.request import RequestOutput
from scheduler_service.text.outputs import merge

# The scope key of the `send` uvicorn passed to the app (before any middleware wrapped it).
SERVER_SEND = "planserve.server_send"


class KeepServerSend:
    """ASGI app wrapper, outermost: keeps the server's own `send` in the scope."""

    def __init__(self, app: Callable[..., Any]):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and hasattr(send, "__self__"):
            # Weakly: the scope is the server's request cycle's own, and a strong reference
            # back to its send would keep every finished cycle (and its transport) for the GC.
            scope[SERVER_SEND] = weakref.WeakMethod(send)
        await self.app(scope, receive, send)


def writer_of(scope: Mapping[str, Any]) -> Optional[asyncio.WriteTransport]:
    """The socket a started HTTP/1.1 response streams its chunked body to, or None where the
    server is not uvicorn's httptools protocol framing this response in chunks."""
    kept = scope.get(SERVER_SEND)
    cycle = getattr(kept() if kept is not None else None, "__self__", None)
    if cycle is None or scope.get("http_version") != "1.1":
        return None
    if getattr(cycle, "chunked_encoding", None) is not True:
        return None  # not started, not chunked, or not httptools' cycle (h11 frames its own)
    if not getattr(cycle, "response_started", False) or getattr(cycle, "response_complete", True):
        return None
    transport = getattr(cycle, "transport", None)
    return transport if isinstance(transport, asyncio.WriteTransport) else None


def _sample_of(output: RequestOutput) -> int:
    return output.index


class _Writes:
    """The sinks holding outputs to write, written together once the code that delivered them
    yields to the loop. A frontend that fell behind reads every step message waiting on its link
    in one go, so a stream gets one chunk for all of them, as a response task that fell behind
    takes its outputs merged (api/streams.py take_waiting)."""

    def __init__(self):
        self._sinks: list["DirectSse"] = []
        self._due_on: Optional[asyncio.AbstractEventLoop] = None  # the loop that will write

    def add(self, sink: "DirectSse") -> None:
        loop = asyncio.get_running_loop()
        if self._due_on is not loop:  # (a loop closed before it wrote never will)
            self._due_on = loop
            loop.call_soon(self.write)
        self._sinks.append(sink)

    def write(self) -> None:
        self._due_on = None
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.write_pending()


_WRITES = _Writes()


class DirectSse(asyncio.Queue):
    """A streamed response's output queue (Request.outputs) that writes the common chunk itself.

    `render(output)` is the chunk text the response would send for an output that does not end
    its sample ("" for one it would skip); the last output of a sample always goes to the task.
    """

    def __init__(self, render: Callable[[RequestOutput], str]):
        super().__init__()
        self._render = render
        self._transport: Optional[asyncio.WriteTransport] = None
        self._task_waits = False  # the response task waits in get(), everything before it sent
        self._pending: list[RequestOutput] = []  # to write when the delivering code yields
        self.num_written = 0  # chunks written here, not by the task

    def take_over(self, queue: asyncio.Queue) -> "DirectSse":
        """Takes the outputs already in the request's first queue, in order."""
        while not queue.empty():
            super().put_nowait(queue.get_nowait())
        return self

    def attach(self, transport: Optional[asyncio.WriteTransport]) -> None:
        """The socket to write to (writer_of), once the response's head went out."""
        self._transport = transport

    def put_nowait(self, item: Any) -> None:
        transport = self._transport
        if (
            self._task_waits
            and transport is not None
            and isinstance(item, RequestOutput)
            and item.finish_reason is None
            and self.empty()
            and transport.get_write_buffer_size() == 0  # the client keeps up: nothing to merge
            and not transport.is_closing()
        ):
            if not self._pending:
                _WRITES.add(self)
            self._pending.append(item)
            return
        self.write_pending()  # what waits goes first
        super().put_nowait(item)

    def write_pending(self) -> None:
        """Writes the outputs held, each sample's merged into one chunk, in one socket write."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        transport = self._transport
        if transport is None or transport.is_closing():
            return  # the client is gone: its response task is cancelled, its request aborted
        framed = []
        for output in merged(pending, _sample_of, merge):
            text = self._render(output)
            if text:
                data = text.encode()
                framed.append(b"%x\r\n%s\r\n" % (len(data), data))
        if framed:
            transport.write(framed[0] if len(framed) == 1 else b"".join(framed))
            self.num_written += len(framed)

    async def get(self) -> Any:
        self._task_waits = True
        try:
            return await super().get()
        finally:
            self._task_waits = False
