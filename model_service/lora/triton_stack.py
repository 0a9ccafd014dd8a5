"""The LoRA path on CUDA: the grouped Triton kernels (lora/triton_lora.py) over a device stack of
the loaded adapters, called from the layers' LoRA hook, eagerly and inside the captured steps.

Which path a step with adapter rows runs is decided once, at start (`kernel_path`, the one
decider): the Triton kernels on CUDA where Triton is importable, unless the config's lora_kernel
"torch" forces the torch grouped path (lora/grouping.py); "triton" forces the kernels on any
device (on the CPU under Triton's interpreter, TRITON_INTERPRET=1: how CI checks the forward
through them).

The stack (`TritonStack`) is allocated once, at start, before the KV cache is sized (so the budget
counts it like the weights): max_cpu_loras slots, each adapter's factors copied into its slot on
load, padded with zeros to max_lora_rank. Per layer and fused module:

    a    [S, targets x R, K]   each target's A in its own R rows (by TARGET_MODULES order)
    b_t  [S, N_t, R]           per target t: its B, expanded into its columns of the output
    scale [S] float32          the slot's adapter's scale

Why a fixed stack and not re-pointed pointers or a graph per adapter set: a captured graph reads
fixed addresses, and the store changes its adapters at run time (load and evict on another
thread). Copying into preallocated slots keeps every address the graphs hold valid for the
service's life, so a load or evict never recaptures (seconds, and a pool per version) and the
memory is known at start. The cost: the stack holds every slot's max_lora_rank whatever the
adapters' ranks, and a load copies its factors once. A slot is written only while free: the
scheduler evicts only adapters no sequence runs with, and a load's copies run on the device's
default stream, after the steps already queued on it. In this mode the adapters' own tensors stay
on the host (the slots are their device copy).

Each row's slot comes from the step's view of the store (`TritonView`: the slots of the adapters
loaded when the step began); a base-model row's slot is -1, which every program leaves untouched.
In a captured step the row slots live in the padded step's static buffers (padding rows -1).
"""

from __future__ import annotations

import collections
import dataclasses
import os

import numpy as np
import torch

from model_service.lora import triton_lora
from model_service.lora.peft_folder import Adapter, _weight
from model_service.lora.targets import FUSED_MODULES, TARGET_MODULES, ModelTargets

FIELD = "lora_kernel (PLANSERVE_LORA_KERNEL)"


def kernel_path(device: torch.device, requested: str) -> tuple[str, str]:
    """("triton" or "torch", why): the LoRA path of a model on `device`; `requested` is
    the config's lora_kernel ("auto", "triton" or "torch": the config checks the choice).
    ValueError names the field when a forced path cannot run."""
    if requested == "torch":
        return "torch", "lora_kernel=torch"
    if triton_lora.triton is None:
        if requested == "triton":
            raise ValueError(f"{FIELD}: 'triton' needs Triton, which is not installed")
        return "torch", "Triton is not installed"
    if requested == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"{FIELD}: 'triton' on device {device.type} needs Triton's interpreter "
                "(TRITON_INTERPRET=1)"
            )
        return "triton", "lora_kernel=triton"
    if device.type != "cuda":
        return "torch", f"device {device.type}"
    return "triton", "CUDA"


@dataclasses.dataclass
class ModuleSlots:
    """One fused module of one layer: the slots' stacked A, and per target (its offset in the
    shrink's output, its B, its first output column)."""

    a: torch.Tensor
    parts: list[tuple[str, int, torch.Tensor, int]]


