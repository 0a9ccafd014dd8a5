"""The decoder's row-wise ops as Triton kernels (model_service/kernels/triton_ops.py) and where
layer_ops runs them.

Without a GPU the kernels' own code runs under Triton's interpreter (numpy, on CPU tensors), in a
child process started by test_the_kernels_under_tritons_interpreter: Triton reads TRITON_INTERPRET
when it is imported, so it cannot be switched on inside this process. The child runs this file's
`interpreted` tests; here they are skipped. The `gpu` tests run the compiled kernels on CUDA.

Bounds. Against float64: float32 within a few float32 ulps (2e-6 relative + 1e-6); bfloat16
within one bf16 rounding per rounding the op makes (2^-8 relative each: the norm rounds the
normalized row and the product, so 2^-7; RoPE and SiLU x up round once). Against the torch path
(layer_ops.torch_*), counted in ulps of the dtype: RoPE is bitwise equal; SiLU x up and the norm
at most 1 bf16 ulp apart, the norm 4 float32 ulps (its sum of squares runs in another order than
torch's), SiLU x up 2^-19 relative in float32 (compiled, Triton's exp is the hardware's exp2
approximation, whose error grows with |x|; torch calls expf), every element. RoPE with the K/V
cache write leaves qkv and the caches as RoPE then paged._write_kv do, bit for bit. Batch
invariance is bitwise: a row alone equals the same row among 37 others.

Where layer_ops runs them (the decider, Describe's report, the attention's skipped write):
test_ms_triton_dispatch.py.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from interpreted_tests import INTERPRETED, run_interpreted

from model_service.attention import paged
from model_service.kernels import layer_ops, triton_ops
from model_service.models.rope import rope_table

HAS_CUDA = torch.cuda.is_available()
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the interpreter's child process (see the module docstring)"
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


def _randn(*shape, dtype, seed=0, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _float64_bound(dtype, roundings=1):
    if dtype == torch.float32:
        return dict(rtol=2e-6, atol=1e-6)
    return dict(rtol=roundings * 2**-8, atol=roundings * 2**-8 * 1e-2)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most representable values of a's dtype between a and b, elementwise (0: same bits,
    or +0 and -0)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    width = torch.finfo(a.dtype).bits

    def ordered(t):
        i = t.contiguous().view(bits[t.dtype]).to(torch.int64)
        magnitude = i & ((1 << (width - 1)) - 1)
        return torch.where(i < 0, -magnitude, magnitude)

    return int((ordered(a) - ordered(b)).abs().max().item()) if a.numel() else 0


TORCH_PATH_ULPS = {torch.float32: 4, torch.bfloat16: 1}


# Reference computations in float64 (the roundings the dtype makes, stated where they happen).


def norm_inputs(rows, hidden, dtype, with_delta, device="cpu", seed=1):
    residual = _randn(rows, hidden, dtype=dtype, seed=seed, device=device) * 3
    delta = _randn(rows, hidden, dtype=dtype, seed=seed + 1, device=device) if with_delta else None
    weight = 1 + _randn(hidden, dtype=dtype, seed=seed + 2, device=device) * 0.1
    return residual, delta, weight


def norm_reference(residual, delta, weight):
    summed = residual if delta is None else (residual.double() + delta.double()).to(residual.dtype)
    x = summed.double()
    return summed, weight.double() * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope_inputs(rows, heads, kv_heads, head_dim, dtype, device="cpu", seed=3):
    table = rope_table(4096, head_dim, 10000.0, device=torch.device(device))
    positions = torch.tensor([0, 1, 5, 300, 301, 2047, 4095] * (rows // 7 + 1), device=device)[:rows]
    qkv = _randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed, device=device)
    return qkv, positions, table


def rope_reference(qkv, positions, table, num_heads, head_dim):
    half = head_dim // 2
    heads = qkv[:, : num_heads * head_dim].double().unflatten(1, (num_heads, head_dim))
    cos, sin = table[positions, None, :half].double(), table[positions, None, half:].double()
    x1, x2 = heads[..., :half], heads[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(1)


def silu_inputs(rows, width, dtype, device="cpu", seed=5):
    gate_up = _randn(rows, 2 * width, dtype=dtype, seed=seed, device=device) * 4
    special = torch.tensor([-100.0, 100.0, 0.0, -0.0])[: 2 * width]  # exp's ends, silu(0) = 0
    gate_up[0, : len(special)] = special.to(dtype)
    return gate_up


def silu_reference(gate_up):
    width = gate_up.shape[1] // 2
    g, u = gate_up[:, :width].double(), gate_up[:, width:].double()
    return g * torch.sigmoid(g) * u


# Under the interpreter (the child process), then on CUDA.

SHAPES = [(1, 576), (37, 576), (37, 1), (1, 23), (37, 2048)]  # (rows, hidden)


def check_add_rms_norm(dtype, rows, hidden, with_delta, device):
    residual, delta, weight = norm_inputs(rows, hidden, dtype, with_delta, device)
    summed, expected = norm_reference(residual.cpu(), None if delta is None else delta.cpu(), weight.cpu())
    theirs_residual = residual.clone()
    theirs = layer_ops.torch_add_rms_norm_(theirs_residual, delta, weight, EPS)
    out = triton_ops.add_rms_norm_(residual, delta, weight, EPS)
    assert torch.equal(residual.cpu(), summed) and torch.equal(residual, theirs_residual)
    torch.testing.assert_close(out.cpu().double(), expected, **_float64_bound(dtype, 2))
    assert ulp_distance(out, theirs) <= TORCH_PATH_ULPS[dtype]


def check_rope(dtype, rows, heads, kv_heads, head_dim, device):
    qkv, positions, table = rope_inputs(rows, heads, kv_heads, head_dim, dtype, device)
    expected = rope_reference(qkv.cpu(), positions.cpu(), table.cpu(), heads + kv_heads, head_dim)
    theirs, v_before = qkv.clone(), qkv[:, (heads + kv_heads) * head_dim :].clone()
    triton_ops.rope_(qkv, positions, table, heads + kv_heads, head_dim)
    layer_ops.torch_rope_(theirs, positions, table, heads + kv_heads, head_dim)
    rotated = qkv[:, : (heads + kv_heads) * head_dim].cpu().double()
    torch.testing.assert_close(rotated, expected, **_float64_bound(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)
    assert torch.equal(qkv, theirs)  # elementwise, products rounded before the sums: same bits


def check_silu_mul(dtype, rows, width, device):
    gate_up = silu_inputs(rows, width, dtype, device)
    out = triton_ops.silu_mul(gate_up)
    torch.testing.assert_close(out.cpu().double(), silu_reference(gate_up.cpu()), **_float64_bound(dtype))
    theirs = layer_ops.torch_silu_mul(gate_up)
    if dtype == torch.bfloat16:
        assert ulp_distance(out, theirs) <= 1
    else:  # compiled, tl.exp is the hardware's exp2 approximation: its error grows with |x|
        torch.testing.assert_close(out, theirs, rtol=2**-19, atol=1e-30)


def check_batch_invariance(dtype, device):
    """Row r computed alone equals row r of a 37-row call, bit for bit, for each op."""
    residual, delta, weight = norm_inputs(37, 576, dtype, True, device)
    batch = triton_ops.add_rms_norm_(residual.clone(), delta, weight, EPS)
    for r in (0, 17, 36):
        alone = triton_ops.add_rms_norm_(residual[r : r + 1].clone(), delta[r : r + 1], weight, EPS)
        assert torch.equal(alone, batch[r : r + 1])
    qkv, positions, table = rope_inputs(37, 9, 3, 64, dtype, device)
    batch = qkv.clone()
    triton_ops.rope_(batch, positions, table, 12, 64)
    gate_up = silu_inputs(37, 1536, dtype, device)
    silu_batch = triton_ops.silu_mul(gate_up)
    for r in (0, 17, 36):
        alone = qkv[r : r + 1].clone()
        triton_ops.rope_(alone, positions[r : r + 1], table, 12, 64)
        assert torch.equal(alone, batch[r : r + 1])
        assert torch.equal(triton_ops.silu_mul(gate_up[r : r + 1]), silu_batch[r : r + 1])


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows, hidden", SHAPES)
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no-delta"])
def test_add_rms_norm_interpreted(dtype, rows, hidden, with_delta):
    check_add_rms_norm(dtype, rows, hidden, with_delta, "cpu")


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows, heads, kv_heads, head_dim", [(1, 9, 3, 64), (37, 4, 2, 10), (7, 32, 8, 128), (3, 1, 1, 2)])
def test_rope_interpreted(dtype, rows, heads, kv_heads, head_dim):
    check_rope(dtype, rows, heads, kv_heads, head_dim, "cpu")


def check_rope_and_cache_kv(dtype, heads, kv_heads, head_dim, device):
    """The fused RoPE + cache write against RoPE then attention's own write (paged._write_kv):
    the same qkv, the same caches, bit for bit; other slots untouched."""
    from test_ms_attention import Batch

    batch = Batch([1, 9, 5], [15, 20, 0], heads, kv_heads, head_dim, 16, dtype, seed=2)
    meta = batch.meta()
    positions = torch.from_numpy(np.concatenate(
        [np.arange(c - s, c) for c, s in zip(batch.context, batch.scheduled)])).to(device)  # fmt: skip
    slots = meta.slot_mapping.to(device)
    qkv = torch.cat([t.flatten(1) for t in (batch.q, batch.k, batch.v)], 1).to(device)
    table = rope_table(64, head_dim, 10000.0, device=torch.device(device))
    k_cache, v_cache = batch.k_cache.to(device, copy=True), batch.v_cache.to(device, copy=True)
    theirs, their_k, their_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    kv = triton_ops.KVWrite(k_cache, v_cache, slots, kv_heads)
    triton_ops.rope_(qkv, positions, table, heads + kv_heads, head_dim, kv)
    layer_ops.torch_rope_(theirs, positions, table, heads + kv_heads, head_dim)
    _, k, v = theirs.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
    meta.slot_mapping = slots
    paged._write_kv(k.unflatten(1, (kv_heads, head_dim)), v.unflatten(1, (kv_heads, head_dim)),
                    their_k, their_v, meta)  # fmt: skip
    assert torch.equal(qkv, theirs)
    assert torch.equal(k_cache, their_k) and torch.equal(v_cache, their_v)
    assert not torch.equal(k_cache.cpu(), batch.k_cache)  # it wrote


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (9, 3, 10), (2, 2, 32)])
def test_rope_and_cache_kv_interpreted(dtype, heads, kv_heads, head_dim):
    check_rope_and_cache_kv(dtype, heads, kv_heads, head_dim, "cpu")


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows, width", [(1, 1536), (37, 37), (5, 1), (2, 2500)])
def test_silu_mul_interpreted(dtype, rows, width):
    check_silu_mul(dtype, rows, width, "cpu")


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_batch_invariance_interpreted(dtype):
    check_batch_invariance(dtype, "cpu")


@interpreted
def test_rows_that_lie_apart_interpreted():
    """Row strides are honoured: a norm over rows of a wider tensor, SiLU x up over a view."""
    wide = _randn(5, 700, dtype=torch.bfloat16, seed=9)
    residual, _, weight = norm_inputs(5, 576, torch.bfloat16, False)
    wide[:, :576] = residual
    out = triton_ops.add_rms_norm_(wide[:, :576], None, weight, EPS)
    assert torch.equal(out, triton_ops.add_rms_norm_(residual, None, weight, EPS))
    gate_up = silu_inputs(5, 64, torch.float32)
    padded = torch.zeros(5, 200)
    padded[:, :128] = gate_up
    assert torch.equal(triton_ops.silu_mul(padded[:, :128]), triton_ops.silu_mul(gate_up))


@interpreted
def test_layer_ops_dispatches_to_the_kernels_interpreted(monkeypatch):
    """With the kernels' device pointed at the CPU, layer_ops runs them unless layer_ops_isa is
    "torch"; results are the kernels' own."""
    monkeypatch.setattr(layer_ops, "TRITON_DEVICE", "cpu")
    residual, delta, weight = norm_inputs(3, 576, torch.bfloat16, True)
    assert layer_ops.device_path(residual) == "triton"
    expected = triton_ops.add_rms_norm_(residual.clone(), delta, weight, EPS)
    assert torch.equal(layer_ops.add_rms_norm_(residual.clone(), delta, weight, EPS), expected)
    gate_up = silu_inputs(3, 100, torch.float32)
    assert torch.equal(layer_ops.silu_mul(gate_up), triton_ops.silu_mul(gate_up))


