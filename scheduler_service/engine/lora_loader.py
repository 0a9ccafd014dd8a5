"""One model service's LoRA adapters: the loads and evictions its scheduler decides
(core/loras.py), run as LoadAdapter / EvictAdapter RPCs beside the Execute stream.

The engine loop calls `pump()` after each plan: adapters a waiting request needs are loaded
(an idle one evicted first when max_cpu_loras are loaded), adapters the operator unloaded are
evicted once no sequence runs with them. The loads run as tasks of their own: running requests
never wait for them (the model service reads the folder on its own thread), and the waiting
request is admitted in the first step after its adapter is in. A model-service restart empties
the residency (Scheduler.reset_engine); the requests then load their adapters again the same way.

A load the model service refuses (the folder changed since it was registered, say) ends the
requests waiting for that adapter with an error rather than leaving them waiting forever.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Coroutine, Optional

import grpc
import structlog

from planserve.v1 import engine_pb2
from scheduler_service.core.lora_registry import Adapter, LoraError, LoraRegistry
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.client import EngineClient

log = structlog.get_logger("planserve.lora")

# The model service's refusals of an adapter (its files, its config), as LoraError kinds; any
# other status (UNAVAILABLE, DEADLINE_EXCEEDED, ...) is an outage, "unavailable".
_REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.FAILED_PRECONDITION: "invalid",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.ALREADY_EXISTS: "conflict",
}


def engine_error(error: grpc.aio.AioRpcError, adapter: Adapter) -> LoraError:
    """The model service's refusal of `adapter` as a LoraError naming lora_path."""
    kind = _REFUSALS.get(error.code(), "unavailable")
    details = error.details() or error.code().name
    if not details.startswith("lora_path"):  # the model service names a key or tensor
        details = f"lora_path: adapter {adapter.name!r} at {adapter.path!r}: {details}"
    return LoraError(kind, "lora_path", details)


class AdapterLoader:
    """Runs the adapter decisions of one scheduler on its model service."""

    def __init__(
        self,
        scheduler: Scheduler,
        client: EngineClient,
        registry: LoraRegistry,
        wake: Callable[[], None],
    ):
        self.scheduler = scheduler
        self.client = client
        self.registry = registry
        self._wake = wake
        self._tasks: set[asyncio.Task] = set()

    def pump(self) -> None:
        """Starts the loads and evictions the scheduler asked for since the last call."""
        loras = self.scheduler.loras
        if loras.forgotten:
            for _, lora_id in loras.take_idle_forgotten():
                self._spawn(self._evict(lora_id))
        if loras.wanted:
            for name, lora_id, evicted in loras.start_loads():
                self._spawn(self._load(name, lora_id, evicted, loras.epoch))

    def _spawn(self, work: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _evict(self, lora_id: int) -> None:
        try:
            await self.client.evict_adapter(lora_id)
        except grpc.aio.AioRpcError as error:  # a restart drops it anyway
            log.warning("lora_evict_failed", lora_id=lora_id, error=error.details())

    async def _load(
        self, name: str, lora_id: int, evicted: Optional[tuple[str, int]], epoch: int
    ) -> None:
        loras = self.scheduler.loras
        adapter = self.registry.adapters.get(name)
        try:
            if evicted is not None:
                await self.client.evict_adapter(evicted[1])
            if adapter is None or adapter.lora_id != lora_id:
                # Unloaded between the request's admission and now.
                loras.load_failed(name)
                self.scheduler.fail_adapter(name)
                return
            await self.client.load_adapter(lora_id, name, adapter.path)
        except grpc.aio.AioRpcError as error:
            loras.load_failed(name)
            if error.code() in _REFUSALS:
                log.error("lora_load_refused", lora_name=name, error=error.details())
                self.scheduler.fail_adapter(name)
            else:  # an outage: the requests ask again once the engine is back
                log.warning("lora_load_failed", lora_name=name, error=error.details())
        else:
            loras.loaded(name, lora_id, epoch)
            log.info("lora_loaded", lora_name=name, lora_id=lora_id)
        finally:
            self._wake()

    async def load_now(self, adapter: Adapter) -> Optional[engine_pb2.LoadAdapterResponse]:
        """Loads `adapter` here now (start-up, the load door), evicting an idle adapter when
        max_cpu_loras are loaded; None when every loaded adapter runs (it loads when a request
        needs it). LoraError for the model service's refusal."""
        loras = self.scheduler.loras
        evicted = None
        if loras.needs_room():
            victim = loras.victim()
            if victim is None:
                return None
            evicted = loras.resident.pop(victim)
        loras.loading.add(adapter.name)
        epoch = loras.epoch
        try:
            if evicted is not None:
                await self.client.evict_adapter(evicted)
            reply = await self.client.load_adapter(adapter.lora_id, adapter.name, adapter.path)
        except grpc.aio.AioRpcError as error:
            loras.load_failed(adapter.name)
            raise engine_error(error, adapter) from None
        loras.loaded(adapter.name, adapter.lora_id, epoch)
        return reply

    def unload(self, name: str) -> None:
        """The operator unloaded `name` (no request uses it): evicted here once idle."""
        self.scheduler.loras.forget(name)
        self.pump()
