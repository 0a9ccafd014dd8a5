"""A step's rows grouped by adapter, and the LoRA products added to the fused linears' outputs.

Each row of a step belongs to its slot's adapter (0: the base model). Where the factors are
packed for the native GEMM (a bf16 model on the CPU), the step's adapters run stacked, one shrink
and one expand per fused module for all of them (lora/stacked.py). Elsewhere `group_rows` makes
one group per distinct adapter of the step (at most max_loras), holding the rows' indices (on
the Triton path, CUDA's, each row's slot in the device stack instead: lora/triton_stack.py); a layer
then loops over those groups, never over rows:

    xs = x.index_select(0, rows)                     the group's rows of the layer's input
    y[:, start:end].index_add_(0, rows, scale * B(A(xs)))   once per fused module

(the module's targets fused at load: A stacked, B block-diagonal over their columns,
lora/peft_folder.py fuse_pairs), in the order PEFT computes base + lora_B(lora_A(x)) * scaling,
so float32 matches PEFT's unmerged model up to the GEMMs' own summation order. Both factors go
through layer_ops.linear (torch's GEMM with its few-row padding); gathering, scaling and the
indexed add are row by row. A row's result therefore never depends on the other rows of its step,
whatever adapters they run. Base-model rows are in no group: a step without adapter rows builds
no grouping at all and runs exactly the base path.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from model_service.kernels import layer_ops
from model_service.lora.peft_folder import Adapter
from model_service.lora.stacked import LoadedStack
from model_service.lora.triton_stack import TritonLoraStep, TritonView
from model_service.step.plan import PlanArrays, PlanError


@dataclasses.dataclass(frozen=True)
class AdapterRows:
    adapter: Adapter
    rows: torch.Tensor  # int64 row indices of the step, ascending, on the model's device


class LayerLora:
    """One layer's view of a step's groups."""

    def __init__(self, step: LoraStep, index: int) -> None:
        self.groups = step.groups
        self.index = index
        self._stacked = step.stacked

    def add_(self, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the fused module's output for x, [T, out]) += each group's LoRA products, in place;
        returns y."""
        if self._stacked is not None:
            stack, row_owner, scale = self._stacked
            module = stack.layers[self.index].get(fused)
            if module is not None:
                module.add_(x, y, row_owner, scale)
            return y
        for group in self.groups:
            pairs = group.adapter.layers[self.index][fused]
            if not pairs:
                continue
            xs = x.index_select(0, group.rows)
            for pair in pairs:
                delta = layer_ops.linear(pair.b, layer_ops.linear(pair.a, xs))
                delta = delta * group.adapter.scale
                y[:, pair.start : pair.end].index_add_(0, group.rows, delta)
        return y


class LoraStep:
    """The step's adapter groups (only built when some row runs an adapter), and where the
    factors are packed, their stacks with each row's place in them (lora/stacked.py)."""

    def __init__(
        self,
        groups: list[AdapterRows],
        stacked: tuple[LoadedStack, np.ndarray, torch.Tensor] | None = None,
    ) -> None:
        self.groups = groups
        self.stacked = stacked

    def layer(self, index: int) -> LayerLora:
        return LayerLora(self, index)


def group_rows(
    row_lora: np.ndarray,
    adapters: dict[int, Adapter],
    device: torch.device,
    stack: LoadedStack | TritonView | None = None,
) -> LoraStep | TritonLoraStep | None:
    """The groups of a step whose row r runs adapter row_lora[r] (0: base); None when no row
    runs one. With `stack` (packed factors: the loaded adapters stacked), one stacked product
    per module instead; with the Triton stack's view, each row's slot for the kernels."""
    if not row_lora.any():
        return None
    if isinstance(stack, TritonView):
        return stack.step(row_lora, device)
    ids = np.unique(row_lora[row_lora != 0])
    if stack is not None and stack.layers:
        scales = np.array([stack.scales.get(int(i), 0.0) for i in row_lora], dtype=np.float32)
        row_owner = row_lora.astype(np.int64)  # base rows (0) match no block
        return LoraStep([], (stack, row_owner, torch.from_numpy(scales)[:, None]))
    groups = []
    for lora_id in ids:
        rows = torch.from_numpy(np.flatnonzero(row_lora == lora_id)).to(device)
        groups.append(AdapterRows(adapters[int(lora_id)], rows))
    return LoraStep(groups)


def check_plan_adapters(
    plan: PlanArrays,
    slot_lora: np.ndarray,
    adapters: dict[int, Adapter] | None,
    max_loras: int,
) -> None:
    """PlanError naming the field when a new sequence names an adapter that is not loaded (or
    LoRA is off: adapters None), or the scheduled slots run more than max_loras distinct
    adapters or one no longer loaded. Changes nothing."""
    lora = slot_lora.copy() if plan.new_sequences else slot_lora
    for i, seq in enumerate(plan.new_sequences):
        lora[seq.slot] = seq.lora_id
        if not seq.lora_id:
            continue
        field = f"new_sequences[{i}].lora_id"
        if adapters is None:
            raise PlanError(field, f"{seq.lora_id}: LoRA is not enabled (--enable-lora)")
        if seq.lora_id not in adapters:
            raise PlanError(field, f"adapter {seq.lora_id} is not loaded (LoadAdapter first)")
    if adapters is None or plan.slots.size == 0:
        return
    scheduled = lora[plan.slots]
    distinct = np.unique(scheduled[scheduled != 0])
    if distinct.size > max_loras:
        raise PlanError("slots", f"{distinct.size} distinct adapters exceed max_loras {max_loras}")
    gone = [int(i) for i in distinct if int(i) not in adapters]
    if gone:
        slot = int(plan.slots[np.argmax(scheduled == gone[0])])
        raise PlanError("slots", f"slot {slot} runs adapter {gone[0]}, which is not loaded")
