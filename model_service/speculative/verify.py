"""Speculative decoding on the model side: drafting and the verification rule.

A decoding slot the scheduler grants 1 + k tokens (engine.proto BatchPlan) gets up to k draft
tokens appended for this step only; one forward computes the target's distribution at every
drafted position plus one, and `verify` decides what is emitted:

    for each draft t_i (i = 0 .. d-1), with p_i the target's and q_i the draft's distribution:
        accept with probability min(1, p_i(t_i) / q_i(t_i))       (q_i(t_i) = 0: reject)
        on the first rejection, emit a token drawn from normalize(max(0, p_i - q_i)) and stop
        (a residual with no mass, which only rounding can produce, falls back to p_i)
    all accepted: emit a bonus token drawn from p_d

This is the speculative-sampling rule of Leviathan et al. (2023) and Chen et al. (2023): the
emitted tokens are distributed exactly as the target's own samples. A deterministic drafter (the
n-gram lookup) is the case q_i = one-hot(t_i): accept with probability p_i(t_i), residual = p_i
without t_i. (shared/reference/001's residual treats every draft as one-hot, which is exact only
for such deterministic drafters; a sampling draft model needs its full q_i, as here.)

Greedy rows skip the randomness: accept while t_i is the target's argmax, then emit the argmax;
the output is token for token what plain greedy decoding gives.

Randomness stays keyed by (seed, position) (sampler.py): the draw of the token at position P,
residual or bonus, uses the same uniform plain sampling would use at P, and acceptance tests use
a second stream keyed by (seed ^ ACCEPT_STREAM, P).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from model_service.step.sampler import draw, uniform_for

ACCEPT_STREAM = np.uint64(0x5BD1E9955BD1E995)


@dataclasses.dataclass
class Draft:
    """Up to k proposed tokens of one slot; probs [d, V] is the drafter's distribution at each
    (None for a deterministic drafter: one-hot on the token)."""

    token_ids: np.ndarray  # int64 [d]
    probs: torch.Tensor | None = None


def verify(
    target: torch.Tensor, draft: Draft, accept_u: np.ndarray, draw_u: np.ndarray
) -> tuple[list[int], int]:
    """One slot's verification. target [d + 1, V]: the target's filtered (unnormalized) weights
    at the drafted positions and one past; accept_u [d] and draw_u [d + 1]: uniforms in [0, 1).
    Returns (emitted token ids: accepted drafts then one more, number of drafts accepted)."""
    d = len(draft.token_ids)
    p = target / target.sum(dim=-1, keepdim=True)
    emitted: list[int] = []
    for i in range(d):
        token = int(draft.token_ids[i])
        q_token = 1.0 if draft.probs is None else float(draft.probs[i, token])
        p_token = float(p[i, token])
        accept = q_token > 0 and accept_u[i] < min(1.0, p_token / q_token)
        if accept:
            emitted.append(token)
            continue
        if draft.probs is None:
            residual = p[i].clone()
            residual[token] = 0.0
        else:
            residual = (p[i] - draft.probs[i].to(p.dtype)).clamp(min=0.0)
        if not residual.sum() > 0:
            residual = p[i]  # degenerate: only rounding gets here
        emitted.append(int(draw(residual[None], draw_u[i : i + 1])[0]))
        return emitted, i
    emitted.append(int(draw(p[d : d + 1], draw_u[d : d + 1])[0]))
    return emitted, d


def verify_greedy(target_argmax: np.ndarray, draft: Draft) -> tuple[list[int], int]:
    """target_argmax [d + 1]: accept drafts while they are the argmax, then the argmax."""
    emitted: list[int] = []
    for i, token in enumerate(draft.token_ids.tolist()):
        if token != target_argmax[i]:
            emitted.append(int(target_argmax[i]))
            return emitted, i
        emitted.append(token)
    emitted.append(int(target_argmax[len(draft.token_ids)]))
    return emitted, len(draft.token_ids)


def uniforms(seed: int, first_position: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(acceptance uniforms, draw uniforms) for positions first_position .. + count - 1."""
    positions = np.arange(first_position, first_position + count, dtype=np.int64)
    seeds = np.full(count, seed, dtype=np.uint64)
    return uniform_for(seeds ^ ACCEPT_STREAM, positions), uniform_for(seeds, positions)


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens
    (n from max_n down to min_n) and propose the tokens that followed it. No model, no state."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def on_register(self, slot: int) -> None:
        """Nothing to forget: the lookup reads the sequence's tokens each time."""

    def propose_batch(self, slot_table, slots: np.ndarray, rooms: np.ndarray) -> list[Draft]:
        """Drafts for each decoding slot (at most rooms[i] tokens), from SlotTable tokens."""
        return [
            self.propose(slot_table.tokens[slot, : slot_table.num_tokens[slot]], int(room))
            for slot, room in zip(slots.tolist(), rooms.tolist())
        ]

    def propose(self, tokens: np.ndarray, k: int) -> Draft:
        """tokens: the sequence's known token ids; returns at most k drafts."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = tokens[length - n :]
            # Windows starting before the tail itself; the latest match predicts best.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            matches = np.flatnonzero((windows == tail).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                proposal = tokens[start : start + k]
                if proposal.size:
                    return Draft(proposal.astype(np.int64))
        return Draft(np.zeros(0, dtype=np.int64))
