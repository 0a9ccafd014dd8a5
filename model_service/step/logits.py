"""Per-sequence logits work around sampling: penalties, logit bias, min-token suppression,
constrained-decoding masks (before), and logprobs (after).

Rows are the step's sample rows (runner: x.sample_slots, one per sampling slot). Most steps have
no row that needs any of this: the runner checks the SlotTable's mirror arrays and calls in
only for the rows that do, so the common path stays one vectorized sample().

Order, as vLLM and Hugging Face apply it: repetition penalty (prompt and output tokens),
presence / frequency penalties (output tokens), logit bias, min-token suppression, then the
grammar mask; temperature, top-k, top-p and min-p follow in sampler.sample(). Logprobs are of
the raw model distribution (log-softmax of the logits before any of this), as OpenAI's API and
vLLM's default report them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from model_service.step.sampler import on_device
from model_service.step.slot_table import SlotTable


def apply_processing(
    logits: torch.Tensor,
    rows: np.ndarray,
    slots: np.ndarray,
    slot_table: SlotTable,
    in_flight: tuple[np.ndarray, torch.Tensor] | None = None,
) -> None:
    """Penalties, bias and min-token suppression, in place, for logits rows `rows` of `slots`.
    `in_flight` (a step launched ahead, step/launch_ahead.py): (per row, the index of its last
    token among the ids [K] of the step before, still on the device, or -1; those ids): that
    token counts from the device, its stand-in on the host does not. No host sync: the host's
    arrays reach the device through pinned memory."""
    vocab, device = logits.shape[-1], logits.device
    for i, (row, slot) in enumerate(zip(rows.tolist(), slots.tolist())):
        p = slot_table.processing[slot]
        known = slot_table.tokens[slot, : slot_table.num_tokens[slot]]
        num_output = known.size - p.num_prompt_tokens
        last = None  # the last token where it is still in flight: [1] on the device
        if in_flight is not None and in_flight[0][i] >= 0:
            known = known[:-1]
            last = in_flight[1][int(in_flight[0][i])].view(1)
        line = logits[row]
        if p.repetition_penalty != 1.0:
            seen = on_device(device, np.unique(known).astype(np.int64))
            if last is not None:  # a repeat of a known token is written twice, the same value
                seen = torch.cat([seen, last])
            values = line[seen]
            line[seen] = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and num_output:
            output = known[p.num_prompt_tokens :]
            host_counts = np.bincount(output, minlength=vocab)[:vocab].astype(np.float32)
            counts = on_device(device, host_counts)
            if last is not None:
                counts = counts.index_add(0, last, torch.ones(1, device=device))
            line -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias)
            bias = on_device(device, np.array(biases, dtype=np.float64)).to(line.dtype)
            line[on_device(device, np.array(ids, dtype=np.int64))] += bias
        if p.min_new_tokens and num_output < p.min_new_tokens and p.min_tokens_suppressed_ids:
            suppressed = np.array(p.min_tokens_suppressed_ids, dtype=np.int64)
            line[on_device(device, suppressed)] = float("-inf")


def apply_masks(
    logits: torch.Tensor, rows: np.ndarray, bitmasks: np.ndarray, raw: torch.Tensor
) -> None:
    """Constrained decoding: only the allowed tokens of each masked row keep their logits.

    bitmasks [M, words] uint32, little-endian bit order (engine.proto BatchPlan). When the
    processing left a masked row nothing allowed (a grammar that can only end while min tokens
    suppress EOS), the grammar wins: the row falls back to its raw logits under the mask. No
    host sync, and the masks reach the device through pinned memory: a step launched ahead
    (step/launch_ahead.py) masks while the step before it runs.
    """
    vocab = logits.shape[-1]
    bits = np.unpackbits(bitmasks.astype("<u4").view(np.uint8), axis=1, bitorder="little")[
        :, :vocab
    ]
    device = logits.device
    allowed = on_device(device, bits.astype(bool))
    index = on_device(device, rows.astype(np.int64))
    masked = logits[index].masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(masked).all(dim=-1, keepdim=True)
    unprocessed = raw[index].masked_fill(~allowed, float("-inf"))
    logits[index] = torch.where(dead, unprocessed, masked)


@dataclasses.dataclass
class RowLogprobs:
    """Sampled tokens' logprobs, on the device or copied to the host: per row, its target
    token's logprob, the row's top logprobs and their ids (top_k of them, the most any row
    asked for; None when none did), and how many of them each row reports (host)."""

    chosen: torch.Tensor  # [N] float32
    top_values: torch.Tensor | None  # [N, k_max] float32
    top_ids: torch.Tensor | None  # [N, k_max] int64
    counts: np.ndarray  # [N] int64

    def copied(self) -> "RowLogprobs":
        """Copies to the host queued on the device's stream, into pinned memory so that they do
        not wait for it (CPU tensors are kept as they are); read them once the stream has passed
        this point."""

        def host(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu":
                return t
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        if self.top_values is None or self.top_ids is None:
            return RowLogprobs(host(self.chosen), None, None, self.counts)
        top_values, top_ids = host(self.top_values), host(self.top_ids)
        return RowLogprobs(host(self.chosen), top_values, top_ids, self.counts)

    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        """engine.proto's flat logprob layout of host values: per row, the target token's
        logprob then counts[row] top logprobs (values), and those top ids (ids)."""
        chosen = self.chosen.cpu().numpy()
        if self.top_values is not None and self.top_ids is not None:
            top_values, top_ids = self.top_values.cpu().numpy(), self.top_ids.cpu().numpy()
        values: list[np.ndarray] = []
        ids: list[np.ndarray] = []
        for row in range(len(chosen)):
            k = int(self.counts[row])
            values.append(chosen[row : row + 1])
            if k:
                values.append(top_values[row, :k])
                ids.append(top_ids[row, :k])
        flat_values = (
            np.concatenate(values).astype(np.float32) if values else np.zeros(0, dtype=np.float32)
        )
        flat_ids = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, dtype=np.int64)
        return flat_values, flat_ids


def row_logprobs(
    raw_logits: torch.Tensor, targets: torch.Tensor, counts: np.ndarray
) -> RowLogprobs:
    """The logprobs of rows of raw_logits [N, V] for their targets [N] (on the logits' device),
    each row with counts[row] top logprobs beside; no host sync."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
    k_max = int(counts.max()) if counts.size else 0
    if not k_max:
        return RowLogprobs(chosen, None, None, counts)
    top = logprobs.topk(k_max, dim=-1)
    return RowLogprobs(chosen, top.values, top.indices, counts)


def gather_logprobs(
    raw_logits: torch.Tensor, targets: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """engine.proto's flat logprob layout (RowLogprobs.flat) for rows of raw_logits [N, V] and
    their host targets."""
    device_targets = on_device(raw_logits.device, targets.astype(np.int64))
    return row_logprobs(raw_logits, device_targets, counts).flat()


def prompt_logprob_rows(
    slots: np.ndarray, num_scheduled: np.ndarray, query_start: np.ndarray, slot_table: SlotTable
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed rows whose logits give prompt logprobs this step, with their target tokens and
    alternative counts: for each scheduled slot that asked (in plan order), each computed
    position p whose next token p + 1 is still a prompt token. Call before computed advances."""
    rows, targets, counts = [], [], []
    for b in (slot_table.num_prompt_logprobs[slots] >= 0).nonzero()[0].tolist():
        slot = int(slots[b])
        start = int(slot_table.num_computed[slot])
        end = min(start + int(num_scheduled[b]), slot_table.processing[slot].num_prompt_tokens - 1)
        if end <= start:
            continue
        rows.append(query_start[b] + np.arange(end - start))
        targets.append(slot_table.tokens[slot, start + 1 : end + 1])
        counts.append(np.full(end - start, slot_table.num_prompt_logprobs[slot]))
    if not rows:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return (
        np.concatenate(rows).astype(np.int64),
        np.concatenate(targets).astype(np.int64),
        np.concatenate(counts).astype(np.int64),
    )