def test_the_kernels_under_tritons_interpreter():
    run_interpreted(__file__, " passed", 600, "-m", "not gpu")


# On a GPU: the compiled kernels.


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_cuda_kernels_match_float64_and_the_torch_path(dtype):
    for rows, hidden in SHAPES + [(300, 4096)]:
        for with_delta in (True, False):
            check_add_rms_norm(dtype, rows, hidden, with_delta, "cuda")
    for shape in [(1, 9, 3, 64), (37, 4, 2, 10), (300, 32, 8, 128), (3, 1, 1, 2), (64, 64, 8, 128)]:
        check_rope(dtype, *shape, "cuda")
    for rows, width in [(1, 1536), (37, 37), (5, 1), (300, 8192)]:
        check_silu_mul(dtype, rows, width, "cuda")
    for shape in [(4, 2, 64), (9, 3, 10), (32, 8, 128)]:
        check_rope_and_cache_kv(dtype, *shape, "cuda")
    check_batch_invariance(dtype, "cuda")


@gpu
@needs_cuda
def test_cuda_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs: the same bits as eager calls."""
    residual, delta, weight = norm_inputs(16, 576, torch.bfloat16, True, "cuda")
    gate_up = silu_inputs(16, 1536, torch.bfloat16, "cuda")
    qkv, positions, table = rope_inputs(16, 9, 3, 64, torch.bfloat16, "cuda")
    for _ in range(2):  # compile outside the capture
        triton_ops.add_rms_norm_(residual.clone(), delta, weight, EPS)
        triton_ops.silu_mul(gate_up)
        triton_ops.rope_(qkv.clone(), positions, table, 12, 64)
    graph = torch.cuda.CUDAGraph()
    static_residual, static_qkv = residual.clone(), qkv.clone()
    with torch.cuda.graph(graph):
        normed = triton_ops.add_rms_norm_(static_residual, delta, weight, EPS)
        silu = triton_ops.silu_mul(gate_up)
        triton_ops.rope_(static_qkv, positions, table, 12, 64)
    new_residual, new_qkv = residual * 2, qkv * 3
    static_residual.copy_(new_residual)
    static_qkv.copy_(new_qkv)
    graph.replay()
    torch.cuda.synchronize()
    eager_residual = new_residual.clone()
    assert torch.equal(normed, triton_ops.add_rms_norm_(eager_residual, delta, weight, EPS))
    assert torch.equal(static_residual, eager_residual)
    assert torch.equal(silu, triton_ops.silu_mul(gate_up))
    triton_ops.rope_(new_qkv, positions, table, 12, 64)
    assert torch.equal(static_qkv, new_qkv)


def greedy_tokens(**config):
    """The tiny random Llama's greedy tokens for two sequences (a prompt chunked in two, a short
    one, then decodes) and Describe's layer_ops path, with these config fields."""
    from conftest import tiny_config
    from ms_driver import Driver

    from model_service.start import start_runner

    try:
        driver = Driver(start_runner(tiny_config(**config)))
        driver.add(0, list(range(3, 60)))
        driver.add(1, list(range(100, 111)))
        driver.step({0: 32, 1: 11})
        driver.step({0: 25, 1: 1})
        for _ in range(12):
            driver.step({0: 1, 1: 1})
    finally:  # the paths are process-wide: leave the defaults for the next test
        layer_ops.PATH.select("auto")
        paged.PATH.select("auto")
    tokens = {slot: seq.generated for slot, seq in driver.seqs.items()}
    return tokens, driver.runner.compute["layer_ops"]


