"""The public GenerationService: a thin async servicer over the engine loop.

Errors map to status codes here and only here. Every stream ends with a final chunk or a
status; a cancelled call aborts its request, which frees its blocks within one step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator, Optional

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from planserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_service.api import intake, overload, security
from scheduler_service.engine import client as engine_client
from scheduler_service.text import outputs, structured
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine.client import EngineClient, EngineFacts
from scheduler_service.engine.loop import EngineLoop
from scheduler_service.metrics import Metrics
from scheduler_service.api.openai_http import HttpServer
from scheduler_service.text.outputs import OutputProcessor
from scheduler_service.engine.replicas import ReplicaSet, is_replicated
from scheduler_service.core.request import Request, RequestOutput
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.text.tokenizer import Tokenizer

log = structlog.get_logger("planserve.scheduler")

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


class Rejected(Exception):
    """A request that is not accepted, with the status it gets."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms  # sent as trailing metadata retry-after-ms

    @property
    def trailing_metadata(self) -> tuple:
        if self.retry_after_ms is None:
            return ()
        return overload.retry_trailing_metadata(self.code, self.message, self.retry_after_ms)


class _Tagged:
    """Stands in for a request's output queue on a Session: everything the request (and its
    parallel samples) produces goes to the stream's one queue, tagged with the request."""

    def __init__(self, request: Request, sink: asyncio.Queue):
        self._request = request
        self._sink = sink

    def put_nowait(self, output: RequestOutput) -> None:
        self._sink.put_nowait((self._request, output))


@dataclasses.dataclass(frozen=True)
class Serving:
    """What the servicer needs once the model service has described itself."""

    facts: EngineFacts
    tokenizer: Tokenizer
    loop: EngineLoop
    # Structured output's grammars over the served vocabulary (compiled on demand, cached).
    grammars: Optional[structured.GrammarCompiler] = None


def _count_rejection(serving: Serving, reason: str) -> None:
    metrics = getattr(serving.loop, "metrics", None)
    if metrics is not None:
        metrics.on_rejected(reason)


