"""The model service's gRPC server: a synchronous `grpc.server`, its RPCs on a pool of threads.

Describe returns the runner's facts; Execute runs one plan per request, in order, on the stream's
handler thread: read the plan, decode and check it, run it, encode and write the result, then read
the next, with no event loop and no hand-off between threads on the step path (the measurements
that chose a synchronous server over grpc.aio: docs/benchmarks.md, "The model service's host CPU
per step"). With launch-ahead (CUDA) the next plan may be read, checked and launched before the
step in front of it is answered (model_service/step/launch_ahead.py); its plans then come from a
thread of their own (model_service/plan_stream.py). The stream's lifetime is the lifetime of
the slots: when it ends, every slot is dropped. One stream at a time: a second concurrent Execute
gets FAILED_PRECONDITION. Errors map to status codes here and only here. Health checks, Describe
and the LoRA RPCs run on other threads of the pool while a stream steps. `serve` and `shutdown`
stay coroutines for their callers (the process's signal loop, tests); the server itself needs no
event loop.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from concurrent import futures

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from model_service.batch import facts_to_pb, from_pb
from model_service.config import ModelServiceConfig
from model_service.loading.loader import load_model
from model_service.lora.peft_folder import AdapterError
from model_service.plan_stream import End, PlanStream
from model_service.runner import ModelRunner
from model_service.start import build_runner
from model_service.step.plan import PlanError
from model_service.step_watchdog import StepWatchdog
from model_service.stream_steps import StreamSteps
from model_service.tp_worker import TensorParallelRunner, start_tensor_parallel, torchrun_rank
from planserve import contract
from planserve.v1 import engine_pb2, engine_pb2_grpc

# What serves the plans: one runner, or rank 0 of a tensor-parallel group (the same calls).
Runner = ModelRunner | TensorParallelRunner

log = structlog.get_logger(__name__)

SERVICE_NAME = "planserve.v1.EngineService"
# Handler threads: the one Execute stream, a refused second one, health checks, Describe and an
# adapter load (seconds long) at once, with room to spare. Health Watch streams hold none (the
# health servicer sends their updates as short tasks on the same pool).
RPC_THREADS = 8


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, runner: Runner, watchdog: StepWatchdog) -> None:
        self.runner = runner
        self._watchdog = watchdog  # times each plan's step; a hung one ends the process
        self._describe = facts_to_pb(runner.describe_facts())
        # The runner that launches steps ahead (step/launch_ahead.py), else None: each plan is
        # run and answered before the next is read (tensor parallel too).
        self._launcher = (
            runner if isinstance(runner, ModelRunner) and runner.ahead is not None else None
        )
        # One open stream at a time. The flag is cleared as soon as a stream is ending (before its
        # status reaches the client), so a reconnecting scheduler is never refused by a stream that
        # is only cleaning up. Slot drops run under `_cleanup`: every new stream drops all slots
        # first, and an ending stream drops them only if no newer stream has started meanwhile.
        self._lock = threading.Lock()  # the flag and the generation, read and set together
        self._stream_open = False
        self._generation = 0
        self._cleanup = threading.Lock()

    def Describe(self, request: engine_pb2.DescribeRequest, context) -> engine_pb2.DescribeResponse:
        return self._describe

    def LoadAdapter(
        self, request: engine_pb2.LoadAdapterRequest, context
    ) -> engine_pb2.LoadAdapterResponse:
        """Reads the adapter on this RPC's thread: the Execute stream's steps go on meanwhile on
        theirs (the store's lock covers only the insert)."""
        load = getattr(self.runner, "load_adapter", None)
        try:
            if load is None:  # tensor parallel: --enable-lora is refused at start
                raise AdapterError("FAILED_PRECONDITION", "LoRA is not enabled on this engine")
            adapter = load(request.lora_id, request.lora_name, request.lora_path)
        except AdapterError as error:
            log.warning("lora_refused", lora_id=request.lora_id, error=error.message)
            context.abort(grpc.StatusCode[error.code], error.message)
        return engine_pb2.LoadAdapterResponse(
            rank=adapter.rank, target_modules=adapter.target_modules, num_bytes=adapter.num_bytes
        )

    def EvictAdapter(
        self, request: engine_pb2.EvictAdapterRequest, context
    ) -> engine_pb2.EvictAdapterResponse:
        evict = getattr(self.runner, "evict_adapter", None)
        try:
            if evict is None:
                raise AdapterError("FAILED_PRECONDITION", "LoRA is not enabled on this engine")
            evict(request.lora_id)
        except AdapterError as error:
            context.abort(grpc.StatusCode[error.code], error.message)
        return engine_pb2.EvictAdapterResponse()

    def Execute(self, request_iterator, context):
        """A generator on the stream's handler thread: each plan read blocks until it comes,
        each `yield` until the result is written (wire bytes both ways: add_engine_service).
        With launch-ahead a plan may be launched before the step in front of it is answered
        (runner.step_ahead; plans then come from a reader thread: plan_stream.py); results
        still go out in the plans' order. A client that goes away raises out of either (or
        ends the generator), and `finally` drops the slots."""
        generation = self._open(context)
        plans = PlanStream(request_iterator, threaded=self._launcher is not None)
        steps = StreamSteps(self.runner, self._launcher)
        try:
            with self._cleanup:
                self.runner.reset()  # waits for a step still running for an older stream
            ended = False
            while not (ended and steps.in_flight is None):
                wire = None if ended else plans.next(steps.done_first())
                if isinstance(wire, End):
                    ended = True
                    continue
                try:
                    with self._watchdog.timing(lambda: steps.step_id):
                        answers = steps.answer(wire)
                except PlanError as error:
                    # A step in flight goes unanswered: the scheduler recovers the whole stream.
                    log.warning(
                        "bad_plan", step_id=steps.step_id, field=error.field, error=error.message
                    )
                    self._ending(generation)
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, f"{error.field}: {error.message}"
                    )
                except Exception as error:  # a bug, a device failure, bytes that are no message
                    log.exception("step_failed", step_id=steps.step_id)
                    self._ending(generation)
                    context.abort(
                        grpc.StatusCode.INTERNAL, f"step {steps.step_id} failed: {error!r}"
                    )
                yield from answers
        finally:
            self._ending(generation)
            with self._cleanup:
                steps.abandon()
                if self._generation == generation:
                    self.runner.reset()
            log.info("execute_stream_closed", generation=generation, launched_ahead=steps.launched)

    def _open(self, context) -> int:
        """The new stream's generation; FAILED_PRECONDITION while another stream is open."""
        with self._lock:
            refused = self._stream_open
            if not refused:
                self._stream_open = True
                self._generation += 1
                generation = self._generation
        if refused:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "another Execute stream is open; one at a time"
            )
        log.info("execute_stream_open", peer=context.peer(), generation=generation)
        return generation

    def _ending(self, generation: int) -> None:
        with self._lock:
            if self._generation == generation:
                self._stream_open = False


