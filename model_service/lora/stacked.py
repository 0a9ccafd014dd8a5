"""Every adapter of a step in one shrink and one expand per fused module (packed native GEMM).

Where the factors are packed for the native GEMM (a bfloat16 model on the CPU), a step does not
loop over its adapters: for each fused module the step's adapters' A are stacked along the
rank axis and their B side by side along it, each adapter in its own block of K (padded to an
even size), and

    u = x @ A_all^T            [T, K]  every row against every adapter's A (one GEMM)
    u *= mask                  [T, K]  1 in the row's own adapter's block, 0 elsewhere (exact)
    d = u @ B_all^T            [T, out] float32 sums (one GEMM)
    y[:, lo:hi] += d * scale   the row's adapter's scale; base rows add exact zeros

A row's result is bitwise its result alone: the packed GEMM computes each output element as a
sum from zero over K in order, one pair of K at a time (model_service/kernels/gemm_driver.h),
whatever the other rows and columns; the masked blocks add pairs of exact zeros, which leave a
float32 sum unchanged, and even block offsets keep a block's pairs together. So the order of the
adapters in the stack, and which other adapters are in it, change no row's bits.

The stacks depend on the step's set of adapters: they are built on a set's first step and kept
for the last few sets (StackCache; evicting an adapter drops the sets holding it).
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import torch
from torch import nn

from model_service.kernels.gemm import PackedLinear
from model_service.lora.peft_folder import Adapter

# A set of 8 rank-16 adapters on all targets of SmolLM2 stacks to ~120 MB: a few sets only.
CACHED_SETS = 4
# LoRA factors' GEMMs are small (a rank's columns): below this many multiply-adds one thread
# runs them, as the fork and join of the second costs more than it saves.
ONE_THREAD_MACS = 1 << 22


class ModuleStack:
    """One fused module of one layer: the step's adapters' factors stacked, packed."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, owner: np.ndarray, lo: int, isa: str):
        self.a, self.b = _pack(a, isa), _pack(b, isa)
        self.owner = owner  # [K]: the adapter (index in the set) of each stacked rank, -2 padding
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


class StepStack:
    """The stacks of one set of adapters, per layer and fused module."""

    def __init__(self, adapters: tuple[Adapter, ...], isa: str) -> None:
        self.ids = tuple(a.lora_id for a in adapters)
        self.scales = np.array([a.scale for a in adapters], dtype=np.float32)
        self.layers: list[dict[str, ModuleStack]] = []
        for index in range(len(adapters[0].layers)):
            modules: dict[str, ModuleStack] = {}
            for fused in adapters[0].layers[index]:
                stack = _module_stack(adapters, index, fused, isa)
                if stack is not None:
                    modules[fused] = stack
            self.layers.append(modules)


class StackCache:
    """The last CACHED_SETS sets' stacks, by their adapters (the store owns one)."""

    def __init__(self, isa: str) -> None:
        self.isa = isa
        self._lock = threading.Lock()
        self._sets: collections.OrderedDict[tuple[int, ...], tuple] = collections.OrderedDict()

    def get(self, adapters: tuple[Adapter, ...]) -> StepStack:
        key = tuple(id(a) for a in adapters)
        with self._lock:
            entry = self._sets.get(key)
            if entry is not None:
                self._sets.move_to_end(key)
                return entry[1]
        stack = StepStack(adapters, self.isa)
        with self._lock:  # the adapters are kept beside it, so no id() is reused under the key
            self._sets[key] = (adapters, stack)
            while len(self._sets) > CACHED_SETS:
                self._sets.popitem(last=False)
        return stack

    def drop(self, lora_id: int) -> None:
        """Forgets the sets holding lora_id (evicted: its memory goes when no step holds it)."""
        with self._lock:
            for key in [k for k, (_, s) in self._sets.items() if lora_id in s.ids]:
                del self._sets[key]


def _module_stack(
    adapters: tuple[Adapter, ...], index: int, fused: str, isa: str
) -> ModuleStack | None:
    """The module's factors of every adapter adapting it, or None where none does."""
    pieces = [(g, p) for g, a in enumerate(adapters) for p in a.layers[index].get(fused, [])]
    if not pieces:
        return None
    lo = min(p.start for _, p in pieces)
    hi = max(p.end for _, p in pieces)
    ranks = [_dense(p.a).shape[0] for _, p in pieces]
    blocks = [r + r % 2 for r in ranks]  # even offsets: the GEMM sums K by pairs
    k, width = sum(blocks), _dense(pieces[0][1].a).shape[1]
    a = torch.zeros((k, width), dtype=torch.bfloat16)
    b = torch.zeros((hi - lo, k), dtype=torch.bfloat16)
    owner = np.full(k, -2, dtype=np.int64)
    column = 0
    for (g, pair), rank, block in zip(pieces, ranks, blocks):
        a[column : column + rank] = _dense(pair.a)
        b[pair.start - lo : pair.end - lo, column : column + rank] = _dense(pair.b)
        owner[column : column + rank] = g
        column += block
    return ModuleStack(a, b, owner, lo, isa)


def _dense(factor: nn.Module) -> torch.Tensor:
    weight = factor.weight  # a PackedLinear unpacks a dense copy
    assert isinstance(weight, torch.Tensor)
    return weight


def _pack(weight: torch.Tensor, isa: str) -> PackedLinear:
    source = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
    source.weight = nn.Parameter(weight, requires_grad=False)
    return PackedLinear(source, isa)


def _linear(module: PackedLinear, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    macs = x.shape[0] * module.in_features * module.out_features
    threads = 1 if macs < ONE_THREAD_MACS else torch.get_num_threads()
    return module.forward(x, out_dtype, threads)
