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

import numpy as np
import torch

from model_service.step.slot_table import SlotTable


def apply_processing(
    logits: torch.Tensor, rows: np.ndarray, slots: np.ndarray, slot_table: SlotTable
) -> None:
    """Penalties, bias and min-token suppression, in place, for logits rows `rows` of `slots`."""
    vocab = logits.shape[-1]
    for row, slot in zip(rows.tolist(), slots.tolist()):
        p = slot_table.processing[slot]
        known = slot_table.tokens[slot, : slot_table.num_tokens[slot]]
        output = known[p.num_prompt_tokens :]
        line = logits[row]
        if p.repetition_penalty != 1.0:
            seen = torch.from_numpy(np.unique(known).astype(np.int64)).to(line.device)
            values = line[seen]
            line[seen] = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and output.size:
            counts = torch.from_numpy(
                np.bincount(output, minlength=vocab)[:vocab].astype(np.float32)
            ).to(line.device)
            line -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias)
            line[torch.tensor(ids, device=line.device)] += torch.tensor(
                biases, device=line.device, dtype=line.dtype
            )
        if p.min_new_tokens and output.size < p.min_new_tokens and p.min_tokens_suppressed_ids:
            line[torch.tensor(p.min_tokens_suppressed_ids, device=line.device)] = float("-inf")


def apply_masks(
    logits: torch.Tensor, rows: np.ndarray, bitmasks: np.ndarray, raw: torch.Tensor
) -> None:
    """Constrained decoding: only the allowed tokens of each masked row keep their logits.

    bitmasks [M, words] uint32, little-endian bit order (engine.proto BatchPlan). When the
    processing left a masked row nothing allowed (a grammar that can only end while min tokens
    suppress EOS), the grammar wins: the row falls back to its raw logits under the mask.
    """
    vocab = logits.shape[-1]
    bits = np.unpackbits(bitmasks.astype("<u4").view(np.uint8), axis=1, bitorder="little")[
        :, :vocab
    ]
    allowed = torch.from_numpy(bits.astype(bool)).to(logits.device)
    index = torch.from_numpy(rows.astype(np.int64)).to(logits.device)
    masked = logits[index].masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(masked).all(dim=-1)
    if dead.any():
        masked[dead] = raw[index[dead]].masked_fill(~allowed[dead], float("-inf"))
    logits[index] = masked


def gather_logprobs(
    raw_logits: torch.Tensor, targets: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """engine.proto's flat logprob layout for rows of raw_logits [N, V]: per row, the target
    token's logprob then counts[row] top logprobs (values), and those top ids (ids)."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    device = logprobs.device
    chosen = (
        logprobs.gather(1, torch.from_numpy(targets.astype(np.int64)).to(device)[:, None])
        .squeeze(1)
        .cpu()
        .numpy()
    )
    k_max = int(counts.max()) if counts.size else 0
    if k_max:
        top = logprobs.topk(k_max, dim=-1)
        top_values, top_ids = top.values.cpu().numpy(), top.indices.cpu().numpy()
    values: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    for row in range(len(targets)):
        k = int(counts[row])
        values.append(chosen[row : row + 1])
        if k:
            values.append(top_values[row, :k])
            ids.append(top_ids[row, :k])
    flat_values = (
        np.concatenate(values).astype(np.float32) if values else np.zeros(0, dtype=np.float32)
    )
    flat_ids = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, dtype=np.int64)
    return flat_values, flat_ids


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
