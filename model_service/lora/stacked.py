"""Every loaded adapter in one shrink per fused module and one expand per target (packed GEMM).

Where the factors are packed for the native GEMM (a bfloat16 model on the CPU), a step does not
loop over its adapters: for each fused module the loaded adapters' A are stacked along the rank
axis (by target, then adapter, each block of K padded to an even size) and each target's B side
by side along it, and

    u = x @ A_all^T              [T, K]  every row against every loaded adapter's A (one GEMM)
    u *= mask                    [T, K]  1 in the row's own adapter's blocks, 0 elsewhere (exact)
    d = u[:, t] @ B_t^T          [T, out_t] float32 sums, per target t of the module
    y[:, cols_t] += d * scale    the row's adapter's scale (product rounded to float32, then
                                 the sum to bf16); base rows add exact zeros

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
    """One fused module of one layer: the loaded adapters' factors stacked, packed. K runs by
    target, then adapter: each target's expand reads its own slice of u, so no block-diagonal
    zeros are multiplied."""

    def __init__(self, a: torch.Tensor, owner: np.ndarray, parts: list, isa: str) -> None:
        self.a = _pack(a, isa)
        self.owner = owner  # [K]: the lora_id of each stacked rank, -2 padding
        # per target: its K slice [k0, k1), its B [columns, k1 - k0] packed, its columns
        self.parts = [(k0, k1, _pack(b, isa), start, end) for k0, k1, b, start, end in parts]
        # per target: int64 [adapters, 3] of (lora_id, first, end) K columns of each adapter's
        # block, its padding included: where the native loop's per-row products read
        # (cython_ext/csrc/lora_rows.h)
        self.blocks = [_blocks(owner, k0, k1) for k0, k1, *_ in parts]
        self._masks: dict[bytes, torch.Tensor] = {}

    def add_(self, x: torch.Tensor, y: torch.Tensor, row_owner: np.ndarray, scale: torch.Tensor):
        mask = self._mask(row_owner)
        u = _linear(self.a, x, torch.bfloat16)
        u.mul_(mask)
        for k0, k1, b, start, end in self.parts:
            delta = _linear(b, u[:, k0:k1], torch.float32)
            # The scale's product rounded before the sum (not addcmul_'s fused one), as the
            # native decoder loop computes it without an FMA on every x86-64 CPU.
            y[:, start:end].add_(delta.mul_(scale))

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


def _blocks(owner: np.ndarray, k0: int, k1: int) -> np.ndarray:
    """Each adapter's run of K columns in [k0, k1): from its first rank to the next adapter's
    (its padding, owner -2, included), so every block is even-sized at an even offset."""
    real = np.flatnonzero(owner[k0:k1] != -2)
    firsts = real[np.r_[True, owner[k0 + real[1:]] != owner[k0 + real[:-1]]]] if len(real) else real
    ends = np.r_[firsts[1:], k1 - k0]
    blocks = np.stack([owner[k0 + firsts], k0 + firsts, k0 + ends], axis=1)
    return np.ascontiguousarray(blocks, dtype=np.int64)


class LoadedStack:
    """The stacks of the loaded adapters, per layer and fused module (AdapterStore rebuilds it
    when one is loaded or evicted; a step uses the one of its snapshot)."""

    def __init__(self, adapters: tuple[Adapter, ...], isa: str, slices: dict) -> None:
        self.ids = tuple(a.lora_id for a in adapters)
        self.scales = {a.lora_id: a.scale for a in adapters}
        self.layers: list[dict[str, ModuleStack]] = []
        for index in range(len(adapters[0].layers) if adapters else 0):
            modules: dict[str, ModuleStack] = {}
            for fused in adapters[0].layers[index]:
                stack = _module_stack(adapters, index, fused, isa, slices)
                if stack is not None:
                    modules[fused] = stack
            self.layers.append(modules)


def _module_stack(
    adapters: tuple[Adapter, ...], index: int, fused: str, isa: str, slices: dict
) -> ModuleStack | None:
    """The module's factors of every adapter adapting it, or None where none does."""
    per_target: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for adapter in adapters:
        for pair in adapter.layers[index].get(fused, []):
            names = pair.target.split("+")  # fused at load: A stacked, B block-diagonal
            fa, fb = _dense(pair.a), _dense(pair.b)
            rank = fa.shape[0] // len(names)  # one rank per adapter (rank_pattern is refused)
            for j, name in enumerate(names):
                rows = slice(slices[name].start - pair.start, slices[name].end - pair.start)
                ranks = slice(j * rank, (j + 1) * rank)
                per_target.setdefault(name, []).append(
                    (adapter.lora_id, fa[ranks], fb[rows, ranks])
                )
    if not per_target:
        return None
    k = sum(fa.shape[0] + fa.shape[0] % 2 for f in per_target.values() for _, fa, _ in f)
    a = torch.zeros((k, next(iter(per_target.values()))[0][1].shape[1]), dtype=torch.bfloat16)
    owner = np.full(k, -2, dtype=np.int64)
    parts, column = [], 0
    for name in sorted(per_target, key=lambda n: slices[n].start):
        k0, place = column, slices[name]
        for lora_id, fa, _ in per_target[name]:
            a[column : column + fa.shape[0]] = fa
            owner[column : column + fa.shape[0]] = lora_id
            column += fa.shape[0] + fa.shape[0] % 2  # even offsets: the GEMM sums K by pairs
        b = torch.zeros((place.end - place.start, column - k0), dtype=torch.bfloat16)
        offset = 0
        for _, fa, fb in per_target[name]:
            b[:, offset : offset + fa.shape[0]] = fb
            offset += fa.shape[0] + fa.shape[0] % 2
        parts.append((k0, column, b, place.start, place.end))
    return ModuleStack(a, owner, parts, isa)


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
