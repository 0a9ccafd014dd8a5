"""Run-time LoRA loading behind frontend processes (`--enable-runtime-lora`).

The adapters live in the engine core: its LoraAdmin loads them on the model services and keeps
the one registry. A frontend's door forwards a load or an unload to the core as a call; the core
runs it as the scheduler process's doors would (the same checks, the same LoraError), sends every
frontend the new registry ("loras") and answers the caller once each applied it ("loras_applied"):
a client told an adapter is loaded may name it at once on any connection, whichever frontend
the kernel gives it to.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

import structlog

from scheduler_service.config import SchedulerConfig
from scheduler_service.core.lora_registry import Adapter, LoraError, LoraRegistry
from scheduler_service.engine.client import EngineFacts
from scheduler_service.engine.lora_admin import LoraAdmin

log = structlog.get_logger("planserve.frontends")

# How long the core waits for the frontends to apply a new registry (one that died meanwhile
# never answers; the others do within a loop turn).
APPLY_TIMEOUT_S = 10.0


class RemoteLoraAdmin(LoraAdmin):
    """A frontend's LoraAdmin: the registry is the core's copy (kept by "loras" messages); load
    and unload are the core's."""

    def __init__(self, config: SchedulerConfig, registry: LoraRegistry, engine: Any):
        super().__init__(config, registry)
        self._engine = engine  # a RemoteEngine

    async def load(self, frontend: object, facts: EngineFacts, name: str, path: str) -> Adapter:
        return _answer(await self._engine.call("lora_load", name, path))

    async def unload(self, frontend: object, name: str) -> None:
        _answer(await self._engine.call("lora_unload", name))


def _answer(result: Any) -> Any:
    if isinstance(result, LoraError):
        raise result
    return result


async def run_in_core(admin: LoraAdmin, engine: object, facts: EngineFacts, op: str, args: tuple):
    """A frontend's load or unload run by the core's LoraAdmin: the result, or the LoraError
    (sent back as the answer, raised again by the frontend)."""
    try:
        if op == "lora_load":
            return await admin.load(engine, facts, *args)
        return await admin.unload(engine, *args)
    except LoraError as error:
        return error
    except Exception as error:  # noqa: BLE001 - answered, or the frontend's door waits forever
        log.exception("frontend_lora_call_failed", op=op)
        return LoraError("unavailable", "lora_name", f"the engine core failed the {op}: {error}")


class RegistrySync:
    """The core's side of "loras": sends the registry to every frontend and waits until each
    applied it."""

    def __init__(self) -> None:
        self._version = 0
        self._waiting: dict[tuple[int, int], asyncio.Future] = {}  # (frontend, version)

    async def push(self, peers: Iterable[Any], registry: LoraRegistry) -> None:
        self._version += 1
        version, loop = self._version, asyncio.get_running_loop()
        keys = []
        for peer in peers:
            keys.append((peer.index, version))
            self._waiting[keys[-1]] = loop.create_future()
            peer.link.send(("loras", registry, version))
        if keys:
            await asyncio.wait([self._waiting[k] for k in keys], timeout=APPLY_TIMEOUT_S)
        for key in keys:
            self._waiting.pop(key, None)

    def applied(self, index: int, version: int) -> None:
        waiting = self._waiting.get((index, version))
        if waiting is not None and not waiting.done():
            waiting.set_result(None)
