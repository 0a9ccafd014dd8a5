"""The step shape the model service chooses for its device at start: the most tokens and the most
sequences of one step. It profiles that step before sizing the KV cache (start.py), reports it in
Describe (step_token_budget, step_max_seqs), and the scheduler plans by it unless its own flags
(--max-num-batched-tokens, --max-num-seqs) say otherwise.

    device   token budget                          sequences
    cpu      profile_step_tokens, else 512         min(64, max_num_slots)
    cuda     profile_step_tokens, else 8192         max_num_slots
             (2048 on a GPU under SMALL_GPU_BYTES)

The CPU's figures are the contract's (planserve/contract.py CPU_STEP), the same ones the scheduler
takes for an engine that reports none. On a GPU a step's forward costs about the same at a few
hundred tokens as at a few thousand (it is launch-bound), so a large budget lets prompts in without
stretching the decodes beside them, and the sequence limit is every slot the service holds (vLLM
defaults to thousands of tokens and hundreds of sequences on a GPU for the same reason).
"""

from __future__ import annotations

from typing import Optional

import torch

from model_service.config import ModelServiceConfig
from planserve.contract import CPU_STEP, StepShape

CUDA_TOKEN_BUDGET = 8192
# A GPU this small holds little KV beside the weights; a smaller step leaves it more (vLLM's
# smaller-GPU budget).
SMALL_GPU_BYTES = 16 << 30
SMALL_GPU_TOKEN_BUDGET = 2048


def choose(
    device_type: str,
    total_memory_bytes: int,
    max_num_slots: int,
    profile_step_tokens: Optional[int] = None,
) -> StepShape:
    """The step shape for a device of this type and total memory (the table above);
    profile_step_tokens, when given, is the token budget on any device."""
    if device_type == "cuda":
        default = CUDA_TOKEN_BUDGET
        if total_memory_bytes < SMALL_GPU_BYTES:
            default = SMALL_GPU_TOKEN_BUDGET
        max_seqs = max_num_slots
    else:
        default = CPU_STEP.token_budget
        max_seqs = min(CPU_STEP.max_seqs, max_num_slots)
    tokens = profile_step_tokens if profile_step_tokens is not None else default
    return StepShape(token_budget=tokens, max_seqs=max_seqs)


def total_memory_bytes(device: torch.device) -> int:
    """The device's total memory (CUDA), 0 for the CPU (its shape does not read it)."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.get_device_properties(device).total_memory)


def for_device(config: ModelServiceConfig, device: torch.device) -> StepShape:
    """The step shape of this service's config on `device`."""
    return choose(
        device.type, total_memory_bytes(device), config.max_num_slots, config.profile_step_tokens
    )
