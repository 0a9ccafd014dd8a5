"""The grouped LoRA kernels (model_service/lora/triton_lora.py) under Triton's interpreter: the
shrink and expand over a step whose rows run three adapters of different ranks (stacked, padded
to the largest) and the base model, against float64, and a row's bits alone equal to its bits
among the others. As in test_ms_triton_ops.py, the interpreter runs in a child process (Triton
reads TRITON_INTERPRET at import); the compiled kernels need a GPU (not run here)."""
from __future__ import annotations

import pytest
import torch
from interpreted_tests import INTERPRETED, run_interpreted

interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter's child process (module docstring)")


def _step(dtype, rows=13, k=96, n=80, ranks=(4, 16, 8)):
    g = torch.Generator().manual_seed(0)
    r = max(ranks)
    a = torch.zeros(len(ranks), r, k)
    b = torch.zeros(len(ranks), n, r)
    for s, rank in enumerate(ranks):  # each adapter's own rank, zero-padded to the largest
        a[s, :rank] = torch.randn(rank, k, generator=g) * 0.1
        b[s, :, :rank] = torch.randn(n, rank, generator=g) * 0.1
    x = torch.randn(rows, k, generator=g)
    row_slot = torch.tensor([(t % 4) - 1 for t in range(rows)], dtype=torch.int32)  # -1: base rows
    y = torch.randn(rows, n + 20, generator=g)
    scale = torch.tensor([2.0, 0.5, 1.25])
    return x.to(dtype), a.to(dtype), b.to(dtype), scale, row_slot, y.to(dtype)


def _float64(x, a, b, scale, row_slot, y, start):
    out = y.double().clone()
    for t, s in enumerate(row_slot.tolist()):
        if s >= 0:
            xa = x[t].double() @ a[s].double().T
            out[t, start : start + b.shape[1]] += scale[s].double() * (xa @ b[s].double().T)
    return out


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_interpreted_grouped_lora_matches_float64_and_is_batch_invariant(dtype):
    from model_service.lora import triton_lora

    x, a, b, scale, row_slot, y = _step(dtype)
    start = 7
    xa = triton_lora.shrink(x, a, row_slot)
    out = triton_lora.expand_(y.clone(), xa, b, scale, row_slot, start)
    expected = _float64(x, a, b, scale, row_slot, y, start)
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert torch.allclose(out.double(), expected, rtol=tolerance, atol=tolerance)
    base = row_slot < 0
    assert torch.equal(out[base], y[base])  # base rows untouched
    for t in (0, 5, 12):  # alone: the same bits
        one = slice(t, t + 1)
        alone = triton_lora.expand_(y[one].clone(), triton_lora.shrink(x[one], a, row_slot[one]), b, scale,
                                    row_slot[one], start)
        assert torch.equal(alone, out[one]), t


def test_the_lora_kernels_under_tritons_interpreter():
    run_interpreted(__file__, "2 passed", 600)
