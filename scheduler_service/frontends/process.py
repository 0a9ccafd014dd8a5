"""A frontend process: the public doors (gRPC GenerationService, health, reflection, the OpenAI
HTTP API) over a RemoteEngine, on the ports the engine core resolved, shared with the other
frontends (SO_REUSEPORT: the kernel spreads new connections over them).

Started by the core (frontends/hub.py) as `python -m scheduler_service.frontends FD`, FD being
its end of the socketpair. The core says hello (the config, the model's facts, the LoRA
registry, the ports, a first snapshot); the doors open; "ready" goes back (or "failed" with one
line). It follows the core: the snapshot's draining flag turns health NOT_SERVING and refuses new
requests; "stop" closes the doors within its grace; the link's end (the core is gone) fails every
request in flight and exits. Signals are the core's to handle: a Ctrl-C reaching the whole
process group does not cut the doors from under the core's drain.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from typing import Optional

import grpc
import structlog
from grpc_health.v1 import health

from scheduler_service import heap
from scheduler_service.api import doors, security
from scheduler_service.api.admission import Admission, Serving
from scheduler_service.api.grpc_servicer import GenerationServicer
from scheduler_service.api.http_server import HttpServer
from scheduler_service.config import SchedulerConfig
from scheduler_service.frontends.link import Link, LinkClosed
from scheduler_service.frontends.loras import RemoteLoraAdmin
from scheduler_service.frontends.remote import RemoteEngine, Status
from scheduler_service.ports import StartupError
from scheduler_service.text.tokenizer import Tokenizer

log = structlog.get_logger("planserve.frontend")

# The core sends a snapshot at least every STATUS_INTERVAL_S (frontends/hub.py), idle or not.
# This long without a word from it, its loop is stuck: health says NOT_SERVING (readiness takes
# the pod out, and a liveness probe restarts it if the silence lasts), until it speaks again.
CORE_SILENT_S = 10.0


class FrontendProcess:
    """The doors of one frontend process over its link."""

    def __init__(self, link: Link, hello: tuple):
        _, self.index, config, facts, loras, self.grpc_port, self.http_port, status = hello
        self.config: SchedulerConfig = config
        tokenizer = Tokenizer(facts.tokenizer_json, facts.chat_template, facts.special_tokens)
        self.engine = RemoteEngine(link, status, tokenizer)
        self.admission = Admission(config)
        self.admission.loras = RemoteLoraAdmin(config, loras, self.engine)
        self.admission.serving = Serving.of(facts, tokenizer, self.engine, config.grammar_engine)
        options = [o for o in security.server_options(config) if o[0] != "grpc.so_reuseport"]
        self.server = grpc.aio.server(
            options=[("grpc.so_reuseport", 1), *options],
            interceptors=security.interceptors(config),
        )
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.http: Optional[HttpServer] = None
        self.ready = False
        self._serving: Optional[bool] = None  # what health last said
        self._last_heard = 0.0  # the event loop's time of the core's last message

    async def open_doors(self) -> None:
        """The gRPC doors and the HTTP API on the core's ports; StartupError naming the flag."""
        doors.add_grpc_services(self.server, self.health, GenerationServicer(self.admission))
        self.apply(self.engine.status)
        doors.bind_grpc_port(self.server, self.config, self.grpc_port)
        await self.server.start()
        if self.http_port >= 0:
            self.http = doors.http_api(
                self.admission,
                self.config,
                self.http_port,
                is_ready=lambda: self.ready,
                reuse_port=True,
                metrics_text=lambda: self.engine.call("metrics_text"),
            )
            await self.http.start()

    def apply(self, status: Status) -> None:
        """A snapshot: health and admission follow the core's engine and drain."""
        self.engine.status = status
        if status.draining:
            self.admission.draining = True
        self._set_serving(status.engine_up and not self.admission.draining)

    def _set_serving(self, serving: bool) -> None:
        self.ready = serving
        if serving != self._serving:
            self._serving = serving
            doors.set_health(self.health, serving)

    async def _watch_core(self) -> None:
        """Health NOT_SERVING while the core has been silent CORE_SILENT_S (the next snapshot
        sets it again)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(CORE_SILENT_S / 10)
            silent_s = loop.time() - self._last_heard
            if silent_s > CORE_SILENT_S and self._serving:
                log.error("engine_core_silent", frontend=self.index, silent_s=round(silent_s, 1))
                self._set_serving(False)

    async def follow(self) -> float:
        """Serves the link until the core says stop (its grace) or goes away (0)."""
        link, engine = self.engine.link, self.engine
        loop = asyncio.get_running_loop()
        self._last_heard = loop.time()
        watch = loop.create_task(self._watch_core())
        try:
            while True:
                message = await link.receive()
                self._last_heard = loop.time()
                kind = message[0]
                if kind == "step":
                    engine.on_step(message[1], message[2])
                    self.apply(message[2])
                elif kind == "status":
                    self.apply(message[1])
                elif kind == "loras":  # an adapter loaded or unloaded at run time
                    self.admission.loras.registry = message[1]
                    link.send(("loras_applied", message[2]))
                elif kind == "refused":
                    engine.on_refused(message[1], message[2])
                elif kind == "reply":
                    engine.on_reply(message[1], message[2])
                elif kind == "stop":
                    return float(message[1])
        except LinkClosed:
            log.warning("engine_core_gone", frontend=self.index)
            engine.fail_all()
            return 0.0
        finally:
            watch.cancel()

    async def close(self, grace_s: float) -> None:
        self.apply(Status(draining=True))
        if self.http is not None:
            await asyncio.gather(self.server.stop(grace_s), self.http.stop(grace_s))
        else:
            await self.server.stop(grace_s)


async def run(fd: int) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: None)
    link = await Link.open(socket.socket(fileno=fd))
    try:
        hello = await link.receive()
    except LinkClosed:
        return 1
    frontend = FrontendProcess(link, hello)
    try:
        await frontend.open_doors()
    except StartupError as error:
        link.send(("failed", str(error)))
        await link.drain()
        return 2
    frozen = heap.freeze_startup_heap()
    log.info("startup_heap_frozen", process="frontend", frontend=frontend.index, objects=frozen)
    link.send(("ready", os.getpid()))
    grace_s = await frontend.follow()
    await frontend.close(grace_s)
    return 0
