"""One eager forward of a step's packed inputs (cython_ext.mapping.StepInputs): the host arrays
to the model's device, the attention metadata built from them, the model called. The runner's
step and the draft model's both run through it. `StepClock` times a step's forward and sampling.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from cython_ext.mapping import StepInputs
from model_service.attention import cuda_attention
from model_service.attention.kv_cache import KVCache
from model_service.attention.paged import build_attention_metadata


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host index array as int64 on `device` (non-blocking: the step's kernels follow on the
    same stream). On the CPU the tensor shares the array's memory, as `.to` would return it, and
    skipping the call skips a dispatch a step pays for each of its inputs."""
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def run_forward(
    model: torch.nn.Module,
    kv_cache: KVCache,
    x: StepInputs,
    num_scheduled: np.ndarray,
    logits_indices: np.ndarray,
    block_size: int,
    device: torch.device,
    lora=None,
) -> torch.Tensor:
    """The logits of the packed rows `logits_indices` after one forward over `x`; `lora` (a
    model_service.lora.grouping.LoraStep): the step's rows grouped by adapter, None for none."""
    tiles = None
    arch = getattr(model, "arch", None)
    if device.type == "cuda" and arch is not None:  # the Triton kernel's grid, built here
        rows = cuda_attention.rows_per_tile(arch.num_attention_heads // arch.num_key_value_heads)
        tiles = to_device(cuda_attention.attention_tiles(num_scheduled, rows)[1], device)
    meta = build_attention_metadata(
        to_device(x.slot_mapping, device),
        to_device(x.query_start, device),
        to_device(num_scheduled, device),
        to_device(x.context_lens, device),
        to_device(x.block_tables, device),
        block_size,
        x.max_query_len,
        x.max_context_len,
        tiles,
    )
    args = (
        to_device(x.input_ids, device),
        to_device(x.positions, device),
        meta,
        kv_cache,
        to_device(logits_indices, device),
    )
    return model(*args) if lora is None else model(*args, lora=lora)


class StepClock:
    """A step's forward and sampling times (ComputedStep.forward_ns, sample_ns) with one wait for
    the device per step. On CUDA the forward is timed by events on the stream, and the wait is the
    sampler's own copy of the token ids to the host (a step that samples nothing waits on the end
    event instead, so its pinned inputs are free again before the next step writes them); sample_ns
    is the rest of the step's wall time. On the CPU both are wall times."""

    def __init__(self, device: torch.device) -> None:
        self.start_ns = time.perf_counter_ns()
        self.forward_ns = 0
        self.events = None
        if device.type == "cuda":
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record()
            self.events = (begin, end)

    def forward_launched(self) -> None:
        """After the forward's call: on the CPU it has run; on CUDA it is queued."""
        if self.events is None:
            self.forward_ns = time.perf_counter_ns() - self.start_ns
        else:
            self.events[1].record()

    def finish(self) -> tuple[int, int]:
        """(forward_ns, sample_ns), once the step's sampling returned."""
        if self.events is None:
            return self.forward_ns, time.perf_counter_ns() - self.start_ns - self.forward_ns
        begin, end = self.events
        end.synchronize()  # at once where the sampler's copy already waited
        total = time.perf_counter_ns() - self.start_ns
        forward = int(begin.elapsed_time(end) * 1e6)
        return forward, max(0, total - forward)
