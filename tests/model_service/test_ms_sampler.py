"""Sampler: greedy equivalences and (seed, position)-keyed draws independent of the batch."""
from __future__ import annotations

import numpy as np
import torch

from model_service.step.sampler import SamplingBatch, argmax_rows, sample, uniform_for

V = 1000


def _batch(rows, temperature=1.0, top_k=0, top_p=1.0, seeds=None, positions=None) -> SamplingBatch:
    return SamplingBatch(
        temperature=np.full(rows, temperature, dtype=np.float32),
        top_k=np.full(rows, top_k, dtype=np.int64),
        top_p=np.full(rows, top_p, dtype=np.float32),
        seed=np.arange(rows, dtype=np.uint64) if seeds is None else np.asarray(seeds, dtype=np.uint64),
        position=np.full(rows, 7, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64),
    )


def _logits(rows, seed=0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax():
    logits = _logits(8)
    assert torch.equal(sample(logits, _batch(8, temperature=0.0)), logits.argmax(-1))


def test_cpu_argmax_matches_torch_on_ties_and_nan():
    """The CPU path (numpy's argmax) picks what torch's argmax picks: the first of equal maxima,
    and the first NaN of a row that has one; the default dtype's logits go through torch's."""
    logits = _logits(6)
    logits[1, 3] = logits[1, 900] = logits[1].max() + 1  # a tie: the first wins
    logits[2] = 0.0  # a flat row: index 0
    logits[3, 10] = logits[3, 20] = float("nan")
    logits[4, 999] = float("inf")
    logits[5, :] = float("-inf")
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
    assert argmax_rows(logits).dtype == torch.int64
    assert argmax_rows(logits).tolist()[1:4] == [3, 0, 10]
    as_bf16 = logits.to(torch.bfloat16)
    assert torch.equal(argmax_rows(as_bf16), as_bf16.argmax(-1))
    columns = logits.t().contiguous().t()  # a non-contiguous view
    assert torch.equal(argmax_rows(columns), logits.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(8)
    assert torch.equal(sample(logits, _batch(8, top_k=1)), logits.argmax(-1))
    assert torch.equal(sample(logits, _batch(8, top_p=1e-6)), logits.argmax(-1))


def test_draw_depends_only_on_seed_and_position():
    logits = _logits(6)
    params = _batch(6, temperature=0.8, top_k=40, top_p=0.9, seeds=[11, 12, 13, 14, 15, 16], positions=[3, 4, 5, 6, 7, 8])
    full = sample(logits, params)
    # Row 2 alone, and row 2 placed among different neighbours, with other rows' params changed.
    alone = sample(logits[2:3], _batch(1, temperature=0.8, top_k=40, top_p=0.9, seeds=[13], positions=[5]))
    mixed_logits = torch.cat([_logits(3, seed=5), logits[2:3]])
    mixed = SamplingBatch(
        temperature=np.array([0.0, 1.5, 0.3, 0.8], dtype=np.float32),
        top_k=np.array([0, 0, 5, 40]),
        top_p=np.array([1.0, 0.5, 1.0, 0.9], dtype=np.float32),
        seed=np.array([1, 2, 3, 13], dtype=np.uint64),
        position=np.array([0, 1, 2, 5]),
    )
    assert int(full[2]) == int(alone[0]) == int(sample(mixed_logits, mixed)[3])


def test_seeded_draws_vary_with_position_and_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [0.0] * (V - 3)]) + 1e-30)
    rows = 4000
    draws = sample(logits.expand(rows, V).contiguous(), _batch(rows, seeds=[42] * rows, positions=np.arange(rows)))
    freq = np.bincount(draws.numpy(), minlength=3)[:3] / rows
    assert np.allclose(freq, [0.5, 0.3, 0.2], atol=0.03)
    assert draws.max() < 3


def test_top_k_and_top_p_filter():
    logits = _logits(1).expand(500, V).contiguous()
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    drawn = sample(logits, _batch(500, top_k=5, seeds=np.arange(500)))
    assert set(drawn.tolist()) <= top5 and len(set(drawn.tolist())) > 1
    probs = torch.softmax(logits[0].double(), -1)
    order = probs.argsort(descending=True)
    keep = int((probs[order].cumsum(0) - probs[order] < 0.6).sum())
    nucleus = set(order[:keep].tolist())
    drawn = sample(logits, _batch(500, top_p=0.6, seeds=np.arange(500)))
    assert set(drawn.tolist()) <= nucleus


def test_uniform_is_deterministic_and_in_range():
    u = uniform_for(np.array([1, 1, 2], dtype=np.uint64), np.array([0, 1, 0]))
    assert np.array_equal(u, uniform_for(np.array([1, 1, 2], dtype=np.uint64), np.array([0, 1, 0])))
    assert len(set(u.tolist())) == 3 and ((u >= 0) & (u < 1)).all()


def test_thresholds_from_the_largest_probabilities_match_the_full_sort(monkeypatch):
    """Top-k and top-p thresholds are looked for among the largest probabilities (topk, not a
    sort of the vocabulary) where those hold every row's k and top_p mass: the same filtered
    distribution, bit for bit, as from the full sort (_HEAD at the vocabulary forces it), on
    peaked rows (the head suffices) and flat ones (it does not: the full sort runs)."""
    from model_service.step import sampler

    vocab, rows = 49152, 16
    rng = np.random.default_rng(0)
    widths = []
    sorted_head = sampler._sorted_head

    def spy(*args):
        out = sorted_head(*args)
        widths.append(out.shape[-1])
        return out

    monkeypatch.setattr(sampler, "_sorted_head", spy)
    for scale in (20.0, 8.0, 1.0):
        logits = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32) * scale)
        params = SamplingBatch(
            temperature=rng.choice([0.0, 0.7, 1.0], rows).astype(np.float32),
            top_k=rng.choice([0, 1, 50, 1500, vocab + 1], rows).astype(np.int64),
            top_p=rng.choice([1.0, 0.5, 0.9, 0.95], rows).astype(np.float32),
            seed=np.arange(rows, dtype=np.uint64),
            position=np.full(rows, 7, dtype=np.int64),
            min_p=rng.choice([0.0, 0.05], rows).astype(np.float32),
        )
        ours = sampler.filtered_probs(logits, params)
        with monkeypatch.context() as full:
            full.setattr(sampler, "_HEAD", vocab)
            assert torch.equal(ours, sampler.filtered_probs(logits, params)), scale
    assert widths[0] < vocab and widths[-2] == vocab  # the head served the peaked rows, the sort the flat ones
