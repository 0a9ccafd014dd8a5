"""Every loaded adapter in one shrink and one expand per fused module (packed native GEMM).

Where the factors are packed for the native GEMM (a bfloat16 model on the CPU), a step does not
loop over its adapters: for each fused module the loaded adapters' A are stacked along the
rank axis and their B side by side along it, each adapter in its own block of K (padded to an
even size), and

    u = x @ A_all^T            [T, K]  every row against every loaded adapter's A (one GEMM)
    u *= mask                  [T, K]  1 in the row's own adapter's block, 0 elsewhere (exact)
    d = u @ B_all^T            [T, out] float32 sums (one GEMM)
    y[:, lo:hi] += d * scale   the row's adapter's scale; base rows add exact zeros

A row's result is bitwise its result alone: the packed GEMM computes each output element as a
sum from zero over K in order, one pair of K at a time (model_service/kernels/gemm_driver.h),
whatever the other rows and columns; the masked blocks add pairs of exact zeros, which leave a
float32 sum unchanged, and even block offsets keep a block's pairs together. So the order of the
adapters in the stack, and which other adapters are in it, change no row's bits.

The stacks hold every loaded adapter, so no step builds anything: the store rebuilds them on
the loading (or evicting) thread before the change is visible to steps. A step therefore pays
the shrink and expand of every loaded adapter (--max-cpu-loras bounds them, --max-loras by
default), not only of those its rows run.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
from torch import nn

from model_service.kernels.gemm import PackedLinear
from model_service.lora.peft_folder import Adapter, WeightLinear

# LoRA factors' GEMMs are small (a rank's columns): below this many multiply-adds one thread
# runs them, as the fork and join of the second costs more than it saves.
ONE_THREAD_MACS = 1 << 22


class ModuleStack:
    """One fused module of one layer: the step's adapters' factors stacked, packed."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, owner: np.ndarray, lo: int, isa: str):
        self.a, self.b = _pack(a, isa), _pack(b, isa)
        self.owner = owner  # [K]: the lora_id of each stacked rank, -2 padding
        self.lo, self.hi = lo, lo + int(b.shape[0])
        self._masks: dict[bytes, torch.Tensor] = {}

    def add_(self, x: torch.Tensor, y: torch.Tensor, row_owner: np.ndarray, scale: torch.Tensor):
        mask = self._mask(row_owner)
        u = _linear(self.a, x, torch.bfloat16)
        u.mul_(mask)
        delta = _linear(self.b, u, torch.float32)
        y[:, self.lo : self.hi].addcmul_(delta, scale)

    def _mask(self, row_owner: np.ndarray) -> torch.Tensor:
        key = row_owner.tobytes()
        mask = self._masks.get(key)
        if mask is None:
            if len(self._masks) > 64:  # row layouts of past steps
                self._masks.clear()
            dense = row_owner[:, None] == self.owner[None, :]
            mask = torch.from_numpy(dense).to(torch.bfloat16)
            self._masks[key] = mask
        return mask


class LoadedStack:
    """The stacks of the loaded adapters, per layer and fused module (AdapterStore rebuilds it
    when one is loaded or evicted; a step uses the one of its snapshot)."""

    def __init__(self, adapters: tuple[Adapter, ...], isa: str) -> None:
        self.ids = tuple(a.lora_id for a in adapters)
        self.scales = {a.lora_id: a.scale for a in adapters}
        self.layers: list[dict[str, ModuleStack]] = []
        for index in range(len(adapters[0].layers) if adapters else 0):
            modules: dict[str, ModuleStack] = {}
            for fused in adapters[0].layers[index]:
                stack = _module_stack(adapters, index, fused, isa)
                if stack is not None:
                    modules[fused] = stack
            self.layers.append(modules)


def _module_stack(
    adapters: tuple[Adapter, ...], index: int, fused: str, isa: str
) -> ModuleStack | None:
    """The module's factors of every adapter adapting it, or None where none does."""
    pieces = [(a.lora_id, p) for a in adapters for p in a.layers[index].get(fused, [])]
    if not pieces:
        return None
    lo = min(p.start for _, p in pieces)
    hi = max(p.end for _, p in pieces)
    dense = [(_dense(p.a), _dense(p.b)) for _, p in pieces]
    ranks = [fa.shape[0] for fa, _ in dense]
    blocks = [r + r % 2 for r in ranks]  # even offsets: the GEMM sums K by pairs
    k, width = sum(blocks), dense[0][0].shape[1]
    a = torch.zeros((k, width), dtype=torch.bfloat16)
    b = torch.zeros((hi - lo, k), dtype=torch.bfloat16)
    owner = np.full(k, -2, dtype=np.int64)
    column = 0
    for (lora_id, pair), (fa, fb), rank, block in zip(pieces, dense, ranks, blocks):
        a[column : column + rank] = fa
        b[pair.start - lo : pair.end - lo, column : column + rank] = fb
        owner[column : column + rank] = lora_id
        column += block
    return ModuleStack(a, b, owner, lo, isa)


def _dense(factor: nn.Module) -> torch.Tensor:
    weight = factor.weight  # a PackedLinear unpacks a dense copy
    assert isinstance(weight, torch.Tensor)
    return weight


def _pack(weight: torch.Tensor, isa: str) -> PackedLinear:
    # PackedLinear reads weight (and a bias, none here) off its source, as off an nn.Linear
    # (whose own construction would fill a random weight first).
    return PackedLinear(cast(nn.Linear, WeightLinear(weight)), isa)


def _linear(module: PackedLinear, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    macs = x.shape[0] * module.in_features * module.out_features
    threads = 1 if macs < ONE_THREAD_MACS else torch.get_num_threads()
    return module.forward(x, out_dtype, threads)
