"""Launch-ahead: a step queued on the device before the step in front of it has brought its
tokens to the host.

Why: on CUDA the model service's host work between two forwards (waiting for a step's token ids,
writing its result, reading, checking and building the next plan) left the GPU idle for part of
every step (docs/benchmarks.md, "Served after the host path"). The scheduler already sends step
N+1 while N runs (scheduler_service/engine/loop.py, overlap); with launch-ahead the model service
also queues N+1 on the device before it finishes N on the host:

    launch N      inputs copied, replayed, argmax, the ids' copy to pinned memory queued
    launch N+1    its inputs built on the host while N runs; a row whose input is a token N
                  samples takes it from N's ids on the device (the slot table holds a stand-in
                  until N finishes); queued behind N on the same stream
    finish N      wait for N's ids, write them into the slot table, answer N
    launch N+2 ...

What launches: a plan replayed from a padded step (the CUDA graphs, or cuda_graphs "eager") whose
diff needs nothing of the step in flight on the host: slots dropped, registered, handed blocks,
blocks copied for a fork and blocks swapped out and in (queued behind the step in flight on the
device: attention/kv_cache.py), and whose sample slots need nothing of the step in flight but its
ids on the device: greedy, or temperature, top-k, top-p and min-p with a seed (the draw reads the
position alone); a grammar's mask (the plan's: the scheduler sends one only for a sequence whose
last token it has); the sampled tokens' logprobs (computed on the device, copied back beside the
ids); penalties, bias and min tokens (the host counts the tokens it has, the token still in flight
is counted on the device: logits.apply_processing); rows of LoRA adapters where the graphs hold the
LoRA kernels (lora/triton_stack.py: each row's slot rides in the padded step's buffer, and a load
into a freed slot is copied on the same stream, behind the steps already queued). A slot dropped
while its token is in flight is forgotten by that step (`Launched.forget`): its token never reaches
the table, where a new sequence may already hold the slot. Every other plan runs at once after the
step in flight has finished, as without launch-ahead: prompt positions to score for prompt logprobs,
a step no bucket holds. A runner that drafts (speculation) or runs adapters on the torch path never
launches ahead.

The server (model_service/server.py) decides when to launch: it takes the next plan if one
comes before the step in flight is done on the device, else it finishes that step first. On a
synchronous device (the CPU) a step is done when launched; launch_ahead "on" holds it there for
up to HOLD_NS waiting for the next plan, which is how CI runs this path without a GPU. A model
that stands in for an asynchronous device (the null model with a step delay: `queue_steps`,
`device_free_ns`) queues a launched step's delay instead, and the step is done when that has run:
the host path's benchmark then sees what launching ahead hides, without a GPU.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from cython_ext import decode_step
from cython_ext.mapping import StepInputBuilder
from model_service.models.null import wait_until
from model_service.step.cuda_graphs import StepGraphs
from model_service.step.forward import StepClock
from model_service.step.logits import RowLogprobs
from model_service.step.plan import ComputedStep, PlanArrays
from model_service.step.sample_step import sample_on_device
from model_service.step.slot_table import SlotTable

# launch_ahead "on" on a synchronous device: how long a launched step waits for the next plan
# (a scheduler in lockstep sends none until it has the result; this bounds that wait).
HOLD_NS = 20_000_000

# What Describe's compute map says launches ahead.
DESCRIBED = "steps that score no prompt positions"


def for_runner(
    requested: str, graphs: StepGraphs | None, runner: Any, drafts: bool
) -> tuple[LaunchAhead | None, str]:
    """The runner's LaunchAhead, or None, and the path Describe reports (`requested`: the
    config's launch_ahead: "auto" on CUDA's padded steps, "on" wherever steps run padded,
    "off"; `drafts`: the runner speculates)."""
    device = runner.device
    why_not = None
    if requested == "off":
        why_not = "launch_ahead=off"
    elif graphs is None:
        why_not = "steps not padded"
    elif drafts:
        why_not = "speculative drafts"
    elif runner.adapters is not None and graphs.lora_stack is None:
        why_not = "adapter rows not padded"  # the torch LoRA path: such steps run unpadded
    elif runner.loaded.tensor_parallel_size > 1:
        why_not = "tensor parallel"  # rank 0 sends the other ranks whole steps (tp_worker.py)
    elif requested == "auto" and device.type != "cuda":
        why_not = f"device {device.type}"
    if graphs is None or why_not is not None:
        return None, f"off ({why_not})"
    ahead = LaunchAhead(graphs, runner.slot_table, runner.inputs, device, requested == "on")
    return ahead, DESCRIBED


@dataclasses.dataclass
class Launched:
    """A step queued on the device whose token ids have not reached the host."""

    output: ComputedStep  # its step id and sample flags; its ids once finished
    sample_slots: np.ndarray  # the slots it samples, in its rows' order
    positions: np.ndarray  # where each sample slot's token goes in the slot table
    sampled: torch.Tensor  # the ids on the device (a step launched after it reads them)
    host_ids: torch.Tensor  # where they are copied (pinned on CUDA)
    logprobs: RowLogprobs | None  # the rows' that asked, copied as the ids are
    done: Any  # torch.cuda.Event after the copy; None on a synchronous device
    clock: StepClock
    hold_until_ns: int  # a synchronous device: done then (the hold, or the stand-in's step)
    live: np.ndarray  # per sample slot: False once a later plan dropped the slot

    def forget(self, *dropped: np.ndarray) -> None:
        """Slots a later plan drops before this step finishes: their tokens stay out of the
        slot table and out of the next steps' inputs (the result still carries them)."""
        gone = np.concatenate(dropped)
        if gone.size:
            self.live &= ~np.isin(self.sample_slots, gone)

    def index_of(self, slots: np.ndarray) -> np.ndarray:
        """Each slot's index among this step's ids where its token is still to land in the
        slot table (the slot's last token: nothing runs for it in between), else -1."""
        size = max(int(slots.max(initial=-1)), int(self.sample_slots.max(initial=-1))) + 1
        index = np.full(size, -1, dtype=np.int64)
        index[self.sample_slots[self.live]] = np.arange(self.sample_slots.size)[self.live]
        return index[slots]

    def read_by(self, slots: np.ndarray, table: SlotTable) -> tuple[np.ndarray, Any] | None:
        """(index_of(slots), the ids) where a slot of `slots` has penalties, bias or min tokens,
        the only readers of a token in flight (logits.apply_processing), else None."""
        if not table.changes_logits[slots].any():
            return None
        return self.index_of(slots), self.sampled

    def ready(self) -> bool:
        """Whether its ids are on the host (a synchronous device: at hold_until_ns)."""
        if self.done is not None:
            return bool(self.done.query())
        return time.perf_counter_ns() >= self.hold_until_ns


