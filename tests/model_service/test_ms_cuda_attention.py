"""The CUDA paged attention kernel (model_service/attention/cuda_attention.py, Triton).

On a machine without a GPU, the kernel's own code runs under Triton's interpreter (numpy, on CPU
tensors) against the float64 reference of the CPU kernel's tests, in float32 and float16 only: the
interpreter's bf16 dot is wrong (a 16x16 bf16 tl.dot came back ~1e10 off under Triton 3.6's
interpreter, while its bf16 loads and casts were exact), so bf16 is checked on a GPU. The `gpu`
tests run the compiled kernel on CUDA: both dtypes against the reference, sliding windows against
the torch path, bitwise batch invariance, and the tiny model's greedy tokens on CUDA against the
CPU's in float32 (parity: the CPU kernel is the one the transformers parity tests check).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_ms_attention import MIXED, Batch, Sequence, assert_close_to_reference, run_together

from model_service.attention import paged as attention
from model_service.attention import cuda_attention
from model_service.attention.paged import _torch_attention, _write_kv

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def meta_on(meta, device: str):
    """The step's index tensors moved to `device`, as the runner builds them off the CPU (no
    native step: that is the CPU kernel's view)."""
    for name in ("slot_mapping", "query_start", "num_scheduled", "context_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).to(device))
    meta.native_step = None
    return meta


def run_kernel(batch: Batch, device: str, sliding_window=None, padded=False):
    """(output [T, H, D] on the CPU, caches after the write) of the Triton kernel on `device`.
    `padded`: as a CUDA graph's bucket runs it: two empty sequences after the step's and the tile
    map padded to a capacity for 5 more rows (padded_step.py)."""
    meta = meta_on(batch.meta(), device)
    to = lambda t: t.to(device)  # noqa: E731
    k_cache, v_cache = to(batch.k_cache.clone()), to(batch.v_cache.clone())
    _write_kv(to(batch.k), to(batch.v), k_cache, v_cache, meta)
    rows = cuda_attention.rows_per_tile(batch.q.shape[1] // k_cache.shape[1])
    tables, seqs = meta.block_tables, (meta.query_start, meta.num_scheduled, meta.context_lens)
    if padded:
        seqs = [torch.cat((t, t.new_zeros(2))) for t in seqs]
        tables = torch.cat((tables, tables.new_zeros((2, tables.shape[1]))))
    num_scheduled = seqs[1].cpu().numpy()
    capacity = cuda_attention.max_tiles(int(num_scheduled.sum()) + 5, num_scheduled.size, rows)
    out = np.zeros((2, capacity), dtype=np.int64) if padded else None
    _, tiles = cuda_attention.attention_tiles(num_scheduled, rows, out)
    out = cuda_attention.paged_attention(
        to(batch.q), k_cache, v_cache, *seqs, tables, to(torch.from_numpy(tiles)), sliding_window)
    return out.cpu(), k_cache.cpu(), v_cache.cpu()


# Small enough for the interpreter (~1 s a program): a decode at a block edge, a decode deep in
# its context, a chunk over a cached prefix that crosses blocks, a whole short prompt.
SMALL = dict(scheduled=[1, 1, 9, 5], computed=[15, 70, 20, 0])
INTERPRETED_SHAPES = [(9, 3, 64), (4, 4, 32), (6, 2, 80)]  # (heads, KV heads, head dim)


def check_interpreted_kernel() -> None:
    """Run by the test below in a process with TRITON_INTERPRET=1 (Triton reads it when it is
    imported, so it cannot be switched on inside this one)."""
    for heads, kv_heads, head_dim in INTERPRETED_SHAPES:
        batch = Batch(**SMALL, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                      dtype=torch.float32, shared_prefix_blocks=1)
        out, k_cache, v_cache = run_kernel(batch, "cpu")
        assert_close_to_reference(out, batch.reference(k_cache, v_cache), torch.float32)
        print(f"heads {heads}, KV heads {kv_heads}, head dim {head_dim}: matches the reference")
    batch = Batch(**SMALL, heads=6, kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
    out, _, _ = run_kernel(batch, "cpu", sliding_window=8)
    torch_out, _, _ = batch.run(None, lambda *a: _torch_attention(*a, sliding_window=8))
    assert (out - torch_out).abs().max().item() <= 2e-5
    whole, _, _ = run_kernel(batch, "cpu")
    assert (whole - out).abs().max().item() > 1e-2  # the window changed the deep rows
    print("sliding window 8: matches the torch path")
    padded, _, _ = run_kernel(batch, "cpu", padded=True)
    assert torch.equal(padded, whole)
    print("padded sequences and tiles: matches the unpadded call bit for bit")
    # A 16-bit model's P.V as two tensor-core dots (PV_SPLIT): float16 here, the interpreter's
    # bf16 dot being wrong; the bf16 path is checked on a GPU.
    batch = Batch(**SMALL, heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=torch.float16,
                  shared_prefix_blocks=1)
    out, k_cache, v_cache = run_kernel(batch, "cpu")
    assert_close_to_reference(out, batch.reference(k_cache, v_cache), torch.float16)
    print("float16, P.V split in two halves: matches the reference")


def test_the_kernel_under_tritons_interpreter():
    pytest.importorskip("triton")
    if HAS_CUDA:
        pytest.skip("a GPU runs the compiled kernel (the gpu tests)")
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([here, os.path.join(root, "protos"), root]))
    done = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("matches") == len(INTERPRETED_SHAPES) + 3, done.stdout


def test_the_cpu_is_not_the_kernels_device():
    reason = cuda_attention.unsupported_reason(torch.zeros(1, 4, 64), torch.zeros(2, 2, 16, 64))
    assert reason == ("triton is not installed" if cuda_attention.triton is None else "device cpu")


def test_a_tile_fills_a_tensor_core_dot_for_every_grouping():
    for group in (1, 2, 3, 4, 5, 8, 16, 32):
        rows = cuda_attention.rows_per_tile(group)
        padded = 1 << (group - 1).bit_length()
        assert rows * padded >= cuda_attention.MIN_DOT and (rows == 1 or rows * padded == 16)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 128)],
                         ids=["gqa1-d64", "gqa3-d64", "gqa4-d128", "gqa8-d128"])
