"""LoRA adapters in the offline API (docs/lora.md, "Offline"): vLLM's `LoRARequest`.

    llm = LLM(model="smollm2", enable_lora=True, max_loras=2, max_lora_rank=16)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

The served path's parts, in one process. An adapter a LoRARequest names is registered with the
scheduler's registry (core/lora_registry.py) and loaded on the runner at once, as `--lora-modules`
are at a server's start, so a bad folder is refused by generate() before anything runs and is not
left behind. From then on the scheduler's admission rule and residency (core/lora_admission.py,
core/loras.py) decide the steps, and engine/lora_loader.py's AdapterLoader runs their loads and
evictions on InProcessEngine's load_adapter / evict_adapter. Those coroutines never wait (the
runner reads the folder on this thread), so each runs to its end at once, without an event loop:
generate() also works where one runs already (a notebook). The paths are the caller's own, taken
as given like `--lora-modules` (no adapter root).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Coroutine, Optional, Sequence, TypeVar, Union

import grpc

from scheduler_service.core import lora_registry
from scheduler_service.core.lora_registry import Adapter, LoraError, LoraRegistry
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.lora_loader import AdapterLoader

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """One adapter, by vLLM's fields: `lora_name` (what the outputs and the prefix cache know it
    by), `lora_int_id` (> 0, the caller's id for it) and `lora_path` (a PEFT folder)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an int > 0, got {self.lora_int_id!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


LoraRequests = Union[LoRARequest, Sequence[Optional[LoRARequest]], None]


def run_now(work: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine that never waits to its end, here; RuntimeError if it waits."""
    try:
        work.send(None)
    except StopIteration as done:
        return done.value
    work.close()
    raise RuntimeError("an in-process adapter operation waited for an event loop")


def rpc_error(code: str, message: str) -> grpc.aio.AioRpcError:
    """A runner's refusal (AdapterError's code and message) as the status the model service's
    servicer sends for it, which engine/lora_loader.py maps to a LoraError."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode[code], grpc.aio.Metadata(), grpc.aio.Metadata(), details=message
    )


class InProcessAdapterLoader(AdapterLoader):
    """AdapterLoader over InProcessEngine: each load and eviction runs at once, on this thread."""

    def _spawn(self, work: Coroutine) -> None:
        run_now(work)


class OfflineAdapters:
    """The adapters one LLM serves: registered on first use, kept for later generate() calls."""

    def __init__(self, scheduler: Scheduler, engine: Any, model_name: str):
        self.scheduler = scheduler
        self.model_name = model_name
        self.registry = LoraRegistry()
        self.loader = InProcessAdapterLoader(scheduler, engine, self.registry, lambda: None)
        self._int_ids: dict[str, int] = {}  # name -> the caller's lora_int_id

    def pump(self) -> None:
        """The loads and evictions the scheduler asked for since the last call, done now."""
        if self.scheduler.loras.enabled:
            self.loader.pump()

    def resolve(self, lora_request: LoraRequests, num_prompts: int) -> list[Optional[Adapter]]:
        """Each prompt's adapter (None: the base model), registering and loading new ones;
        ValueError naming the field for bad input."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            wanted: list[Optional[LoRARequest]] = [lora_request] * num_prompts
        else:
            wanted = list(lora_request)
            if len(wanted) != num_prompts:
                raise ValueError(f"lora_request: {len(wanted)} for {num_prompts} prompts")
        adapters: dict[LoRARequest, Adapter] = {}
        for lora in wanted:
            if lora is not None and not isinstance(lora, LoRARequest):
                raise ValueError(f"lora_request: a LoRARequest or None, got {type(lora).__name__}")
            if lora is not None and lora not in adapters:
                adapters[lora] = self._adapter(lora)
        return [None if lora is None else adapters[lora] for lora in wanted]

    def _adapter(self, lora: LoRARequest) -> Adapter:
        if self.scheduler.loras.capacity is None:
            raise ValueError(
                f"lora_request: adapter {lora.lora_name!r} asked for, but LoRA is not enabled "
                "(LLM(..., enable_lora=True))"
            )
        path = os.path.abspath(lora.lora_path) if lora.lora_path else ""
        known = self.registry.adapters.get(lora.lora_name)
        if known is not None:
            if known.path != path:
                raise ValueError(
                    f"lora_request.lora_path: adapter {lora.lora_name!r} is loaded from "
                    f"{known.path!r}, not {path!r} (give a new adapter a new name)"
                )
            if self._int_ids[known.name] != lora.lora_int_id:
                raise ValueError(
                    f"lora_request.lora_int_id: adapter {lora.lora_name!r} has id "
                    f"{self._int_ids[known.name]}, not {lora.lora_int_id}"
                )
            return known
        owner = next((n for n, i in self._int_ids.items() if i == lora.lora_int_id), None)
        if owner is not None:
            raise ValueError(
                f"lora_request.lora_int_id: {lora.lora_int_id} already names adapter "
                f"{owner!r}, not {lora.lora_name!r}"
            )
        return self._register(lora.lora_name, path, lora.lora_int_id)

    def _register(self, name: str, path: str, int_id: int) -> Adapter:
        """Registers and loads one adapter, as a server's --lora-modules entry; a refused one
        leaves neither a registry entry nor a loaded adapter."""
        try:
            lora_registry.check_name(name, self.model_name)
            if not path:
                raise LoraError("invalid", "lora_path", "lora_path: must not be empty")
            adapter = Adapter(name, self.registry.reserve(name), path)
        except LoraError as error:
            raise ValueError(f"lora_request.{error.message}") from None
        try:
            reply = run_now(self.loader.load_now(adapter))
        except LoraError as error:
            self.registry.release(name)
            raise ValueError(f"lora_request.{error.message}") from None
        except BaseException:
            self.registry.release(name)
            raise
        # None: every loaded adapter runs (not between two generate() calls); it loads when
        # its first request is scheduled, as a --lora-modules entry whose engine was down.
        rank = reply.rank if reply is not None else 0
        registered = Adapter(name, adapter.lora_id, path, rank)
        self.registry.add(registered)
        self._int_ids[name] = int_id
        return registered