@interpreted
def test_tiny_model_greedy_tokens_with_the_kernels_interpreted(monkeypatch):
    """The whole forward with the kernels (K/V written by the RoPE kernel, the attention's torch
    path skipping its write) against the torch layer ops, float32: the same greedy tokens."""
    monkeypatch.setattr(layer_ops, "TRITON_DEVICE", "cpu")
    fused = []
    real_rope = triton_ops.rope_
    monkeypatch.setattr(triton_ops, "rope_", lambda *a: fused.append(len(a) == 6) or real_rope(*a))
    ours, _ = greedy_tokens(attention_isa="torch")
    assert fused and all(fused)
    theirs, path = greedy_tokens(attention_isa="torch", layer_ops_isa="torch")
    assert path == "torch"
    assert ours == theirs


@gpu
@needs_cuda
def test_cuda_greedy_tokens_equal_with_triton_and_torch_layer_ops():
    """The tiny random Llama in float32 on CUDA, layer_ops_isa auto (Triton) against torch: the
    same greedy tokens, and Describe's compute map names each path."""
    ours, our_path = greedy_tokens(device="cuda")
    theirs, their_path = greedy_tokens(device="cuda", layer_ops_isa="torch")
    assert (our_path, their_path) == ("triton", "torch (layer_ops_isa=torch)")
    assert ours == theirs