class LaunchAhead:
    """Launches and finishes steps over the runner's padded step (the runner owns the choice of
    path and the lock: model_service/runner.py step_ahead)."""

    def __init__(
        self,
        graphs: StepGraphs,
        table: SlotTable,
        inputs: StepInputBuilder,
        device: torch.device,
        hold: bool,
    ) -> None:
        self.graphs, self.table, self.inputs, self.device = graphs, table, inputs, device
        pinned = device.type == "cuda"
        ids = [torch.zeros(table.max_num_slots, dtype=torch.int64) for _ in range(2)]
        # Two destinations in turn: a step's copy lands while the one before it is read.
        self._ids = [i.pin_memory() for i in ids] if pinned else ids
        self._turn = 0
        self._hold_ns = HOLD_NS if hold and not pinned else 0
        self.launched = 0  # steps launched while another was in flight (the stream's log)

    def launch(
        self, plan: PlanArrays, prior: Launched | None, greedy: bool, lora=None
    ) -> Launched | None:
        """Queues `plan` (checked and its diff applied; its slots sample plainly: `greedy`, by
        an argmax; `lora`: its rows' adapters, None for the base model's) behind `prior`; None,
        with nothing queued or changed, where no bucket holds it. The slot table advances now,
        each sampled token a stand-in until `finish`."""
        c, slots, n = self.table, plan.slots, plan.num_scheduled_tokens
        x = self.inputs.build(c.tokens, c.block_table, c.num_computed, c.num_tokens, slots, n)
        taken = None
        if prior is not None:
            rows, sources = pending_rows(prior, slots, n, x.query_start, x.positions)
            if rows.size:
                taken = (rows, sources, prior.sampled)
        clock = StepClock(self.device)
        stand_in = self._stands_in_for_a_device()
        if stand_in:
            self.graphs.model.queue_steps = True
        try:
            logits = self.graphs.run(x, n, x.logits_indices, lora, taken=taken)
        finally:
            if stand_in:
                self.graphs.model.queue_steps = False
        if logits is None:
            return None
        clock.forward_launched()
        in_flight = None if prior is None or greedy else prior.read_by(x.sample_slots, c)
        sampled, logprobs = sample_on_device(logits, x.sample_slots, plan, c, greedy, in_flight)
        count = int(sampled.shape[0])
        host_ids = self._ids[self._turn][:count]
        self._turn ^= 1
        host_ids.copy_(sampled, non_blocking=True)
        if logprobs is not None:
            logprobs = logprobs.copied()
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        sample_slots = x.sample_slots.copy()
        positions = c.num_tokens[sample_slots]
        stand_ins = np.zeros(count, dtype=np.int64)
        decode_step.advance(c, slots, x.context_lens, sample_slots, stand_ins)
        if prior is not None:
            self.launched += 1
        output = ComputedStep(plan.step_id, x.needs_sample.copy(), stand_ins, 0, 0)
        if stand_in:
            hold_until = self.graphs.model.device_free_ns
        else:
            hold_until = time.perf_counter_ns() + self._hold_ns
        live = np.ones(count, dtype=bool)
        return Launched(
            output, sample_slots, positions, sampled, host_ids, logprobs, done, clock, hold_until,
            live,
        )  # fmt: skip

    def finish(self, step: Launched) -> ComputedStep:
        """Waits for the step's ids, writes them over their stand-ins, returns its result."""
        self.wait_for(step)
        ids = step.host_ids.numpy().copy()
        live = step.live
        self.table.tokens[step.sample_slots[live], step.positions[live]] = ids[live]
        step.output.sampled_token_ids = ids
        if step.logprobs is not None:
            step.output.logprobs, step.output.logprob_token_ids = step.logprobs.flat()
        step.output.forward_ns, step.output.sample_ns = step.clock.finish()
        return step.output

    def finished(self, step: Launched | None) -> list[ComputedStep]:
        """finish's result, in a list (empty for no step)."""
        return [] if step is None else [self.finish(step)]

    def wait_for(self, step: Launched) -> None:
        """Returns once the step's device work is done (its buffers may be written again). A
        step its stream abandons is only waited for: its slots may hold a new stream's
        sequences by then, so its ids go nowhere."""
        if step.done is not None:
            step.done.synchronize()
        elif self._stands_in_for_a_device():
            wait_until(step.hold_until_ns)  # the stand-in device runs the step until then

    def _stands_in_for_a_device(self) -> bool:
        """The model queues its steps' time as a device would (the null model with a delay, off
        CUDA: there the device queues for real)."""
        return self.device.type != "cuda" and getattr(self.graphs.model, "step_delay_s", 0) > 0


def pending_rows(
    prior: Launched,
    slots: np.ndarray,
    num_scheduled: np.ndarray,
    query_start: np.ndarray,
    positions: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a step whose input token `prior` samples, and that token's index among
    prior's ids: a slot prior sampled (and no plan dropped since) whose rows include the
    position its token went to."""
    sources = prior.index_of(slots)
    mine = sources >= 0
    if not mine.any():
        return sources[:0], sources[:0]
    first = query_start[: slots.size][mine]
    sources = sources[mine]
    offset = prior.positions[sources] - positions[first]
    inside = (offset >= 0) & (offset < num_scheduled[mine])
    return (first + offset)[inside], sources[inside]