class GenerationServicer(generate_pb2_grpc.GenerationServiceServicer):
    def __init__(self, config: SchedulerConfig):
        self._config = config
        self.serving: Serving | None = None  # set once the engine answered Describe
        self.draining = False  # SIGTERM: new requests get UNAVAILABLE, running ones finish

    async def _serving(self, context: grpc.aio.ServicerContext) -> Serving:
        if self.serving is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the model service has not answered Describe yet")
        return self.serving

    def _accept(self, serving: Serving, pb: generate_pb2.GenerateRequest) -> Request:
        """Validates and queues a request; `Rejected` says which status it gets instead."""
        if self.draining:
            _count_rejection(serving, "draining")
            raise Rejected(grpc.StatusCode.UNAVAILABLE,
                           "the server is draining (shutting down): send the request elsewhere")
        scheduler = serving.loop.scheduler
        try:
            request = intake.to_request(pb, serving.facts, serving.tokenizer,
                                        scheduler.kv.capacity_tokens)
        except intake.InvalidRequest as error:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        if scheduler.find(request.request_id) is not None:
            raise Rejected(grpc.StatusCode.ALREADY_EXISTS,
                           f"request_id: {request.request_id!r} is already in flight")
        if scheduler.num_waiting:
            self._check_queue_room(serving, request)
        return request

    def _check_queue_room(self, serving: Serving, request: Request) -> None:
        """RESOURCE_EXHAUSTED with a retry hint when the waiting queue is full, by requests or by
        tokens (a request arriving at an empty queue is always taken)."""
        scheduler, config = serving.loop.scheduler, self._config
        waiting_tokens = overload.num_waiting_tokens(scheduler)
        if scheduler.num_waiting >= config.max_queue_len:
            why = (f"queue full: {scheduler.num_waiting} requests waiting "
                   f"(max_queue_len {config.max_queue_len})")
        elif waiting_tokens + request.num_tokens_to_compute > config.max_queue_tokens:
            why = (f"queue full: {waiting_tokens} prompt tokens waiting + "
                   f"{request.num_tokens_to_compute} exceed max_queue_tokens "
                   f"{config.max_queue_tokens}")
        else:
            return
        retry_after_ms = overload.retry_after_ms(waiting_tokens, serving.loop.tokens_per_s)
        _count_rejection(serving, "queue_full")
        raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"{why}; retry after {retry_after_ms} ms", retry_after_ms)

    async def _compile_grammar(self, serving: Serving, req: Request) -> None:
        """Structured output: compiles the request's grammar off the event loop (outlines-core
        releases the GIL; repeats hit the cache) and gives the request its guide, before it is
        queued. Rejected (INVALID_ARGUMENT naming the field) when it does not compile."""
        if req.structured is None:
            return
        grammars = serving.grammars
        try:
            grammar = await asyncio.get_running_loop().run_in_executor(
                None, grammars.compile, req.structured)
        except structured.StructuredOutputError as error:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        req.guide = grammar.new_guide()

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[
                           generate_pb2.GenerateResponse]:
        serving = await self._serving(context)
        try:
            req = self._accept(serving, request)
            await self._compile_grammar(serving, req)
        except Rejected as rejected:
            await context.abort(rejected.code, rejected.message, rejected.trailing_metadata)
        req.outputs = overload.StreamBuffer(self._config.max_stream_buffer_chunks,
                                            lambda: serving.loop.abort_request(req.request_id))
        serving.loop.add_request(req)
        samples_left = req.n
        try:
            while samples_left:
                output = await req.outputs.get()
                if isinstance(output, overload.Overflowed):
                    _count_rejection(serving, "stream_buffer_full")
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, output.message)
                yield outputs.to_pb(req, output)
                if output.finish_reason is not None:
                    samples_left -= 1
        finally:
            if samples_left:
                # The client went away (cancel, disconnect): free its blocks next step.
                serving.loop.abort_request(req.request_id)

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[generate_pb2.SessionResponse]:
        """Requests and aborts in, chunks and per-request errors out, on one stream. A reader
        task takes the client's messages; this coroutine writes everything the requests
        produce, in the order produced, until the client is done and every request ended."""
        serving = await self._serving(context)
        samples_left: dict[str, int] = {}  # in-flight requests of this stream
        sink = overload.StreamBuffer(  # one bound for the whole stream
            self._config.max_stream_buffer_chunks,
            lambda: [serving.loop.abort_request(request_id) for request_id in samples_left])
        done_reading = object()

        def error(request_id: str, code: grpc.StatusCode, message: str) -> None:
            sink.put_nowait(generate_pb2.SessionResponse(error=generate_pb2.SessionError(
                request_id=request_id, code=code.value[0], message=message)))

        async def read() -> None:
            try:
                async for message in request_iterator:
                    kind = message.WhichOneof("kind")
                    if kind == "generate":
                        pb = message.generate
                        if not pb.request_id:
                            error("", grpc.StatusCode.INVALID_ARGUMENT,
                                  "request_id: must be set on a Session")
                            continue
                        try:
                            req = self._accept(serving, pb)
                            await self._compile_grammar(serving, req)
                        except Rejected as rejected:
                            error(pb.request_id, rejected.code, rejected.message)
                            continue
                        req.outputs = _Tagged(req, sink)
                        samples_left[req.request_id] = req.n
                        serving.loop.add_request(req)
                    elif kind == "abort":
                        request_id = message.abort.request_id
                        if not serving.loop.abort_request(request_id):
                            error(request_id, grpc.StatusCode.NOT_FOUND,
                                  f"request_id: no request {request_id!r} in flight")
            finally:
                sink.put_nowait(done_reading)

        reader = asyncio.ensure_future(read())
        reading = True
        try:
            while reading or samples_left:
                item = await sink.get()
                if item is done_reading:
                    reading = False
                elif isinstance(item, overload.Overflowed):
                    _count_rejection(serving, "stream_buffer_full")
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, item.message)
                elif isinstance(item, generate_pb2.SessionResponse):
                    yield item
                else:
                    req, output = item
                    yield generate_pb2.SessionResponse(chunk=outputs.to_pb(req, output))
                    if output.finish_reason is not None:
                        samples_left[req.request_id] -= 1
                        if not samples_left[req.request_id]:
                            del samples_left[req.request_id]
        finally:
            reader.cancel()
            for request_id in samples_left:  # the client went away: free their blocks
                serving.loop.abort_request(request_id)

    async def Abort(self, request: generate_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> generate_pb2.AbortResponse:
        serving = await self._serving(context)
        if not serving.loop.abort_request(request.request_id):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request_id: no request {request.request_id!r} in flight")
        return generate_pb2.AbortResponse()

    async def GetServerStatus(self, request, context) -> generate_pb2.GetServerStatusResponse:
        scheduler = (await self._serving(context)).loop.scheduler
        usable, free = scheduler.kv.num_usable_blocks, scheduler.kv.num_free_blocks
        statuses = getattr(self.serving.loop, "statuses", None)  # several replicas: one each
        return generate_pb2.GetServerStatusResponse(
            num_waiting=scheduler.num_waiting, num_running=len(scheduler.running),
            num_kv_blocks=usable, num_free_kv_blocks=free,
            kv_cache_usage=(usable - free) / usable if usable else 0.0,
            replicas=[generate_pb2.ReplicaStatus(**s) for s in statuses()] if statuses else [])

    def tokenize(self, serving: Serving, pb: generate_pb2.TokenizeRequest
                 ) -> generate_pb2.TokenizeResponse:
        """Text or chat turns to ids, exactly as Generate would turn them into its prompt
        (chat turns checked the same way); Rejected names the field."""
        if pb.WhichOneof("input") == "messages":
            as_prompt = generate_pb2.GenerateRequest(messages=pb.messages)
            try:
                ids = intake._prompt_token_ids(as_prompt, serving.facts, serving.tokenizer)
            except intake.InvalidRequest as error:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        elif pb.WhichOneof("input") == "text":
            ids = serving.tokenizer.encode(pb.text, add_special_tokens=pb.add_special_tokens)
        else:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           "input: one of text or messages must be set")
        return generate_pb2.TokenizeResponse(token_ids=ids,
                                             max_model_len=serving.facts.max_model_len)

    def detokenize(self, serving: Serving, pb: generate_pb2.DetokenizeRequest
                   ) -> generate_pb2.DetokenizeResponse:
        facts = serving.facts
        if len(pb.token_ids) > facts.max_model_len:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"token_ids: at most {facts.max_model_len} ids (the model's max "
                           f"length), got {len(pb.token_ids)}")
        for index, token_id in enumerate(pb.token_ids):
            if token_id >= facts.vocab_size:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                               f"token_ids[{index}]: {token_id} is outside the vocabulary "
                               f"[0, {facts.vocab_size})")
        text = serving.tokenizer.decode(pb.token_ids, skip_special_tokens=pb.skip_special_tokens)
        return generate_pb2.DetokenizeResponse(text=text)

    async def Tokenize(self, request: generate_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generate_pb2.TokenizeResponse:
        serving = await self._serving(context)
        try:
            return self.tokenize(serving, request)
        except Rejected as rejected:
            await context.abort(rejected.code, rejected.message)

    async def Detokenize(self, request: generate_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> generate_pb2.DetokenizeResponse:
        serving = await self._serving(context)
        try:
            return self.detokenize(serving, request)
        except Rejected as rejected:
            await context.abort(rejected.code, rejected.message)

    async def GetModelInfo(self, request, context) -> generate_pb2.GetModelInfoResponse:
        facts = (await self._serving(context)).facts
        return generate_pb2.GetModelInfoResponse(
            model_name=facts.model_name, dtype=facts.dtype,
            max_model_len=facts.max_model_len, vocab_size=facts.vocab_size)


class SchedulerServer:
    """The scheduler process: health first, then Describe the engine, then serve."""

    def __init__(self, config: SchedulerConfig):
        self.config = config.validate()
        # Limits (concurrent streams, message size) and the optional bearer-token check.
        self.server = grpc.aio.server(options=security.server_options(config),
                                      interceptors=security.interceptors(config))
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.servicer = GenerationServicer(config)
        self.client = self._engine_client(config.engine_address)
        self.metrics = Metrics()
        self.port = 0
        self.metrics_port: int | None = None
        self.http: HttpServer | None = None
        self.http_port: int | None = None  # the OpenAI-compatible API's bound port, if served

    def _engine_client(self, address: str) -> EngineClient:
        """A client of one model service, with the engine TLS settings (--engine-tls-*)."""
        return EngineClient(address, security.engine_channel_credentials(self.config),
                            security.engine_channel_options(self.config))

    @property
    def loop(self) -> EngineLoop | None:
        return self.servicer.serving.loop if self.servicer.serving else None

    async def start(self) -> int:
        """Starts listening (health NOT_SERVING) and returns the bound port."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        generate_pb2_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        credentials = security.server_credentials(self.config)
        self.port = (self.server.add_secure_port(address, credentials) if credentials
                     else self.server.add_insecure_port(address))
        await self.server.start()
        if self.config.metrics_port >= 0:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
        if self.config.http_port >= 0:
            # Answers 503 (and /health "starting") until the engine answered Describe.
            self.http = HttpServer(self.servicer, self.config.host, self.config.http_port)
            if self.config.auth_token_file:
                security.add_http_bearer_auth(self.http.app,
                                              security.read_token(self.config.auth_token_file))
            self.http_port = await self.http.start()
        return self.port

    async def connect_engine(self) -> None:
        """Describes the model service, builds the scheduler and turns health SERVING."""
        if is_replicated(self.config.engine_address):
            # Several model services: one scheduler + engine loop per replica, a router in front
            # (scheduler_service/engine/replicas.py); the servicer talks to the set as to one loop.
            loop = ReplicaSet(self.config, self.metrics, on_serving=self._on_engine_up,
                              make_client=self._engine_client)
            facts = await loop.connect()
            tokenizer = loop.tokenizer
            engine_down = None
        else:
            facts = await self.client.describe(self.config.engine_connect_timeout_s)
            tokenizer = Tokenizer(facts.tokenizer_json, facts.chat_template, facts.special_tokens)
            output_processor = OutputProcessor(tokenizer, facts.eos_token_ids, facts.max_model_len)
            scheduler = Scheduler(self.config, facts, output_processor)
            # Readiness is a real one-token step on the model, not only an answer to Describe:
            # when it fails, the loop starts by reconnecting, NOT_SERVING until a step works.
            engine_down = await self._probe(scheduler, facts)
            loop = EngineLoop(scheduler, self.client, self.metrics, on_engine_up=self._on_engine_up,
                              is_compatible=lambda new: engine_client.incompatibility(facts, new))
            loop.start(engine_down)
        self.servicer.serving = Serving(
            facts=facts, tokenizer=tokenizer, loop=loop,
            grammars=structured.GrammarCompiler(facts.tokenizer_json, facts.eos_token_ids,
                                                facts.vocab_size))
        if engine_down is None:
            if not is_replicated(self.config.engine_address):
                self.metrics.on_engine_ready()  # a replica set keeps the gauge itself
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("scheduler serving" if engine_down is None else "scheduler waiting for engine", port=self.port, model=facts.model_name,
                 num_kv_blocks=facts.num_kv_blocks, block_size=facts.block_size)

    async def _probe(self, scheduler: Scheduler, facts: EngineFacts) -> str | None:
        """None when the model service computed a one-token step, else why not."""
        try:
            await self.client.probe(scheduler.take_step_ids(2), facts)
        except engine_client.EngineUnavailable as error:
            log.warning("readiness_probe_failed", error=str(error))
            return f"readiness probe failed: {error}"
        return None

    def _on_engine_up(self, up: bool) -> None:
        """The engine loop's news: the model service went down, or is back and computing."""
        self._set_health(health_pb2.HealthCheckResponse.SERVING if up and not self.servicer.draining
                         else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def drain(self, grace_s: float) -> bool:
        """SIGTERM: health NOT_SERVING and new requests UNAVAILABLE at once; the requests in
        flight run to their end for up to grace_s. True when all of them finished in time."""
        self.servicer.draining = True
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = self.loop
        num_in_flight = len(loop.scheduler.requests) if loop else 0
        log.info("draining", num_in_flight=num_in_flight, grace_s=grace_s)
        deadline = time.monotonic() + grace_s
        while loop is not None and loop.scheduler.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        num_left = len(loop.scheduler.requests) if loop else 0
        log.info("drained" if not num_left else "drain_grace_expired", num_left=num_left)
        return not num_left

    def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.http is not None:
            await asyncio.gather(self.server.stop(grace_s), self.http.stop(grace_s))
            self.http = None
        else:
            await self.server.stop(grace_s)
        if self.loop is not None:
            await self.loop.stop()
        await self.client.close()
        self.metrics.close()

    async def wait(self) -> None:
        await self.server.wait_for_termination()