def test_cuda_kernel_matches_float64_reference(dtype, heads, kv_heads, head_dim):
    batch = Batch(**MIXED, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                  dtype=dtype, shared_prefix_blocks=2)
    out, k_cache, v_cache = run_kernel(batch, "cuda")
    assert_close_to_reference(out, batch.reference(k_cache, v_cache), dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size, head_dim", [(32, 80), (64, 128)])
def test_cuda_kernel_on_larger_blocks_and_padded_head_dims(block_size, head_dim):
    for dtype in (torch.float32, torch.bfloat16):
        batch = Batch([1, 9, 1], [300, 20, 0], 6, 2, head_dim, block_size, dtype, seed=3)
        out, k_cache, v_cache = run_kernel(batch, "cuda")
        assert_close_to_reference(out, batch.reference(k_cache, v_cache), dtype)


@gpu
@needs_cuda
def test_a_block_size_the_kernel_does_not_take_runs_the_torch_path_on_cuda():
    batch = Batch([1, 9, 1], [300, 20, 0], 6, 2, 64, 8, torch.float32, seed=3)
    assert cuda_attention.unsupported_reason(batch.q.cuda(), batch.k_cache.cuda()) == (
        "block_size 8 (a power of two >= 16 is needed)")
    meta = meta_on(batch.meta(), "cuda")
    k_cache, v_cache = batch.k_cache.cuda(), batch.v_cache.cuda()
    out = attention.paged_attention(batch.q.cuda(), batch.k.cuda(), batch.v.cuda(), k_cache, v_cache, meta)
    ref = batch.reference(k_cache.cpu(), v_cache.cpu())
    assert (out.view(batch.q.shape).cpu().double() - ref).abs().max().item() <= 2e-5


@gpu
@needs_cuda
def test_cuda_kernel_sliding_window_matches_the_torch_path():
    batch = Batch(**MIXED, heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    out, _, _ = run_kernel(batch, "cuda", sliding_window=40)
    torch_out, _, _ = batch.run(None, lambda *a: _torch_attention(*a, sliding_window=40))
    assert (out - torch_out).abs().max().item() <= 2e-5


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("length", [1, 17, 256, 700])
def test_cuda_row_is_bitwise_the_same_alone_in_a_batch_and_in_a_chunk(dtype, length, monkeypatch):
    """As the CPU kernel's invariance test, through paged_attention on CUDA tensors."""
    real = attention.paged_attention

    def on_cuda(q, k, v, k_cache, v_cache, meta, isa=None):
        meta = meta_on(meta, "cuda")
        out = real(q.cuda(), k.cuda(), v.cuda(), k_cache.cuda(), v_cache.cuda(), meta)
        return out.cpu()

    import test_ms_attention

    monkeypatch.setattr(test_ms_attention, "paged_attention", on_cuda)
    heads, kv_heads, head_dim = 9, 3, 64
    seq = Sequence(length, heads, kv_heads, head_dim, dtype, seed=length)
    alone = run_together([(seq, 1)], heads, kv_heads, head_dim, dtype, None)[0]
    others = [(Sequence(n, heads, kv_heads, head_dim, dtype, seed=100 + n), 1)
              for n in (3, 40, 129, 260, 511, 1030, 64, 9, 300, 2, 77, 800, 18, 1500)]
    others.append((Sequence(90, heads, kv_heads, head_dim, dtype, seed=7), 33))
    crowd = run_together(others[:7] + [(seq, 1)] + others[7:], heads, kv_heads, head_dim, dtype, None)
    assert torch.equal(crowd[7], alone)
    for chunk in sorted({2, 8, 9, 16, 40, length} & set(range(1, length + 1))):
        in_chunk = run_together([(Sequence(5, heads, kv_heads, head_dim, dtype, seed=1), 1), (seq, chunk)],
                                heads, kv_heads, head_dim, dtype, None)[1]
        assert torch.equal(in_chunk, alone), f"last row of a {chunk}-row chunk differs from the decode"


@gpu
@needs_cuda
def test_cuda_greedy_tokens_equal_the_cpus_in_float32():
    from ms_driver import Driver

    from model_service.loading.loader import load_model
    from model_service.start import start_runner
    from conftest import tiny_config

    tokens = {}
    for device in ("cpu", "cuda"):
        config = tiny_config(device=device)
        driver = Driver(start_runner(config))
        driver.add(0, list(range(3, 60)))
        driver.add(1, list(range(100, 111)))
        driver.step({0: 32, 1: 11})
        driver.step({0: 25, 1: 1})
        for _ in range(12):
            driver.step({0: 1, 1: 1})
        tokens[device] = {slot: seq.generated for slot, seq in driver.seqs.items()}
    assert tokens["cuda"] == tokens["cpu"]


if __name__ == "__main__":
    check_interpreted_kernel()