def add_engine_service(servicer: EngineServicer, server: grpc.Server) -> None:
    """The generated engine_pb2_grpc.add_EngineServiceServicer_to_server, with Execute reading
    and writing wire bytes: the servicer parses a plain plan and encodes a result itself (C
    loops, step/decode_fast.py), and parses or serializes the other messages with protobuf.
    Every other RPC is registered as generated."""

    class Handlers:  # takes what the generated function registers
        handlers: dict = {}

        def add_generic_rpc_handlers(self, generic) -> None:
            pass

        def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
            self.handlers = dict(handlers)

    taken = Handlers()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, taken)
    handlers = taken.handlers
    handlers["Execute"] = grpc.stream_stream_rpc_method_handler(servicer.Execute)  # bytes
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def warm_up(runner: Runner) -> None:
    """Readiness: one real one-token step (slot 0, block 1) through the same path as a plan from
    the scheduler, then every slot dropped. A process that loaded but cannot compute fails here
    instead of reporting SERVING."""
    request = engine_pb2.ExecuteRequest()
    plan = request.plan
    sequence = plan.new_sequences.add(slot=0, token_ids=[0], num_computed_tokens=0)
    sequence.sampling.temperature = 0.0
    plan.slots.append(0)
    plan.num_scheduled_tokens.append(1)
    plan.num_new_blocks.append(1)
    plan.new_block_ids.append(1)
    output = runner.execute(from_pb(request, runner.limits))
    runner.reset()
    if (
        len(output.sampled_token_ids) != 1
        or not 0 <= int(output.sampled_token_ids[0]) < runner.limits.vocab_size
    ):
        raise RuntimeError(
            f"warm-up step sampled {list(output.sampled_token_ids)}, expected one token id"
        )
    log.info("warm_up_step_ok")


