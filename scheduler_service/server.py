"""The public GenerationService: a thin async servicer over the engine loop.

Errors map to status codes here and only here. Every stream ends with a final chunk or a
status; a cancelled call aborts its request, which frees its blocks within one step.
"""
from __future__ import annotations

import dataclasses
from typing import AsyncIterator

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from planserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_service import intake, outputs
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine_client import EngineClient, EngineFacts
from scheduler_service.loop import EngineLoop
from scheduler_service.outputs import OutputProcessor
from scheduler_service.scheduler import Scheduler
from scheduler_service.tokenizer import Tokenizer

log = structlog.get_logger("planserve.scheduler")

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


@dataclasses.dataclass(frozen=True)
class Serving:
    """What the servicer needs once the model service has described itself."""

    facts: EngineFacts
    tokenizer: Tokenizer
    loop: EngineLoop


class GenerationServicer(generate_pb2_grpc.GenerationServiceServicer):
    def __init__(self, config: SchedulerConfig):
        self._config = config
        self.serving: Serving | None = None  # set once the engine answered Describe

    async def _serving(self, context: grpc.aio.ServicerContext) -> Serving:
        if self.serving is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the model service has not answered Describe yet")
        return self.serving

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[
                           generate_pb2.GenerateResponse]:
        serving = await self._serving(context)
        scheduler = serving.loop.scheduler
        try:
            req = intake.to_request(request, serving.facts, serving.tokenizer,
                                    scheduler.kv.capacity_tokens)
        except intake.InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if scheduler.find(req.request_id) is not None:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id: {req.request_id!r} is already in flight")
        if scheduler.num_waiting >= self._config.max_queue_len:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"queue full: {scheduler.num_waiting} requests waiting "
                                f"(max_queue_len {self._config.max_queue_len})")
        serving.loop.add_request(req)
        samples_left = req.n
        try:
            while samples_left:
                output = await req.outputs.get()
                yield outputs.to_pb(req, output)
                if output.finish_reason is not None:
                    samples_left -= 1
        finally:
            if samples_left:
                # The client went away (cancel, disconnect): free its blocks next step.
                serving.loop.abort_request(req.request_id)

    async def Abort(self, request: generate_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> generate_pb2.AbortResponse:
        serving = await self._serving(context)
        if not serving.loop.abort_request(request.request_id):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request_id: no request {request.request_id!r} in flight")
        return generate_pb2.AbortResponse()

    async def GetModelInfo(self, request, context) -> generate_pb2.GetModelInfoResponse:
        facts = (await self._serving(context)).facts
        return generate_pb2.GetModelInfoResponse(
            model_name=facts.model_name, dtype=facts.dtype,
            max_model_len=facts.max_model_len, vocab_size=facts.vocab_size)


class SchedulerServer:
    """The scheduler process: health first, then Describe the engine, then serve."""

    def __init__(self, config: SchedulerConfig):
        self.config = config.validate()
        self.server = grpc.aio.server()
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.servicer = GenerationServicer(config)
        self.client = EngineClient(config.engine_address)
        self.port = 0

    @property
    def loop(self) -> EngineLoop | None:
        return self.servicer.serving.loop if self.servicer.serving else None

    async def start(self) -> int:
        """Starts listening (health NOT_SERVING) and returns the bound port."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        generate_pb2_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        await self.server.start()
        return self.port

    async def connect_engine(self) -> None:
        """Describes the model service, builds the scheduler and turns health SERVING."""
        facts = await self.client.describe(self.config.engine_connect_timeout_s)
        tokenizer = Tokenizer(facts.tokenizer_json, facts.chat_template, facts.special_tokens)
        output_processor = OutputProcessor(tokenizer, facts.eos_token_ids, facts.max_model_len)
        loop = EngineLoop(Scheduler(self.config, facts, output_processor), self.client)
        loop.start()
        self.servicer.serving = Serving(facts=facts, tokenizer=tokenizer, loop=loop)
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("scheduler serving", port=self.port, model=facts.model_name,
                 num_kv_blocks=facts.num_kv_blocks, block_size=facts.block_size)

    def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)
        if self.loop is not None:
            await self.loop.stop()
        await self.client.close()

    async def wait(self) -> None:
        await self.server.wait_for_termination()
