"""The public GenerationService: a thin async servicer over admission and the engine frontend.

Errors map to status codes here and only here. Every stream ends with a final chunk or a
status; a cancelled call aborts its request, which frees its blocks within one step.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, NoReturn, Optional

import grpc

from planserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_service.api import overload
from scheduler_service.api.admission import Admission, Rejected, Serving
from scheduler_service.api.grpc_chat import ChatChunks, ChatDoor
from scheduler_service.api.streams import (
    Outstanding,
    StreamCut,
    outputs_of,
    refreshed,
    take_waiting,
)
from scheduler_service.config import SchedulerConfig
from scheduler_service.core.lora_registry import LoraError
from scheduler_service.core.request import Request, RequestOutput
from scheduler_service.engine.frontend import EngineFrontend
from scheduler_service.text import outputs


async def _abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, trailing_metadata=()
) -> NoReturn:
    """context.abort, typed as what it does: it raises, and the call ends with this status."""
    await context.abort(code, message, trailing_metadata)
    raise AssertionError("grpc's context.abort returned")


def _chunk(
    req: Request, output: RequestOutput, chat: Optional[ChatChunks]
) -> generate_pb2.GenerateResponse:
    """An output as the chunk the client gets (split by the request's chat state, if any)."""
    return chat.to_pb(req, output) if chat is not None else outputs.to_pb(req, output)


class _Tagged:
    """A request's output sink on a Session: everything the request (and its parallel samples)
    produces goes to the stream's one queue, tagged with the request (and its chat state)."""

    def __init__(self, request: Request, sink: asyncio.Queue, chat: Optional[ChatChunks]):
        self._request = request
        self._sink = sink
        self._chat = chat

    def put_nowait(self, output: RequestOutput) -> None:
        self._sink.put_nowait((self._request, output, self._chat))


def _sample_of(item: object) -> Optional[tuple[int, int]]:
    """A Session's merge key: the (request, sample) of a tagged output; None for the rest."""
    if isinstance(item, tuple) and isinstance(item[1], RequestOutput):
        return id(item[0]), item[1].index
    return None  # a marker, an error, a request's refusal


def _merge_tagged(first: tuple, then: tuple) -> tuple:
    return first[0], outputs.merge(first[1], then[1]), first[2]


def _session_error(
    request_id: str, code: grpc.StatusCode, message: str
) -> generate_pb2.SessionResponse:
    """A request's refusal on a Session: the stream goes on."""
    return generate_pb2.SessionResponse(
        error=generate_pb2.SessionError(request_id=request_id, code=code.value[0], message=message)
    )


# LoraError kinds (core/lora_registry.py) as gRPC status codes.
_LORA_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "conflict": grpc.StatusCode.ALREADY_EXISTS,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}