def tls_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS from PEM files; with `client_ca`, clients (the scheduler) must present a certificate it
    signed (mutual TLS)."""

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    ca = read(client_ca) if client_ca else None
    return grpc.ssl_server_credentials(
        [(read(key), read(cert))], root_certificates=ca, require_client_auth=ca is not None
    )


class PortTaken(Exception):
    """The model service's port is held by another process (one line for the person)."""


class StartRefused(Exception):
    """Loading or sizing refused this config: the ValueError's line, which names the field or
    the file at fault (one line for the person, as PortTaken)."""


def check_port_free(host: str, port: int) -> None:
    """PortTaken when `port` on `host` cannot be bound now (0 and unix: addresses need no
    check). Checked before the model loads, so a taken port fails in a second, not a minute.
    The scheduler's twin is scheduler_service/ports.py: the two services share no package."""
    if port <= 0 or host.startswith("unix:"):
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise PortTaken(
                f"--port {port}: cannot listen on {host}:{port} ({error.strerror or error}); "
                "stop what holds it or choose another port (0 picks a free one)"
            ) from None


async def _start(config: ModelServiceConfig) -> Runner:
    """Rank 0 of a tensor-parallel group (it starts or joins the other ranks), else one runner.
    StartRefused where loading or sizing refuses the config (a ValueError naming its field)."""
    try:
        if config.tensor_parallel_size > 1 or torchrun_rank() is not None:
            return await asyncio.to_thread(start_tensor_parallel, config)
        loaded = await asyncio.to_thread(load_model, config)
        return build_runner(loaded, config)
    except ValueError as error:
        log.debug("start_refused", exc_info=True)  # the trace, for whoever turns debug on
        raise StartRefused(str(error)) from error


class EngineServer:
    """The started server: `bound_port` (useful with config.port == 0), `health` (SERVING for ""
    and the engine service once started), `runner`, and `stop`, a coroutine as grpc.aio's is."""

    def __init__(
        self,
        server: grpc.Server,
        pool: futures.ThreadPoolExecutor,
        health_servicer: health.HealthServicer,
        runner: Runner,
        bound_port: int,
    ) -> None:
        self._server, self._pool = server, pool
        self.health, self.runner, self.bound_port = health_servicer, runner, bound_port

    async def stop(self, grace: float | None) -> None:
        """New RPCs refused at once; open ones get `grace` seconds, then are cancelled."""
        stopped = self._server.stop(grace)
        await asyncio.to_thread(stopped.wait)
        self._pool.shutdown(wait=False)


async def serve(
    config: ModelServiceConfig,
    runner: Runner | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> EngineServer:
    """Load the model (unless a runner is given), bind, start; returns the started server."""
    config.validate()
    if runner is None:
        runner = await _start(config)
    # Not SERVING (not even listening) before one real step went through the model.
    await asyncio.to_thread(warm_up, runner)
    pool = futures.ThreadPoolExecutor(max_workers=RPC_THREADS, thread_name_prefix="engine-rpc")
    server = grpc.server(
        pool,
        options=[
            ("grpc.so_reuseport", 0),  # a taken port fails instead of sharing its connections
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            *contract.keepalive_options(config.scheduler_keepalive_s),
        ],
    )
    add_engine_service(EngineServicer(runner, StepWatchdog(config.step_timeout_s)), server)
    health_servicer = health.HealthServicer(
        experimental_non_blocking=True, experimental_thread_pool=pool
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # The engine trusts its plans: loopback by default (config.host), TLS/mTLS when credentials are
    # given. `--host unix:/path/engine.sock` binds a Unix socket instead (port unused; the
    # scheduler's --engine takes the same unix:/path).
    address = config.host if config.host.startswith("unix:") else f"{config.host}:{config.port}"
    try:
        port = (
            server.add_secure_port(address, credentials)
            if credentials
            else server.add_insecure_port(address)
        )
    except RuntimeError:
        port = 0
    if port == 0:
        pool.shutdown(wait=False)
        raise PortTaken(f"--port {config.port}: cannot listen on {address}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", host=config.host, port=port, model=runner.loaded.name)
    return EngineServer(server, pool, health_servicer, runner, port)


async def shutdown(server: EngineServer, grace_s: float = 5.0) -> None:
    """Health NOT_SERVING first (so balancers stop sending), then a graceful stop."""
    for name in ("", SERVICE_NAME):
        server.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace_s)
    close = getattr(server.runner, "close", None)  # tensor parallel: stop the other ranks
    if close is not None:
        await asyncio.to_thread(close)
