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
    arrays reach the device through pinned memory.

    All rows at once, in a fixed number of device operations whatever their count, and only on
    the logits the rules touch: the penalties on each penalized row's distinct known tokens (one
    gather, the arithmetic, one scatter), bias and suppression by one scatter each. Per element
    the arithmetic is the row-by-row rule's, in its order (the module docstring)."""
    params = [slot_table.processing[slot] for slot in slots.tolist()]
    first_output = np.array([p.num_prompt_tokens for p in params], dtype=np.int64)
    num_output = slot_table.num_tokens[slots] - first_output
    repetition = np.array([p.repetition_penalty for p in params], dtype=np.float32)
    presence = np.array([p.presence_penalty for p in params], dtype=np.float32)
    frequency = np.array([p.frequency_penalty for p in params], dtype=np.float32)
    counted = ((presence != 0) | (frequency != 0)) & (num_output > 0)
    penalized = (repetition != 1.0) | counted
    if penalized.any():
        rules = np.stack([repetition, frequency * counted, presence * counted])  # 0: not counted
        _penalize(logits, rows, slots, slot_table, first_output, penalized, rules, in_flight)
    _add_bias(logits, rows, [p.logit_bias for p in params])
    suppressed = [
        p.min_tokens_suppressed_ids if p.min_new_tokens and n < p.min_new_tokens else ()
        for p, n in zip(params, num_output.tolist())
    ]
    _suppress(logits, rows, suppressed)


def _penalize(
    logits: torch.Tensor,
    rows: np.ndarray,
    slots: np.ndarray,
    slot_table: SlotTable,
    first_output: np.ndarray,
    penalized: np.ndarray,
    rules: np.ndarray,
    in_flight: tuple[np.ndarray, torch.Tensor] | None,
) -> None:
    """The penalties (rules: per row repetition, frequency, presence; float32) on every distinct
    token each penalized row has seen (its output from position first_output on): a seen token
    is repeated, and its output count (0 for a prompt's only) meets the frequency and presence
    penalties. A token in flight joins its row's tokens on the device: a dense count table
    merges it with the host's (a GPU's steps only)."""
    device, vocab = logits.device, logits.shape[-1]
    late = np.full(rows.size, -1) if in_flight is None else np.where(penalized, in_flight[0], -1)
    known = slot_table.num_tokens[slots] - (late >= 0)  # the host's tokens, less those in flight
    width = int(known.max(initial=0))
    position = np.arange(width)
    taken = (position < known[:, None]) & penalized[:, None]
    keys = np.arange(rows.size)[:, None] * vocab + slot_table.tokens[slots, :width]
    # (row, token) as row * vocab + token, sorted: unique's sorting method (return_counts) is
    # the fast one here, and flat indices keep the device's gathers and scatters one-dimensional.
    pairs, _ = np.unique(keys[taken], return_counts=True)
    output = taken & (position >= first_output[:, None])
    output_keys, output_counts = np.unique(keys[output], return_counts=True)
    counts = np.zeros(pairs.size, dtype=np.float32)
    counts[np.searchsorted(pairs, output_keys)] = output_counts
    row, key, count = (on_device(device, a) for a in (pairs // vocab, pairs, counts))
    late_rows = np.flatnonzero(late >= 0)
    if late_rows.size:
        assert in_flight is not None
        late_token = in_flight[1][on_device(device, late[late_rows].astype(np.int64))]
        late_row = on_device(device, late_rows)
        table = torch.zeros(rows.size * vocab, dtype=torch.float32, device=device)
        table.put_(key, count)
        table.put_(late_row * vocab + late_token, torch.ones_like(late_token, dtype=table.dtype),
                   accumulate=True)  # fmt: skip
        row, key = torch.cat([row, late_row]), torch.cat([key, late_row * vocab + late_token])
        count = table.take(key)  # a repeat of a known token is written twice, the same value
    at = on_device(device, rows.astype(np.int64))[row] * vocab + key % vocab
    x = logits.take(at)
    repeat, frequency, presence = on_device(device, rules)[:, row]
    x = torch.where(repeat != 1.0, torch.where(x > 0, x / repeat, x * repeat), x)
    logits.put_(at, x - (frequency * count + presence * (count > 0).float()))


def _flat_indices(logits: torch.Tensor, rows: np.ndarray, tokens_per_row: list):
    """row * vocab + token, on the logits' device, for each row's tokens in order (None where
    no row has any): the flat indices of one scatter over all rows."""
    counts = [len(tokens) for tokens in tokens_per_row]
    if not sum(counts):
        return None
    tokens = np.fromiter((t for row_tokens in tokens_per_row for t in row_tokens), dtype=np.int64)
    flat = np.repeat(rows.astype(np.int64), counts) * logits.shape[-1] + tokens
    return on_device(logits.device, flat)


def _add_bias(logits: torch.Tensor, rows: np.ndarray, biases: list) -> None:
    """Per row, its (token, bias) pairs added, in one scatter."""
    at = _flat_indices(logits, rows, [[token for token, _ in pairs] for pairs in biases])
    if at is not None:
        bias = np.array([bias for pairs in biases for _, bias in pairs], dtype=np.float64)
        logits.put_(at, on_device(logits.device, bias).to(logits.dtype), accumulate=True)


def _suppress(logits: torch.Tensor, rows: np.ndarray, ids_per_row: list) -> None:
    """Per row, these token ids set to -inf, in one scatter."""
    at = _flat_indices(logits, rows, ids_per_row)
    if at is not None:
        logits.put_(at, torch.full(at.shape, float("-inf"), device=logits.device))


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


@dataclasses.dataclass
class LogitsRows:
    """The rows of one step whose logits the model returns, in this order:

    sample   one per slot that samples this step (x.logits_indices)
    draft    each drafted position (the speculation stage asks for them)
    prompt   the prompt positions of slots that asked for prompt logprobs
    """

    num_sample: int
    draft: np.ndarray
    prompt: np.ndarray
    prompt_targets: np.ndarray
    prompt_counts: np.ndarray
    indices: np.ndarray


def logits_rows(
    x, slots: np.ndarray, n: np.ndarray, draft: np.ndarray, slot_table: SlotTable
) -> LogitsRows:
    """A step's LogitsRows (x: its StepInputs; draft: the drafted rows). Prompt logprobs (rare)
    need the logits of prompt rows too, and verification the target at every drafted position:
    both ride after the sample rows."""
    prompt, targets, counts = prompt_logprob_rows(slots, n, x.query_start, slot_table)
    indices = (
        np.concatenate((x.logits_indices, draft, prompt))
        if draft.size or prompt.size
        else x.logits_indices
    )
    return LogitsRows(x.sample_slots.size, draft, prompt, targets, counts, indices)


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
        end = min(start + int(num_scheduled[b]), int(slot_table.prompt_scored_end[slot]))
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