class GenerationServicer(generate_pb2_grpc.GenerationServiceServicer):
    def __init__(self, admission: Admission, config: Optional[SchedulerConfig] = None):
        """config: the tool settings' source, when not the admission's (tests serve one
        engine through doors with different parsers, as OpenAIApp's)."""
        self.admission = admission
        self._max_buffered = admission.config.max_stream_buffer_chunks
        # Tools and reasoning output (grpc_chat.py).
        self._chat = ChatDoor(config or admission.config)

    @property
    def serving(self) -> Optional[Serving]:
        """Set once the engine answered Describe."""
        return self.admission.serving

    async def _serving(self, context: grpc.aio.ServicerContext) -> Serving:
        serving = self.admission.serving
        if serving is None:
            await _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "the model service has not answered Describe yet",
            )
        return serving

    async def _admit(
        self, pb: generate_pb2.GenerateRequest
    ) -> tuple[Request, Optional[ChatChunks]]:
        """Admits a request of either door, its tools rendered first; Rejected says why not."""
        serving = self.admission.serving
        assert serving is not None  # both doors answered UNAVAILABLE before it was set
        pb, plan, reasoning = self._chat.prepare(pb, serving.tokenizer)
        try:
            req = await self.admission.admit(pb, reasoning)
        except Rejected as rejected:
            raise self._chat.reworded(rejected, plan) from None
        return req, self._chat.chunks(req, plan, reasoning)

    async def _overflowed(self, context: grpc.aio.ServicerContext, message: str) -> NoReturn:
        self.admission.count_rejection("stream_buffer_full")
        await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        frontend = (await self._serving(context)).frontend
        try:
            req, chat = await self._admit(request)
        except Rejected as rejected:
            await _abort(context, rejected.code, rejected.message, rejected.trailing_metadata)
        req.outputs = overload.StreamBuffer(
            self._max_buffered, lambda: frontend.abort_request(req.request_id)
        )
        # aclosing: a client gone mid-stream aborts the request now, not when collected.
        try:
            async with contextlib.aclosing(outputs_of(frontend, req)) as stream:
                async for output in stream:
                    yield _chunk(req, output, chat)
        except StreamCut as cut:
            await self._overflowed(context, cut.message)
        except Rejected as rejected:  # the engine core's, behind frontend processes
            await _abort(context, rejected.code, rejected.message, rejected.trailing_metadata)

    async def Session(
        self, request_iterator, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.SessionResponse]:
        """Requests and aborts in, chunks and per-request errors out, on one stream. A reader
        task takes the client's messages; this coroutine writes everything the requests
        produce, in the order produced, until the client is done and every request ended."""
        frontend = (await self._serving(context)).frontend
        outstanding = Outstanding(frontend)  # in-flight requests of this stream
        sink = overload.StreamBuffer(
            self._max_buffered, outstanding.abort_all, _sample_of, _merge_tagged
        )
        done_reading = object()
        reader = asyncio.ensure_future(
            self._read_session(request_iterator, frontend, outstanding, sink, done_reading)
        )
        reading = True
        try:
            while reading or outstanding:
                for item in take_waiting(await sink.get(), sink, _sample_of, _merge_tagged):
                    if item is done_reading:
                        reading = False
                    elif isinstance(item, overload.Overflowed):
                        await self._overflowed(context, item.message)
                    elif isinstance(item, generate_pb2.SessionResponse):
                        yield item
                    elif isinstance(item[1], Rejected):  # the engine core's (frontends)
                        outstanding.forget(item[0])
                        yield _session_error(item[0].request_id, item[1].code, item[1].message)
                    else:
                        req, output, chat = item
                        yield generate_pb2.SessionResponse(chunk=_chunk(req, output, chat))
                        outstanding.count(req, output)
        finally:
            reader.cancel()
            outstanding.abort_all()  # the client went away: free their blocks

    async def _read_session(
        self,
        request_iterator,
        frontend: EngineFrontend,
        outstanding: Outstanding,
        sink: asyncio.Queue,
        done: object,
    ) -> None:
        """A Session's reader: admits its requests (a refusal is an error on the stream, which
        goes on) and applies its aborts; puts `done` in the sink when the client is done."""

        def error(request_id: str, code: grpc.StatusCode, message: str) -> None:
            sink.put_nowait(_session_error(request_id, code, message))

        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "generate":
                    pb = message.generate
                    if not pb.request_id:
                        error(
                            "",
                            grpc.StatusCode.INVALID_ARGUMENT,
                            "request_id: must be set on a Session",
                        )
                        continue
                    try:
                        req, chat = await self._admit(pb)
                    except Rejected as rejected:
                        error(pb.request_id, rejected.code, rejected.message)
                        continue
                    req.outputs = _Tagged(req, sink, chat)
                    outstanding.add(req)
                elif kind == "abort":
                    request_id = message.abort.request_id
                    if not frontend.abort_request(request_id):
                        error(
                            request_id,
                            grpc.StatusCode.NOT_FOUND,
                            f"request_id: no request {request_id!r} in flight",
                        )
        finally:
            sink.put_nowait(done)

    async def Abort(
        self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.AbortResponse:
        serving = await self._serving(context)
        # In a frontend process (scheduler_service/frontends) the request may be another
        # frontend's: the engine core answers.
        abort_anywhere = getattr(serving.frontend, "abort_anywhere", None)
        if abort_anywhere is not None:
            found = await abort_anywhere(request.request_id)
        else:
            found = serving.frontend.abort_request(request.request_id)
        if not found:
            await _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"request_id: no request {request.request_id!r} in flight",
            )
        return generate_pb2.AbortResponse()

    async def GetServerStatus(self, request, context) -> generate_pb2.GetServerStatusResponse:
        frontend = (await self._serving(context)).frontend
        await refreshed(frontend)
        scheduler = frontend.scheduler
        usable, free = scheduler.kv.num_usable_blocks, scheduler.kv.num_free_blocks
        return generate_pb2.GetServerStatusResponse(
            num_waiting=scheduler.num_waiting,
            num_running=len(scheduler.running),
            num_kv_blocks=usable,
            num_free_kv_blocks=free,
            kv_cache_usage=(usable - free) / usable if usable else 0.0,
            replicas=[generate_pb2.ReplicaStatus(**s) for s in frontend.statuses()],
        )

    async def Tokenize(
        self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.TokenizeResponse:
        await self._serving(context)
        try:
            return self.admission.tokenize(request)
        except Rejected as rejected:
            await _abort(context, rejected.code, rejected.message)

    async def Detokenize(
        self, request: generate_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.DetokenizeResponse:
        await self._serving(context)
        try:
            return self.admission.detokenize(request)
        except Rejected as rejected:
            await _abort(context, rejected.code, rejected.message)

    async def GetModelInfo(self, request, context) -> generate_pb2.GetModelInfoResponse:
        facts = (await self._serving(context)).facts
        return generate_pb2.GetModelInfoResponse(
            model_name=facts.model_name,
            dtype=facts.dtype,
            max_model_len=facts.max_model_len,
            vocab_size=facts.vocab_size,
            lora_adapters=[
                generate_pb2.LoraAdapter(name=a.name, path=a.path, rank=a.rank)
                for a in self.admission.loras.registry.adapters.values()
            ],
        )

    async def LoadLoraAdapter(
        self, request: generate_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.LoadLoraAdapterResponse:
        """Off (NOT_FOUND) unless --enable-runtime-lora; engine/lora_admin.py does the work."""
        serving = await self._serving(context)
        try:
            adapter = await self.admission.loras.load(
                serving.frontend, serving.facts, request.lora_name, request.lora_path
            )
        except LoraError as error:
            await _abort(context, _LORA_STATUS[error.kind], error.message)
        return generate_pb2.LoadLoraAdapterResponse(
            adapter=generate_pb2.LoraAdapter(
                name=adapter.name, path=adapter.path, rank=adapter.rank
            )
        )

    async def UnloadLoraAdapter(
        self, request: generate_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.UnloadLoraAdapterResponse:
        """FAILED_PRECONDITION while requests use the adapter."""
        serving = await self._serving(context)
        try:
            await self.admission.loras.unload(serving.frontend, request.lora_name)
        except LoraError as error:
            code = _LORA_STATUS[error.kind]
            if error.kind == "conflict":
                code = grpc.StatusCode.FAILED_PRECONDITION
            await _abort(context, code, error.message)
        return generate_pb2.UnloadLoraAdapterResponse()
