"""The engine core's side of the frontend processes (`--frontend-processes N`).

The hub starts N frontend processes once the model service described itself, one socketpair
each, and serves their links: requests in (added to the engine frontend: an EngineLoop or a
ReplicaSet, which it cannot tell from the doors), their outputs back in ONE message per step per
frontend (every output of that frontend's requests the step produced, and the status snapshot
its doors read). A request's `outputs` sink here is a `BatchSink` that appends to its frontend's
batch; every frontend's batch is flushed, with one status, by a callback scheduled on the step's
first output, which runs once the engine loop delivered the whole step.

A frontend process that dies: its link ends, its requests are aborted (their blocks return
next step), the others go on; it is not restarted (its port is still served by the others).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from typing import Any, Callable, Coroutine

import structlog
from prometheus_client import Counter

from cython_ext.step_outputs import BatchSink, compact_outputs
from scheduler_service import logs
from scheduler_service.api.admission import Admission, Rejected, compile_grammar
from scheduler_service.core.request import FinishReason, Request, RequestOutput
from scheduler_service.frontends import loras
from scheduler_service.frontends.link import Link, LinkClosed
from scheduler_service.frontends.remote import Status
from scheduler_service.frontends.text import made_by_frontend
from scheduler_service.metrics import Metrics
from scheduler_service.metrics_text import TextRenderer
from scheduler_service.ports import StartupError

log = structlog.get_logger("planserve.frontends")

# How often the snapshot goes out while no step does (queue depth, engine up, draining).
STATUS_INTERVAL_S = 0.2
START_TIMEOUT_S = 60.0


class _Peer:
    """One frontend process: its link, its requests in the core, the step's batch."""

    def __init__(self, hub: "FrontendHub", index: int, link: Link, process: subprocess.Popen):
        self.hub, self.index, self.link, self.process = hub, index, link, process
        self.requests: dict[str, Request] = {}
        self._samples_left: dict[str, int] = {}
        self._batch: list[tuple[str, RequestOutput]] = []
        self.pid = process.pid

    def track(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._samples_left[request.request_id] = request.n
        # The request's outputs go to this frontend's batch of the step (one C call each).
        request.outputs = BatchSink(
            request.request_id, self._batch, self.hub.flush_soon, self.final
        )

    def final(self, request_id: str) -> None:
        """A sample's last output went out: the request is forgotten after its last sample's."""
        if request_id in self._samples_left:
            self._samples_left[request_id] -= 1
            if not self._samples_left[request_id]:
                del self._samples_left[request_id]
                self.requests.pop(request_id, None)

    def forget_all(self) -> list[str]:
        """The frontend is gone: the ids of its requests still in flight, forgotten here (their
        outputs, until the aborts apply, go nowhere)."""
        request_ids = list(self.requests)
        self.requests.clear()
        self._samples_left.clear()
        return request_ids

    def flush(self, status: "Status") -> None:
        """The step's message, when the step gave this frontend's requests any output."""
        if self._batch:
            self.link.send(("step", compact_outputs(self._batch), status))
            self._batch.clear()  # in place: the sinks hold it (send pickled it already)


class FrontendHub:
    """Starts the frontend processes and serves their links (see the module doc)."""

    def __init__(
        self,
        admission: Admission,
        metrics: Metrics,
        is_ready: Callable[[], bool],
    ):
        self.admission = admission
        self.metrics = metrics
        self._is_ready = is_ready
        self.peers: list[_Peer] = []
        self.added = Counter(
            "planserve_frontend_requests",
            "Requests each frontend process added (the kernel spreads connections over them).",
            ["frontend"],
            registry=metrics.registry,
        )
        self._tasks: list[asyncio.Task] = []
        # Work started off a message (a guide's compile, a run-time LoRA call), held until it
        # ends: the loop holds tasks weakly, and one collected while it waits never answers.
        self._held: set[asyncio.Task] = set()
        self._registry = loras.RegistrySync()
        self._flush_scheduled = False
        self._metrics_text = TextRenderer(metrics.registry)  # keeps its formats between scrapes

    @property
    def engine(self) -> Any:
        serving = self.admission.serving
        assert serving is not None  # the hub starts after Describe
        return serving.frontend

    def status(self) -> Status:
        engine, admission = self.engine, self.admission
        scheduler = engine.scheduler
        kv = scheduler.kv
        return Status(
            num_waiting=scheduler.num_waiting,
            num_waiting_tokens=scheduler.num_waiting_tokens,
            num_running=len(scheduler.running),
            num_requests=len(scheduler.requests),
            capacity_tokens=kv.capacity_tokens,
            num_usable_blocks=kv.num_usable_blocks,
            num_free_blocks=kv.num_free_blocks,
            tokens_per_s=engine.tokens_per_s,
            engine_up=self._is_ready(),
            draining=admission.draining,
            statuses=tuple(engine.statuses()),
        )

    def flush_soon(self) -> None:
        """A step's first output: every frontend's batch goes out once the step is delivered."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        status = self.status()  # once a step, whatever the number of frontends
        for peer in self.peers:
            peer.flush(status)

    async def start(self, num: int, grpc_port: int, http_port: int) -> None:
        """Starts `num` frontend processes on the resolved ports and waits until each serves;
        StartupError with the first one's reason when one cannot."""
        started = await asyncio.gather(
            *(self._start_one(i, grpc_port, http_port) for i in range(num)),
            return_exceptions=True,
        )
        self.peers = [peer for peer in started if isinstance(peer, _Peer)]
        failure = next((e for e in started if isinstance(e, BaseException)), None)
        if failure is not None:
            await self.stop(0)
            raise failure
        for peer in self.peers:
            self._tasks.append(asyncio.ensure_future(self._serve(peer)))
        self._tasks.append(asyncio.ensure_future(self._tick()))
        log.info("frontends serving", pids=[p.pid for p in self.peers], port=grpc_port)

    async def _start_one(self, index: int, grpc_port: int, http_port: int) -> _Peer:
        ours, theirs = socket.socketpair()
        command = [
            sys.executable,
            "-m",
            "scheduler_service.frontends",
            str(theirs.fileno()),
            logs.configured_level,
        ]
        try:
            process = subprocess.Popen(command, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        link = await Link.open(ours)
        serving = self.admission.serving
        assert serving is not None
        config = self.admission.config
        link.send(
            (
                "hello",
                index,
                config,
                serving.facts,
                self.admission.loras.registry,
                grpc_port,
                http_port,
                self.status(),
            )
        )
        try:
            answer = await asyncio.wait_for(link.receive(), START_TIMEOUT_S)
        except (LinkClosed, asyncio.TimeoutError):
            process.kill()
            raise StartupError(
                f"--frontend-processes: frontend process {index} exited during start "
                f"(status {process.wait()})"
            ) from None
        if answer[0] != "ready":
            process.wait()
            raise StartupError(answer[1])
        return _Peer(self, index, link, process)

    async def _serve(self, peer: _Peer) -> None:
        try:
            while True:
                message = await peer.link.receive()
                self._handle(peer, message)
        except LinkClosed:
            pass
        peer.link.close()
        request_ids = peer.forget_all()
        log.warning("frontend_process_gone", pid=peer.pid, num_aborted=len(request_ids))
        for request_id in request_ids:
            self.engine.abort_request(request_id)

    def _handle(self, peer: _Peer, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            self._add(peer, message[1])
        elif kind == "abort":
            if message[1] in peer.requests:
                self.engine.abort_request(message[1])
        elif kind == "rejected":
            self.metrics.on_rejected(message[1])
        elif kind == "loras_applied":
            self._registry.applied(peer.index, message[1])
        elif kind == "call":
            _, call_id, op, args = message
            if op in ("lora_load", "lora_unload"):
                self._spawn(self._lora_call(peer, call_id, op, args))
            else:
                peer.link.send(("reply", call_id, self._call(op, args)))

    def _add(self, peer: _Peer, request: Request) -> None:
        markers, request.guide_markers = request.guide_markers, None
        try:
            # Here, not only in the frontend: this queue is the one its bounds are about (the
            # frontend's snapshot lags), and another frontend may hold the same id.
            self.admission.check_room(request)
        except Rejected as rejected:
            peer.link.send(("refused", request.request_id, rejected))
            return
        peer.track(request)
        request.detokenize = not made_by_frontend(request)
        self.added.labels(str(peer.index)).inc()
        if request.lora_name:  # counted here, in the one registry (the frontend's skip it)
            self.metrics.on_lora_request(request.lora_name)
        if request.structured is not None and markers is not None:
            self._spawn(self._add_guided(peer, request, markers))
            return
        self.engine.add_request(request)

    def _spawn(self, work: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._held.add(task)
        task.add_done_callback(self._held.discard)

    async def _lora_call(self, peer: _Peer, call_id: int, op: str, args: tuple) -> None:
        """A frontend's run-time LoRA load or unload (frontends/loras.py): run here, then every
        frontend applies the registry, then the caller gets its answer."""
        serving = self.admission.serving
        assert serving is not None
        answer = await loras.run_in_core(self.admission.loras, self.engine, serving.facts, op, args)
        await self._registry.push(self.peers, self.admission.loras.registry)
        peer.link.send(("reply", call_id, answer))

    async def _add_guided(self, peer: _Peer, request: Request, markers: tuple) -> None:
        """The guide made again here (the grammar compiles off the loop; the frontend already
        compiled it once, within admission's bound, so it is known to compile)."""
        after, opens = markers
        grammars = self.admission.serving.grammars if self.admission.serving else None
        assert grammars is not None and request.structured is not None
        try:
            grammar = await compile_grammar(grammars, request.structured, opens)
        except Exception:  # noqa: BLE001 - the frontend compiled it: this is a fault here
            log.exception("grammar_recompile_failed", request_id=request.request_id)
            request.outputs.put_nowait(_failed())
            return
        if request.request_id not in peer.requests:
            return  # aborted meanwhile, or its frontend is gone
        request.guide = grammar.new_guide(after, opens)
        self.engine.add_request(request)

    def _call(self, op: str, args: tuple) -> Any:
        """The rare operations a door asks of the core."""
        if op == "reset_prefix_cache":
            return self.engine.scheduler.kv.reset_prefix_cache()
        if op == "abort":  # the Abort RPC, for a request of whichever frontend
            return self.engine.abort_request(args[0])
        if op == "metrics_text":
            return self._metrics_text.render()
        if op == "status":  # /load and GetServerStatus: now, not the last step's snapshot
            return self.status()
        if op == "barrier":  # answered after every message sent before it (an add's refusal)
            return None
        raise ValueError(f"unknown frontend call {op!r}")

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            self.send_status()

    def send_status(self) -> None:
        status = self.status()
        for peer in self.peers:
            peer.link.send(("status", status))

    async def stop(self, grace_s: float) -> None:
        """Tells every frontend to stop (its doors close within grace_s), then waits for it."""
        for task in self._tasks:
            task.cancel()
        for peer in self.peers:
            peer.link.send(("stop", grace_s))
        loop = asyncio.get_running_loop()
        for peer in self.peers:
            try:
                await asyncio.wait_for(loop.run_in_executor(None, peer.process.wait), grace_s + 5)
            except asyncio.TimeoutError:
                peer.process.kill()
            peer.link.close()
        self.peers = []

    def pids(self) -> list[int]:
        return [peer.pid for peer in self.peers]


def _failed() -> RequestOutput:
    return RequestOutput(token_ids=[], text="", finish_reason=FinishReason.ERROR)
