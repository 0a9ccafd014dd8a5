"""The adapter operations of the doors, over every model service: the --lora-modules loaded at
start, and the run-time load and unload (HTTP /v1/load_lora_adapter, /v1/unload_lora_adapter;
gRPC LoadLoraAdapter, UnloadLoraAdapter).

Security (docs/lora.md): --lora-modules paths are the operator's and taken as given; run-time
loading is off unless --enable-runtime-lora (a closed door answers as an unknown route would:
404), and its paths must resolve, symlinks followed, inside --lora-root. The bearer token, when
one is configured, guards these routes like every other (api/security.py).

A run-time load is registered only once a model service has read the adapter (so that a bad
folder is refused to the caller, naming the key or tensor); it loads on every replica that is up
and has room, and the others load it when a request needs it.
"""

from __future__ import annotations

from typing import Optional

import structlog

from scheduler_service.config import SchedulerConfig
from scheduler_service.core import lora_registry
from scheduler_service.core.lora_registry import Adapter, LoraError, LoraRegistry
from scheduler_service.engine.client import EngineFacts
from scheduler_service.engine.lora_loader import AdapterLoader
from scheduler_service.ports import StartupError

log = structlog.get_logger("planserve.lora")

CLOSED_DOOR = "runtime LoRA loading is disabled (start the scheduler with --enable-runtime-lora)"


def loaders_of(frontend: object) -> list[AdapterLoader]:
    """The adapter loader of each model service behind a frontend (one EngineLoop, or a
    ReplicaSet's replicas that are up)."""
    replicas = getattr(frontend, "replicas", None)
    if replicas is not None:
        return [r.loop.adapters for r in replicas if r.up]
    return [frontend.adapters] if hasattr(frontend, "adapters") else []


def schedulers_of(frontend: object) -> list:
    replicas = getattr(frontend, "replicas", None)
    if replicas is not None:
        return [r.scheduler for r in replicas]
    return [frontend.scheduler]  # type: ignore[attr-defined]


class LoraAdmin:
    """The registry and the operations on it (one per scheduler process)."""

    def __init__(self, config: SchedulerConfig, registry: Optional[LoraRegistry] = None):
        self.config = config
        self.registry = registry or LoraRegistry()

    async def load_modules(self, frontend: object, facts: EngineFacts) -> None:
        """--lora-modules, loaded on every model service; StartupError naming the module the
        model service refused, or an engine without LoRA."""
        modules = lora_registry.parse_modules(self.config.lora_modules)
        if modules and facts.lora is None:
            raise StartupError(
                "--lora-modules: the model service serves no LoRA adapters "
                "(start it with --enable-lora)"
            )
        for name, path in modules:
            if name == facts.model_name:
                raise StartupError(f"--lora-modules {name}={path}: the base model's name")
            adapter = Adapter(name, self.registry.reserve(name), path)
            try:
                rank = await self._load_everywhere(frontend, adapter)
            except LoraError as error:
                if error.kind != "unavailable":
                    self.registry.release(name)
                    raise StartupError(f"--lora-modules {name}={path}: {error.message}") from None
                # The model service is down (its loop reconnects): loaded on first use.
                log.warning("lora_module_not_loaded_yet", lora_name=name, error=error.message)
                rank = 0
            self.registry.add(Adapter(name, adapter.lora_id, path, rank))
            log.info("lora_module_loaded", lora_name=name, lora_path=path, rank=rank)

    async def load(self, frontend: object, facts: EngineFacts, name: str, path: str) -> Adapter:
        """A run-time load (LoraError: not_found for a closed door, invalid naming the field,
        conflict for a name in use, unavailable when no model service can take it now)."""
        if not self.config.enable_runtime_lora:
            raise LoraError("not_found", "", CLOSED_DOOR)
        lora_registry.check_name(name, facts.model_name)
        real = lora_registry.confined_path(self.config.lora_root, path)
        if facts.lora is None:
            raise LoraError(
                "invalid", "lora_name", "the model service serves no LoRA adapters (--enable-lora)"
            )
        adapter = Adapter(name, self.registry.reserve(name), real)
        try:
            rank = await self._load_everywhere(frontend, adapter)
        except BaseException:
            self.registry.release(name)
            raise
        loaded = Adapter(name, adapter.lora_id, real, rank)
        self.registry.add(loaded)
        log.info("lora_loaded_at_run_time", lora_name=name, lora_path=real, rank=rank)
        return loaded

    async def unload(self, frontend: object, name: str) -> None:
        """A run-time unload: refused (conflict) while any request, running or waiting, uses
        the adapter; then new requests no longer find it and each model service evicts it."""
        if not self.config.enable_runtime_lora:
            raise LoraError("not_found", "", CLOSED_DOOR)
        if name not in self.registry.adapters:
            raise LoraError("not_found", "lora_name", f"The model `{name}` does not exist.")
        in_use = sum(s.loras.in_flight.get(name, 0) for s in schedulers_of(frontend))
        if in_use:
            raise LoraError(
                "conflict",
                "lora_name",
                f"lora_name: the adapter {name!r} is in use by {in_use} requests "
                "(running or waiting); unload it once they finish",
            )
        self.registry.remove(name)
        for loader in loaders_of(frontend):
            loader.unload(name)
        log.info("lora_unloaded", lora_name=name)

    async def _load_everywhere(self, frontend: object, adapter: Adapter) -> int:
        """Loads on every model service that has room; the rank the model service read. A
        refusal evicts it from those that took it."""
        loaders = loaders_of(frontend)
        rank = None
        done: list[AdapterLoader] = []
        try:
            for loader in loaders:
                reply = await loader.load_now(adapter)
                if reply is not None:
                    done.append(loader)
                    rank = reply.rank
        except LoraError:
            for loader in done:
                loader.unload(adapter.name)
            raise
        if rank is None:
            raise LoraError(
                "unavailable",
                "lora_name",
                "no model service can take the adapter now: every loaded adapter is in use "
                "(max_cpu_loras)",
            )
        return rank
