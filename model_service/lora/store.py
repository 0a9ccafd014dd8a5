"""The loaded adapters by lora_id: what LoadAdapter adds and EvictAdapter drops, read by each step.

Loading runs on the calling (unary RPC's) thread and never holds the lock while it reads: the
lock covers the id's reservation and the final insert only, so a step (which takes a snapshot of
the loaded adapters at its start, model_service/runner.py) never waits for a load. An adapter
evicted while a step runs stays alive in that step's snapshot until the step ends.

On the Triton path (CUDA; lora/triton_stack.py) the store owns the device stack the kernels
read, allocated at start: a load copies the adapter into a free slot, an evict frees its slot,
and the adapters' own tensors stay on the host.
"""

from __future__ import annotations

import threading
from typing import Optional

import structlog
import torch

from model_service.lora.peft_folder import Adapter, AdapterError, read_adapter
from model_service.lora.stacked import LoadedStack
from model_service.lora.targets import TARGET_MODULES, ModelTargets
from model_service.lora.triton_stack import TritonStack, TritonView

log = structlog.get_logger(__name__)


class AdapterStore:
    """At most max_cpu_loras adapters, each complete or absent."""

    def __init__(
        self,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        targets: Optional[ModelTargets],
        dtype: torch.dtype,
        device: torch.device,
        gemm_isa: Optional[str] = None,
        kernel: str = "torch",
    ) -> None:
        """`kernel`: the LoRA path (triton_stack.kernel_path): "triton" allocates the device
        stack now (a model with layers), "torch" the grouped or packed products."""
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.target_modules = TARGET_MODULES
        self._targets = targets
        self._dtype, self._device, self._gemm_isa = dtype, device, gemm_isa
        self._lock = threading.Lock()
        self._loaded: dict[int, Adapter] = {}
        self._loading: set[int] = set()
        # Packed factors (a bfloat16 CPU model): a step's adapters run stacked (lora/stacked.py).
        packed = gemm_isa is not None and dtype == torch.bfloat16 and device.type == "cpu"
        self._stack_isa = gemm_isa if packed else None
        self._stack: Optional[LoadedStack] = None
        self._build_lock = threading.Lock()  # one stack build at a time, loads and evicts
        self.triton: Optional[TritonStack] = None
        self._slot_of: dict[int, int] = {}  # the Triton stack's slot per loaded adapter
        if kernel == "triton" and targets is not None:
            self.triton = TritonStack(targets, max_cpu_loras, max_lora_rank, dtype, device)
            log.info("lora_stack_allocated", slots=max_cpu_loras, rank=max_lora_rank,
                     num_bytes=self.triton.num_bytes)  # fmt: skip
            self._stack_isa = None
            self._gemm_isa = None  # the factors stay dense: they are copied into the slots
            self._device = torch.device("cpu")  # the slots are the adapters' device copy

    def load(self, lora_id: int, name: str, folder: str) -> Adapter:
        """Reads the folder and keeps it under lora_id; AdapterError when refused."""
        if lora_id == 0:
            raise AdapterError("INVALID_ARGUMENT", "lora_id: 0 is the base model; ids start at 1")
        self._reserve(lora_id)
        try:
            adapter = read_adapter(
                lora_id,
                name,
                folder,
                self.max_lora_rank,
                self._targets,
                self._dtype,
                self._device,
                self._gemm_isa,
            )
        except BaseException:
            with self._lock:
                self._loading.discard(lora_id)
            raise
        with self._build_lock:  # the stack with it, built before any step can see it
            stack = self._build_stack(adapter)
            slot = self.triton.put(adapter) if self.triton is not None else None
            with self._lock:
                self._loading.discard(lora_id)
                self._loaded[lora_id] = adapter
                self._stack = stack
                if slot is not None:  # a new dict: steps' views keep theirs
                    self._slot_of = {**self._slot_of, lora_id: slot}
        log.info(
            "lora_loaded",
            lora_id=lora_id,
            lora_name=name,
            rank=adapter.rank,
            targets=",".join(adapter.target_modules),
            num_bytes=adapter.num_bytes,
        )
        return adapter

    def _reserve(self, lora_id: int) -> None:
        with self._lock:
            if lora_id in self._loaded or lora_id in self._loading:
                raise AdapterError("ALREADY_EXISTS", f"lora_id: {lora_id} is already loaded")
            if len(self._loaded) + len(self._loading) >= self.max_cpu_loras:
                raise AdapterError(
                    "RESOURCE_EXHAUSTED",
                    f"lora_id: {lora_id} would exceed --max-cpu-loras {self.max_cpu_loras} "
                    "loaded adapters; evict one first",
                )
            self._loading.add(lora_id)

    def evict(self, lora_id: int) -> None:
        with self._lock:
            if self._loaded.pop(lora_id, None) is None:
                raise AdapterError("NOT_FOUND", f"lora_id: {lora_id} is not loaded")
            if self.triton is not None:  # freed with the count: a load may follow at once
                slot_of = dict(self._slot_of)
                self.triton.free(slot_of.pop(lora_id))
                self._slot_of = slot_of
        with self._build_lock:  # until rebuilt, the stack still holds it: extra products only
            stack = self._build_stack(None)
            with self._lock:
                self._stack = stack
        log.info("lora_evicted", lora_id=lora_id)

    def snapshot(self) -> dict[int, Adapter]:
        """The loaded adapters now (a step's view: later loads and evicts do not change it)."""
        with self._lock:
            return dict(self._loaded)

    @property
    def stacked(self) -> bool:
        """Whether steps run the stacked products (packed factors: bf16 on the CPU)."""
        return self._stack_isa is not None

    def step_view(self) -> tuple[dict[int, Adapter], Optional[LoadedStack | TritonView]]:
        """snapshot() and the stack holding (at least) those adapters, taken together: the
        packed stack (lora/stacked.py), the Triton stack's slots (lora/triton_stack.py), or None
        for the torch grouped path."""
        with self._lock:
            if self.triton is not None:
                return dict(self._loaded), TritonView(self.triton, self._slot_of)
            return dict(self._loaded), self._stack

    def _build_stack(self, adding: Optional[Adapter]) -> Optional[LoadedStack]:
        """The loaded adapters' stack (with `adding`), under _build_lock; None when unpacked."""
        if self._stack_isa is None:
            return None
        adapters = [a for _, a in sorted(self.snapshot().items())]
        if adding is not None:
            adapters.append(adding)
        if not adapters or not adapters[0].layers or self._targets is None:
            return None
        return LoadedStack(tuple(adapters), self._stack_isa, self._targets.slices)

    def __len__(self) -> int:
        with self._lock:
            return len(self._loaded)


def new_store(loaded, config, kernel: str = "torch") -> Optional[AdapterStore]:
    """The adapter store of a model service started with --enable-lora (None without). A model
    without decoder layers (the null model) checks each folder and keeps no weights. `kernel`:
    the LoRA path (lora/triton_stack.py kernel_path)."""
    if not config.enable_lora:
        return None
    from model_service.kernels.gemm import PackedLinear
    from model_service.lora.targets import model_targets

    parameter = next(loaded.model.parameters())
    # The factors are packed for the model's native GEMM path where its linears are.
    isa = next((m.isa for m in loaded.model.modules() if isinstance(m, PackedLinear)), None)
    has_layers = hasattr(loaded.model, "decoder_loop_reason")
    return AdapterStore(
        config.max_loras,
        config.max_lora_rank,
        config.max_cpu_loras or config.max_loras,
        model_targets(loaded.arch) if has_layers else None,
        parameter.dtype,
        parameter.device,
        isa,
        kernel,
    )
