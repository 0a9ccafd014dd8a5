"""The profiling forward: before the KV cache is allocated on CUDA, the runner executes the
largest steps the scheduler may send on a scratch cache and measures the memory they peak at,
so that the KV budget leaves it free (as vLLM's profile run does). Without it, a budget taken as
a fraction of the free memory could leave too little for the first long prefill, and the
service would die of out-of-memory under load instead of refusing to start.

The steps are real plans run through the runner's own `execute` (checks, input building,
forward, logits processing, sampling, logprobs), so the profile sees every allocation a served
step makes. Two shapes share the token count of the step shape chosen for the device
(step_shape.py: `profile_step_tokens`, else the device's budget):

    long    as few sequences as max_model_len allows, one prompt each: the attention
            workspace at its largest (the torch attention path pads to the longest query)
    many    min(the step's sequences, tokens) sequences splitting the tokens: the most sampled rows,
            so the largest logits, sampling and logprob tensors

Both sample with top-k, top-p, a repetition penalty and logprobs, the costliest sampling path.
Every slot is dropped afterwards; the runner's sampling is counter-based (seed, position), so
a profiled runner serves the same tokens as one that never profiled.

On the CPU no profile runs: the host budget comes from MemAvailable, and a step's activations
(~100s of MB for SmolLM2 at 2,048 tokens) are small beside the host's memory.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch

from model_service.step.plan import ComputedStep, LogitsProcessing, PlanArrays, SlotRegistration

# With profile_plan's top-k and top-p, every part of the sampler, a penalty and the logprob
# gather run.
_PROFILE_PROCESSING = LogitsProcessing(repetition_penalty=1.1, num_logprobs=20)


class StepExecutor(Protocol):
    """What the profile needs of the runner: one step's execution."""

    def execute(self, plan: PlanArrays) -> ComputedStep: ...


def sequence_lengths(tokens: int, max_num_slots: int, max_model_len: int) -> list[list[int]]:
    """The prompt lengths of the two profiled steps (the module docstring): `long` first, then
    `many`; each step's lengths sum to `tokens`, none exceeds max_model_len, neither step has
    more than max_num_slots sequences (tokens beyond what the slots hold are dropped)."""
    tokens = min(tokens, max_num_slots * max_model_len)
    full, rest = divmod(tokens, max_model_len)
    long = [max_model_len] * full + ([rest] if rest else [])
    count = min(max_num_slots, tokens)
    share, extra = divmod(tokens, count)
    many = [share + 1] * extra + [share] * (count - extra)
    return [long, many] if long != many else [long]


def blocks_needed(lengths: list[list[int]], block_size: int) -> int:
    """KV blocks the scratch cache needs for the profiled steps, block 0 (reserved) included."""
    return 1 + max(sum(-(-n // block_size) for n in step) for step in lengths)


def profile_plan(step_id: int, lengths: list[int], block_size: int, vocab_size: int) -> PlanArrays:
    """One step registering len(lengths) prompts of those lengths in slots 0.., all scheduled
    whole, on blocks 1.. in order. The token ids cycle through the vocabulary (any ids do; the
    repetition penalty then has a history to scan)."""
    num_blocks = np.array([-(-n // block_size) for n in lengths], dtype=np.int64)
    sequences = [
        SlotRegistration(
            slot=slot,
            token_ids=(np.arange(n, dtype=np.int64) % vocab_size).astype(np.int32),
            num_computed_tokens=0,
            temperature=1.0,
            top_k=50,
            top_p=0.9,
            seed=0,
            processing=_PROFILE_PROCESSING,
        )
        for slot, n in enumerate(lengths)
    ]
    empty = np.zeros(0, dtype=np.int64)
    return PlanArrays(
        step_id=step_id,
        new_sequences=sequences,
        slots=np.arange(len(lengths), dtype=np.int64),
        num_scheduled_tokens=np.array(lengths, dtype=np.int64),
        num_new_blocks=num_blocks,
        new_block_ids=np.arange(1, 1 + int(num_blocks.sum()), dtype=np.int64),
        finished_slots=empty,
        preempted_slots=empty,
        aborted_slots=empty,
        copy_src=empty,
        copy_dst=empty,
    )


def run_profile_steps(
    runner: StepExecutor, lengths: list[list[int]], block_size: int, vocab_size: int
) -> list[ComputedStep]:
    """Executes each profiled step, then drops its slots (a plan of finished slots only);
    returns what each profiled step computed."""
    computed = []
    empty = np.zeros(0, dtype=np.int64)
    for step_id, step in enumerate(lengths):
        plan = profile_plan(-1 - step_id, step, block_size, vocab_size)
        computed.append(runner.execute(plan))
        runner.execute(
            dataclasses.replace(
                plan,
                new_sequences=[],
                slots=empty,
                num_scheduled_tokens=empty,
                num_new_blocks=empty,
                new_block_ids=empty,
                finished_slots=plan.slots,
            )
        )
    return computed


def peak_step_bytes(
    runner: StepExecutor,
    lengths: list[list[int]],
    block_size: int,
    vocab_size: int,
    device: torch.device,
) -> int:
    """CUDA: the bytes the profiled steps allocate at their peak above what was allocated
    before them (weights and the scratch cache), from the caching allocator's statistics. The
    runner releases the cached blocks once the scratch cache is gone too."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_profile_steps(runner, lengths, block_size, vocab_size)
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)