class TritonStack:
    """max_cpu_loras slots of every layer's factors on the device (module docstring)."""

    def __init__(
        self,
        targets: ModelTargets,
        slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.slots, self.rank, self.targets = slots, max_rank, targets
        self.scale = torch.zeros(slots, dtype=torch.float32, device=device)
        self.layers: list[dict[str, ModuleSlots]] = []
        for _ in range(targets.num_layers):
            modules = {}
            for fused in FUSED_MODULES:
                names = [t for t in TARGET_MODULES if targets.slices[t].fused == fused]
                k = targets.slices[names[0]].in_features
                a = torch.zeros((slots, len(names) * max_rank, k), dtype=dtype, device=device)
                parts = []
                for i, name in enumerate(names):
                    place = targets.slices[name]
                    b = torch.zeros(
                        (slots, place.out_features, max_rank), dtype=dtype, device=device
                    )
                    parts.append((name, i * max_rank, b, place.start))
                modules[fused] = ModuleSlots(a, parts)
            self.layers.append(modules)
        self._free = collections.deque(range(slots))  # the longest free is reused first

    @property
    def num_bytes(self) -> int:
        tensors = [m.a for layer in self.layers for m in layer.values()]
        tensors += [b for layer in self.layers for m in layer.values() for _, _, b, _ in m.parts]
        return sum(t.numel() * t.element_size() for t in tensors) + self.scale.nbytes

    def put(self, adapter: Adapter) -> int:
        """Copies the adapter's factors into a free slot (zeros where it has no target) and
        returns the slot; the caller publishes it to steps afterwards."""
        if not self._free:
            raise RuntimeError("LoRA stack: no free slot (the store bounds the loaded adapters)")
        slot = self._free.popleft()
        for index, modules in enumerate(self.layers):
            pieces = _per_target(adapter, index, self.targets)
            for module in modules.values():
                module.a[slot].zero_()
                for name, r0, b, _start in module.parts:
                    b[slot].zero_()
                    if name in pieces:
                        a_t, b_t = pieces[name]
                        module.a[slot, r0 : r0 + a_t.shape[0]].copy_(a_t)
                        b[slot, :, : b_t.shape[1]].copy_(b_t)
        self.scale[slot] = adapter.scale
        return slot

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def hook(self, row_slot: torch.Tensor) -> "TritonLoraStep":
        """The layers' LoRA hook over this stack for rows whose slots `row_slot` holds (what a
        captured step builds over its static buffer)."""
        return TritonLoraStep(self, row_slot)


def _per_target(
    adapter: Adapter, layer: int, targets: ModelTargets
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{target: (A [r, in], B [out_t, r])} of one layer, out of its fused pairs (a fused pair's
    A stacks its targets' A, its B is block-diagonal over their columns: peft_folder.fuse_pairs)."""
    found = {}
    rank = adapter.rank
    for pairs in adapter.layers[layer].values():
        for pair in pairs:
            a, b = _weight(pair.a), _weight(pair.b)
            column = 0
            for name in pair.target.split("+"):
                place = targets.slices[name]
                rows = slice(place.start - pair.start, place.end - pair.start)
                found[name] = (a[column : column + rank], b[rows, column : column + rank])
                column += rank
    return found


class TritonView:
    """A step's view of the stack: the slot of each adapter loaded when the step began."""

    def __init__(self, stack: TritonStack, slot_of: dict[int, int]) -> None:
        self.stack, self.slot_of = stack, slot_of

    def row_slots(self, row_lora: np.ndarray) -> np.ndarray:
        """Each row's slot (-1: a base-model row), a loop over the loaded adapters, not rows."""
        slots = np.full(row_lora.shape, -1, dtype=np.int64)
        for lora_id, slot in self.slot_of.items():
            slots[row_lora == lora_id] = slot
        return slots

    def step(self, row_lora: np.ndarray, device: torch.device) -> TritonLoraStep:
        return TritonLoraStep(self.stack, row_slot_host=self.row_slots(row_lora), device=device)


class TritonLoraStep:
    """The layers' LoRA hook on the Triton path: `layer(i).add_(fused, x, y)` as lora/grouping's
    LoraStep. `row_slot`: each row's slot on the device (a captured step's static buffer);
    `row_slot_host`: the same on the host, which a padded step copies into its buffers.

    Given only `row_slot_host` (a step's view of the store), the device copy is made when a layer
    first asks for it: an unpadded step. A padded step reads its own buffer's copy and never asks,
    so it makes no copy of its own, which from pageable memory would wait for every step queued
    on the device before it (a step launched ahead, model_service/step/launch_ahead.py)."""

    stacked = None  # not the native loop's packed stack (models/llama.py)

    def __init__(
        self,
        stack: TritonStack,
        row_slot: torch.Tensor | None = None,
        row_slot_host: np.ndarray | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.stack, self._row_slot, self.row_slot_host = stack, row_slot, row_slot_host
        self._device = device

    @property
    def row_slot(self) -> torch.Tensor:
        if self._row_slot is None:
            self._row_slot = torch.from_numpy(self.row_slot_host).to(self._device)
        return self._row_slot

    def layer(self, index: int) -> TritonLayerLora:
        return TritonLayerLora(self.stack.layers[index], self.stack, self.row_slot)


class TritonLayerLora:
    def __init__(
        self, modules: dict[str, ModuleSlots], stack: TritonStack, row_slot: torch.Tensor
    ) -> None:
        self.modules, self.stack, self.row_slot = modules, stack, row_slot

    def add_(self, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += each row's adapter's products for `fused`: one shrink of the module's targets,
        one expand per target from its columns of the shrink's output; returns y."""
        module = self.modules[fused]
        xa = triton_lora.shrink(x, module.a, self.row_slot)
        rank = self.stack.rank
        for _name, r0, b, start in module.parts:
            triton_lora.expand_(y, xa[:, r0 : r0 + rank], b, self.stack.scale, self.row_slot, start)
        return y
