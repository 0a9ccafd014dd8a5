"""What every door does with a request's outputs, in one place.

A request with n samples ends when each sample has had its final output. Until then a door
reads its outputs; a door that stops reading early (the client cancelled or disconnected, the
handler was cancelled) aborts what is left, which frees its blocks within one step. `Outstanding`
keeps that rule for a stream of many requests (Session); `outputs_of` is the same for one
request (Generate, the HTTP API's streamed and whole responses) and `outputs_of_each` for
several side by side (a completion's prompts); `Collected` gathers a request's
outputs per sample for the doors that answer once (the HTTP API's whole responses, the offline
LLM), `unless_disconnected` aborts an HTTP door's whole answer when its client goes, and
`EventStream` is the HTTP doors' streamed answer, cancelled when its client goes.

A reader that fell behind (its last chunk was still being written when the next steps' outputs
came) takes everything waiting at once, each sample's outputs merged into one chunk
(`take_waiting`): a client that keeps up gets one chunk per output (stream_interval exact), one
that does not gets fewer, larger chunks instead of a backlog, and the server writes one message
instead of several. Only a reader that stops reading entirely fills a bounded buffer
(overload.StreamBuffer) and is cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any, AsyncGenerator, Awaitable, Callable, Hashable, Optional, cast

from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from scheduler_service.api.admission import Rejected
from scheduler_service.api.openai_errors import ApiError
from scheduler_service.api.overload import Overflowed
from scheduler_service.core.request import FinishReason, Request, RequestOutput, TokenLogprob
from scheduler_service.engine.frontend import EngineFrontend
from scheduler_service.text.outputs import merge

# How finish reasons read in OpenAI's responses (and vLLM's offline API); the others are their
# lowercased names.
_OPENAI_FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
}


def finish_reason_name(reason: Optional[FinishReason]) -> Optional[str]:
    if reason is None:
        return None
    return _OPENAI_FINISH_REASONS.get(reason, reason.name.lower())


class Outstanding:
    """The requests a stream still waits on, with how many of their samples have not ended."""

    def __init__(self, frontend: EngineFrontend):
        self._frontend = frontend
        self._samples_left: dict[str, int] = {}

    def add(self, request: Request) -> None:
        """Queues the request on the frontend; its outputs are counted from now on."""
        self._samples_left[request.request_id] = request.n
        self._frontend.add_request(request)

    def count(self, request: Request, output: RequestOutput) -> None:
        """Counts an output the stream received: a final one ends its sample."""
        if output.finish_reason is None:
            return
        self._samples_left[request.request_id] -= 1
        if not self._samples_left[request.request_id]:
            del self._samples_left[request.request_id]

    def forget(self, request: Request) -> None:
        """The engine side refused the request (a frontend process's core): nothing to wait on."""
        self._samples_left.pop(request.request_id, None)

    def __bool__(self) -> bool:
        return bool(self._samples_left)

    def abort_all(self) -> None:
        """The stream ends with requests in flight: abort them (their blocks go next step)."""
        for request_id in self._samples_left:
            self._frontend.abort_request(request_id)


class StreamCut(Exception):
    """A bounded stream buffer (overload.StreamBuffer) the client stopped reading: its requests
    were aborted; the door ends the call with RESOURCE_EXHAUSTED and this message."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def take_waiting(
    first: object,
    queue: asyncio.Queue,
    key: Callable[[Any], Optional[Hashable]],
    combine: Callable[[Any, Any], Any],
) -> list:
    """`first` and every item already waiting in `queue`, in order, with items of equal `key`
    (one sample of one request; None: never merged, e.g. a marker) combined into the first of
    them. Per sample the order is kept; items of other samples may move ahead of a later one,
    which no client can tell (samples are independent streams)."""
    items = [first]
    while not queue.empty():
        items.append(queue.get_nowait())
    return merged(items, key, combine)


def merged(
    items: list, key: Callable[[Any], Optional[Hashable]], combine: Callable[[Any, Any], Any]
) -> list:
    """`items` in order, with items of equal `key` (None: never merged) combined into the first
    of them (take_waiting's rule)."""
    if len(items) == 1:  # the common case (a reader that keeps up): nothing to merge
        return items
    taken: list = []
    at: dict[Hashable, int] = {}
    for item in items:
        k = key(item)
        where = at.get(k) if k is not None else None
        if where is None:
            if k is not None:
                at[k] = len(taken)
            taken.append(item)
        else:
            taken[where] = combine(taken[where], item)
    return taken


def _sample_of(item: object) -> Optional[int]:
    return item.index if isinstance(item, RequestOutput) else None


async def outputs_of(
    frontend: EngineFrontend, request: Request
) -> AsyncGenerator[RequestOutput, None]:
    """Queues `request` (on the first read, so a client gone before leaves nothing behind) and
    yields its outputs until every sample has ended; stopping early aborts it. A bounded buffer
    the client stopped reading raises StreamCut; the engine core's refusal of the add (behind
    frontend processes) raises its Rejected."""
    outputs = cast(asyncio.Queue, request.outputs)  # a queue of the door's: it reads it
    outstanding = Outstanding(frontend)
    outstanding.add(request)
    try:
        while outstanding:
            for output in take_waiting(await outputs.get(), outputs, _sample_of, merge):
                if isinstance(output, Overflowed):
                    raise StreamCut(output.message)
                if isinstance(output, Rejected):  # the engine core's refusal (placed())
                    outstanding.forget(request)
                    raise output
                outstanding.count(request, output)
                yield output
    finally:
        outstanding.abort_all()


async def outputs_of_each(
    frontend: EngineFrontend, requests: list[Request]
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """The outputs of several requests (a completion's prompts) as they come, each with its
    request's position in `requests`, until every one has ended: `outputs_of` for each, read
    side by side; stopping early, or a failure of any, aborts all that are left."""
    together: asyncio.Queue = asyncio.Queue()

    async def read(position: int, request: Request) -> None:
        try:
            async with contextlib.aclosing(outputs_of(frontend, request)) as outputs:
                async for output in outputs:
                    together.put_nowait((position, output))
        except Exception as error:  # (a cancel ends the read: outputs_of aborts it)
            together.put_nowait((position, error))
        else:
            together.put_nowait((position, None))

    reads = [asyncio.ensure_future(read(p, request)) for p, request in enumerate(requests)]
    try:
        left = len(reads)
        while left:
            position, item = await together.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield position, item
    finally:
        for task in reads:
            task.cancel()
        await asyncio.gather(*reads, return_exceptions=True)


async def placed(frontend: EngineFrontend, request: Request) -> None:
    """Behind frontend processes, adds `request` now and waits for the engine core's answer:
    Rejected as admission words it when the core's live queue has no room for it (the door's
    snapshot of the queue lags; the core owns its bounds). A door that must answer before it
    reads any output (an HTTP response's status) calls it after admission; in the scheduler
    process admission already checked the live queue and the request is added on the first read
    (outputs_of), so nothing happens here."""
    place = getattr(frontend, "placed", None)
    if place is not None:
        await place(request)


async def refreshed(frontend: EngineFrontend) -> None:
    """Behind frontend processes, the engine core's figures now instead of its last snapshot,
    for the doors that report them (/load, GetServerStatus); in the scheduler process they are
    live already."""
    refresh = getattr(frontend, "refresh", None)
    if refresh is not None:
        await refresh()


@dataclasses.dataclass
class Sample:
    """One sample's outputs, gathered."""

    texts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    # With prompt logprobs asked for: the request's, on its sample 0 (whose first output has them).
    prompt_logprobs: Optional[list[TokenLogprob]] = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


class Collected:
    """A request's outputs gathered per sample (index 0 .. n-1)."""

    def __init__(self, n: int):
        self.samples = [Sample() for _ in range(n)]

    def add(self, output: RequestOutput) -> None:
        sample = self.samples[output.index]
        sample.texts.append(output.text)
        sample.token_ids.extend(output.token_ids)
        sample.logprobs.extend(output.logprobs or ())
        if output.prompt_logprobs is not None:
            sample.prompt_logprobs = output.prompt_logprobs
        if output.finish_reason is not None:
            sample.finish_reason = output.finish_reason


async def _disconnected(http: HttpRequest) -> None:
    """Returns when the client disconnects (the body was already read)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(http: HttpRequest, answer: Awaitable[Any]) -> Any:
    """The whole answer's result; its request aborted (499) if the client disconnects first."""
    collect = asyncio.ensure_future(answer)
    watch = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():  # the client went away (or this handler was cancelled)
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collect
    if collect.cancelled():
        raise ApiError(499, "client closed the request", "cancelled")
    return collect.result()


class LastEvents(str):
    """An answer's last events (its final chunk, usage, [DONE]): EventStream sends them with the
    end of the body, one socket write where there were three."""


class EventStream(StreamingResponse):
    """A streamed answer of server-sent events (text/event-stream, never cached or buffered by
    a proxy), cancelled when its client disconnects: its generator's `aclosing` then aborts the
    request.

    Starlette's StreamingResponse watches for the disconnect in an anyio task group, whose cancel
    scope and second task cost each streamed request more than its admission's own checks
    (docs/benchmarks.md); here the watch is a plain task that cancels the answer's."""

    def __init__(self, content: Any):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def stream_response(self, send) -> None:
        """Starlette's, except that `LastEvents` goes out with the body's end, in one write."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        ended = False
        async for events in self.body_iterator:
            if ended:
                raise RuntimeError("an event stream yielded after its LastEvents")
            ended = isinstance(events, LastEvents)
            body = events.encode() if isinstance(events, str) else bytes(events)
            await send({"type": "http.response.body", "body": body, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        spec = scope.get("asgi", {}).get("spec_version", "2.0")
        if scope["type"] != "http" or tuple(map(int, spec.split("."))) >= (2, 4):
            return await super().__call__(scope, receive, send)  # (a disconnect raises there)
        answer = asyncio.current_task()
        assert answer is not None
        gone = False

        def on_disconnect(watch: asyncio.Future) -> None:
            nonlocal gone
            if not watch.cancelled():
                gone = True
                answer.cancel()

        watch = asyncio.ensure_future(self.listen_for_disconnect(receive))
        watch.add_done_callback(on_disconnect)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone or answer.uncancel() > 0:
                raise  # cancelled from elsewhere too (the server stopping)
        finally:
            watch.remove_done_callback(on_disconnect)
            watch.cancel()
        if self.background is not None:
            await self.background()
