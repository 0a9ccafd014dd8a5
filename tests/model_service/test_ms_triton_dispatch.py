"""Where layer_ops runs the Triton kernels (model_service/kernels/layer_ops.py's `_path`, the one
decider): on their device with Triton present and layer_ops_isa not "torch", else the torch path
or, on the CPU, the native one; what Describe reports (`device_path`); the K/V cache write that
RoPE takes over from attention there. The decider is the real one, with the kernels' device
pointed at the CPU and triton_ops' entry points replaced by recorders: no kernel runs here (the
kernels themselves: test_ms_triton_ops.py).
"""

from __future__ import annotations

import pytest
import torch
from test_ms_triton_ops import EPS, norm_inputs, rope_inputs, silu_inputs

from model_service.attention import paged
from model_service.kernels import layer_ops, triton_ops

@pytest.fixture
def spies(monkeypatch):
    """triton_ops' entry points replaced by recorders (no kernel runs), the kernels' device
    pointed at the CPU, and Triton reported present."""
    calls = []
    for name in ("add_rms_norm_", "rope_", "silu_mul"):
        monkeypatch.setattr(triton_ops, name, lambda *a, _name=name, **k: calls.append(_name))
    monkeypatch.setattr(layer_ops, "TRITON_DEVICE", "cpu")
    monkeypatch.setattr(triton_ops, "triton", triton_ops.triton or object())
    return calls


def _call_each(isa=None, dtype=torch.float32):
    residual, delta, weight = norm_inputs(2, 64, dtype, True)
    qkv, positions, table = rope_inputs(2, 2, 1, 16, dtype)
    layer_ops.add_rms_norm_(residual, delta, weight, EPS, isa=isa)
    layer_ops.rope_(qkv, positions, table, 3, 16, isa=isa)
    layer_ops.silu_mul(silu_inputs(2, 8, dtype), isa=isa)


def test_layer_ops_run_the_kernels_on_their_device(spies):
    _call_each()
    assert spies == ["add_rms_norm_", "rope_", "silu_mul"]
    assert layer_ops.device_path(torch.zeros(1)) == "triton"


def test_layer_ops_isa_torch_keeps_the_torch_path(spies):
    _call_each(isa="torch")
    assert spies == []
    layer_ops.PATH.select("torch")
    try:
        assert layer_ops.device_path(torch.zeros(1)) == "torch (layer_ops_isa=torch)"
    finally:
        layer_ops.PATH.select("auto")


def test_without_triton_or_off_its_device_the_kernels_do_not_run(spies, monkeypatch):
    monkeypatch.setattr(triton_ops, "triton", None)
    _call_each()
    assert spies == []
    assert layer_ops.device_path(torch.zeros(1)) == "torch (triton is not installed)"
    monkeypatch.setattr(layer_ops, "TRITON_DEVICE", "cuda")
    assert layer_ops.device_path(torch.zeros(1)) == "torch (device cpu)"
    assert layer_ops.device_path(torch.zeros(1, dtype=torch.float64)) == "torch (device cpu)"


def test_a_dtype_the_kernels_do_not_take_runs_the_torch_path(spies):
    assert layer_ops.device_path(torch.zeros(1, dtype=torch.float64)) == "torch (dtype torch.float64)"
    layer_ops.silu_mul(torch.ones(2, 4, dtype=torch.float64))
    assert spies == []


def _rope_and_cache(isa=None, cache_dtype=torch.float32):
    qkv, positions, table = rope_inputs(2, 2, 1, 16, torch.float32)
    k_cache = torch.zeros(4, 1, 16, 16, dtype=cache_dtype)
    return layer_ops.rope_and_cache_kv_(qkv, positions, table, 2, 1, 16, k_cache, k_cache.clone(),
                                        torch.tensor([17, 18]), isa=isa)  # fmt: skip


def test_rope_writes_the_cache_only_where_the_kernel_runs(spies):
    assert _rope_and_cache() is True and spies == ["rope_"]
    assert _rope_and_cache(isa="torch") is False and spies == ["rope_"]
    assert _rope_and_cache(cache_dtype=torch.bfloat16) is False  # the kernel's rope_, no write
    assert spies == ["rope_", "rope_"]


def test_the_cpu_rope_leaves_the_cache_write_to_attention():
    assert _rope_and_cache() is False


def test_attention_skips_its_cache_write_when_told():
    """kv_written: the caches are read as they are (the torch path; the CPU's native kernel
    writes as it reads, whatever the caller says)."""
    from test_ms_attention import Batch

    batch = Batch([1, 9, 5], [15, 20, 0], 4, 2, 64, 16, torch.float32, seed=4)
    written, k_cache, v_cache = batch.run("torch")
    untouched_k, untouched_v = batch.k_cache.clone(), batch.v_cache.clone()
    skipped = paged.paged_attention(batch.q, batch.k, batch.v, untouched_k, untouched_v,
                                    batch.meta(), isa="torch", kv_written=True)  # fmt: skip
    assert torch.equal(untouched_k, batch.k_cache) and torch.equal(untouched_v, batch.v_cache)
    reread = paged.paged_attention(batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta(),
                                   isa="torch", kv_written=True)  # fmt: skip
    assert torch.equal(reread.view(written.shape), written)
    assert not torch.equal(skipped.view(written.shape), written)


def test_the_cpu_keeps_its_native_path():
    """Unpatched, CPU tensors never reach the Triton kernels."""
    residual, delta, weight = norm_inputs(2, 64, torch.float32, True)
    assert layer_ops._path(residual, None) == layer_ops.native.ISAS.index(layer_ops.PATH.current)
    assert layer_ops.device_path(residual) == "torch (device cpu)"


