"""The scheduler process: its doors (gRPC GenerationService, health, reflection, the OpenAI HTTP
API, /metrics), then the engine side once the model service described itself.

The doors are api/ (one admission path, api/admission.py; the servicer, api/grpc_servicer.py);
the engine side is one EngineLoop, or a ReplicaSet of them (engine/), behind EngineFrontend.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Optional

import grpc
import structlog
from grpc_health.v1 import health, health_pb2

from scheduler_service.api import doors, security
from scheduler_service.api.admission import Admission, Serving
from scheduler_service.api.grpc_servicer import GenerationServicer
from scheduler_service.api.http_server import HttpServer
from scheduler_service.config import SchedulerConfig
from scheduler_service.core.scheduler import Scheduler, log_step_budget
from scheduler_service.engine import client as engine_client
from scheduler_service.engine import kv_events
from scheduler_service.engine.addresses import is_replicated
from scheduler_service.engine.client import EngineClient, EngineFacts
from scheduler_service.engine.frontend import EngineFrontend
from scheduler_service.engine.kv_events import KVEventPublisher, KVEventStream
from scheduler_service.engine.loop import EngineLoop
from scheduler_service.engine.replicas import ReplicaSet
from scheduler_service.frontends.hub import FrontendHub
from scheduler_service.metrics import Metrics
from scheduler_service.ports import StartupError, check_port_free, reserve_shared_port
from scheduler_service.text.outputs import OutputProcessor
from scheduler_service.text.tokenizer import Tokenizer

log = structlog.get_logger("planserve.scheduler")


def check_ports(config: SchedulerConfig) -> None:
    """StartupError naming the first flag whose port is taken, before any door is opened."""
    check_port_free("--port", config.host, config.port)
    check_port_free("--metrics-port", config.host, config.metrics_port)
    check_port_free("--http-port", config.host, config.http_port)


class SchedulerServer:
    """The scheduler process: health first, then Describe the engine, then serve."""

    def __init__(self, config: SchedulerConfig):
        self.config = config.validate()
        # Limits (concurrent streams, message size) and the optional bearer-token check.
        self.server = grpc.aio.server(
            options=security.server_options(config), interceptors=security.interceptors(config)
        )
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.admission = Admission(config)  # one admission path for the gRPC and HTTP doors
        self.servicer = GenerationServicer(self.admission)
        self.client = self._engine_client(config.engine_address)
        self.metrics = Metrics()
        self.port = 0
        self.metrics_port: int | None = None
        self.http: HttpServer | None = None
        self.http_port: int | None = None  # the OpenAI-compatible API's bound port, if served
        self.kv_publisher: KVEventPublisher | None = None  # with --kv-events-config
        # --frontend-processes N: the doors run in N processes (scheduler_service/frontends);
        # this process holds their ports (bound, not listening) and serves their links.
        self.hub: FrontendHub | None = None
        self._port_holders: list[socket.socket] = []
        # Health SERVING: the model service computed a real step and the server is not draining.
        self.ready = False

    def _engine_client(self, address: str) -> EngineClient:
        """A client of one model service, with the engine TLS settings (--engine-tls-*)."""
        return EngineClient(
            address,
            security.engine_channel_credentials(self.config),
            security.engine_channel_options(self.config),
        )

    @property
    def loop(self) -> EngineFrontend | None:
        """The engine side: an EngineLoop, or a ReplicaSet (None before Describe)."""
        serving = self.admission.serving
        return serving.frontend if serving else None

    async def start(self) -> int:
        """Starts listening (health NOT_SERVING) and returns the bound port; StartupError
        naming the flag of a port that is taken (then nothing is left listening)."""
        check_ports(self.config)
        if self.config.frontend_processes:
            return await self._start_for_frontends()
        doors.add_grpc_services(self.server, self.health, self.servicer)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = doors.bind_grpc_port(self.server, self.config, self.config.port)
        await self.server.start()
        try:
            await self._open_http_doors()
        except BaseException:
            await self.server.stop(0)
            self.metrics.close()
            raise
        return self.port

    async def _start_for_frontends(self) -> int:
        """--frontend-processes: resolves and holds the doors' ports (the frontends open them
        once the model service described itself) and serves /metrics here."""
        config = self.config
        holders = self._port_holders
        holders.append(reserve_shared_port("--port", config.host, config.port))
        self.port = holders[0].getsockname()[1]
        if config.http_port >= 0:
            holders.append(reserve_shared_port("--http-port", config.host, config.http_port))
            self.http_port = holders[1].getsockname()[1]
        try:
            await self._open_http_doors(api=False)
        except BaseException:
            self._close_port_holders()
            raise
        return self.port

    def _close_port_holders(self) -> None:
        for holder in self._port_holders:
            holder.close()
        self._port_holders = []

    async def _open_http_doors(self, api: bool = True) -> None:
        """/metrics and the OpenAI HTTP API, each when its port is not -1."""
        if self.config.metrics_port >= 0:
            try:
                self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
            except OSError as error:
                raise StartupError(
                    f"--metrics-port {self.config.metrics_port}: cannot listen on "
                    f"{self.config.host}:{self.config.metrics_port} ({error.strerror or error})"
                ) from None
        if self.config.http_port >= 0 and api:
            # Answers 503 (and /health "starting") until the engine answered Describe.
            self.http = doors.http_api(
                self.admission,
                self.config,
                self.config.http_port,
                registry=self.metrics.registry,
                is_ready=lambda: self.ready,
            )
            self.http_port = await self.http.start()

    async def connect_engine(self) -> None:
        """Describes the model service, builds the scheduler and turns health SERVING."""
        if is_replicated(self.config.engine_address):
            facts, tokenizer, frontend, engine_down = await self._connect_replicas()
        else:
            facts, tokenizer, frontend, engine_down = await self._connect_engine()
        try:
            await self.admission.loras.load_modules(frontend, facts)
        except BaseException:
            await frontend.stop()
            await self.stop(grace_s=0)  # nothing left listening behind the start-up error
            raise
        self.admission.serving = Serving.of(facts, tokenizer, frontend, self.config.grammar_engine)
        self.metrics.on_engine_facts(facts.block_size, facts.num_kv_blocks)
        if engine_down is None:
            if not is_replicated(self.config.engine_address):
                self.metrics.on_engine_ready()  # a replica set keeps the gauge itself
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if self.config.frontend_processes:
            self.hub = FrontendHub(self.admission, self.metrics, lambda: self.ready)
            try:
                await self.hub.start(
                    self.config.frontend_processes, self.port, self.http_port or -1
                )
            except BaseException:
                await self.stop(grace_s=0)
                raise
        log.info(
            "scheduler serving" if engine_down is None else "scheduler waiting for engine",
            port=self.port,
            model=facts.model_name,
            num_kv_blocks=facts.num_kv_blocks,
            block_size=facts.block_size,
        )

    async def _connect_replicas(self) -> tuple[EngineFacts, Tokenizer, EngineFrontend, None]:
        """Several model services: one scheduler + engine loop per replica, a router in front
        (scheduler_service/engine/replicas.py); the doors see the set as one frontend."""
        replicas = ReplicaSet(
            self.config,
            self.metrics,
            on_serving=self._on_engine_up,
            make_client=self._engine_client,
            kv_publisher=self._kv_publisher(),
            lora_registry=self.admission.loras.registry,
        )
        facts, tokenizer = await replicas.connect()
        return facts, tokenizer, replicas, None

    async def _connect_engine(self) -> tuple[EngineFacts, Tokenizer, EngineFrontend, Optional[str]]:
        """One model service: its scheduler and engine loop; the fourth value says why the
        engine is down (None: it computed a one-token step)."""
        facts = await self.client.describe(self.config.engine_connect_timeout_s)
        tokenizer = Tokenizer(facts.tokenizer_json, facts.chat_template, facts.special_tokens)
        output_processor = OutputProcessor(tokenizer, facts.eos_token_ids, facts.max_model_len)
        scheduler = Scheduler(self.config, facts, output_processor)
        log_step_budget(scheduler)
        events = self._kv_event_stream(scheduler)
        # Readiness is a real one-token step on the model, not only an answer to Describe:
        # when it fails, the loop starts by reconnecting, NOT_SERVING until a step works.
        engine_down = await self._probe(scheduler, facts)
        loop = EngineLoop(
            scheduler,
            self.client,
            self.metrics,
            on_engine_up=self._on_engine_up,
            is_compatible=lambda new: engine_client.incompatibility(facts, new),
            kv_events=events,
            lora_registry=self.admission.loras.registry,
        )
        loop.start(engine_down)
        return facts, tokenizer, loop, engine_down

    def _kv_publisher(self) -> Optional[KVEventPublisher]:
        """With --kv-events-config: the socket the KV-cache events go out on."""
        config = kv_events.parse_config(self.config.kv_events_config)
        if config is None or not config.publishes:
            return None
        try:
            self.kv_publisher = KVEventPublisher(config)
        except OSError as error:
            raise StartupError(f"--kv-events-config: {error}") from None
        return self.kv_publisher

    def _kv_event_stream(self, scheduler: Scheduler) -> Optional[KVEventStream]:
        """One model service: its pool logs its changes, published after each step."""
        publisher = self._kv_publisher()
        if publisher is None:
            return None
        scheduler.kv.enable_events()
        return KVEventStream(publisher, scheduler.kv.block_size)

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
        self._set_health(
            health_pb2.HealthCheckResponse.SERVING
            if up and not self.admission.draining
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )

    async def drain(self, grace_s: float) -> bool:
        """SIGTERM: health NOT_SERVING and new requests UNAVAILABLE at once; the requests in
        flight run to their end for up to grace_s. True when all of them finished in time."""
        self.admission.draining = True
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.hub is not None:
            self.hub.send_status()  # the frontends refuse new requests from now on
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
        self.ready = status == health_pb2.HealthCheckResponse.SERVING
        doors.set_health(self.health, self.ready)

    async def stop(self, grace_s: float = 5.0) -> None:
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.hub is not None:
            await self.hub.stop(grace_s)
            self.hub = None
        self._close_port_holders()
        if self.http is not None:
            await asyncio.gather(self.server.stop(grace_s), self.http.stop(grace_s))
            self.http = None
        else:
            await self.server.stop(grace_s)
        if self.loop is not None:
            await self.loop.stop()
        await self.client.close()
        self.metrics.close()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
            self.kv_publisher = None

    async def wait(self) -> None:
        await self.server.wait_for_termination()
