"""The paged attention kernel (cython_ext/paged_attention.pyx) against a float64 reference written
in plain torch over the gathered context, on every ISA path this machine runs; batch invariance
at the kernel; the portable path's object code free of AVX-512.

Tolerance against the float64 reference: the inputs are exact in both dtypes (the reference
upcasts the same bf16/float32 values), the kernel accumulates in float32 over at most ~2,000 keys
(relative error of a few 1e-6 for softmax-weighted sums of unit-scale values), so float32 must
agree within 2e-5 absolute. A bf16 output is the float32 result rounded to nearest: half an ulp,
2^-9 of |ref|, plus the float32 part; checked as |out - ref| <= 2^-8 |ref| + 1e-4 per element.
"""
from __future__ import annotations

import platform
import re
import subprocess

import numpy as np
import pytest
import torch

from cython_ext import paged_attention as native
from model_service.attention.paged import _torch_attention, build_attention_metadata, paged_attention, resolve_isa, split_positions

SUPPORTED = [name for name in native.ISAS if native.isa_supported(name)]


def test_isa_paths_of_this_machine(capsys):
    """The portable path is always there; the report names every path the tests below force."""
    assert "portable" in SUPPORTED
    assert resolve_isa("auto") == SUPPORTED[-1]
    with capsys.disabled():
        print(f"\npaged attention ISA paths run here: {', '.join(SUPPORTED)} (auto: {resolve_isa('auto')})")


def test_unknown_isa_is_refused_by_name():
    with pytest.raises(ValueError, match=r"attention_isa \(PLANSERVE_ATTENTION_ISA\): 'sse9' is not one of auto, torch, portable"):
        resolve_isa("sse9")


class Batch:
    """A random paged batch: sequences with `computed` cached positions and `scheduled` new
    rows each, blocks drawn from a shuffled pool (non-contiguous), optionally the first
    `shared_prefix_blocks` blocks shared by every sequence (as prefix caching does)."""

    def __init__(self, scheduled, computed, heads, kv_heads, head_dim, block_size, dtype, seed=0,
                 shared_prefix_blocks=0):
        gen = torch.Generator().manual_seed(seed)
        self.scheduled = np.asarray(scheduled, dtype=np.int64)
        self.computed = np.asarray(computed, dtype=np.int64)
        self.context = self.computed + self.scheduled
        self.block_size, self.dtype = block_size, dtype
        blocks_per_seq = -(-self.context // block_size)
        num_blocks = int(blocks_per_seq.sum()) + shared_prefix_blocks + 8
        pool = list((torch.randperm(num_blocks - 1, generator=gen) + 1).tolist())
        shared = [pool.pop() for _ in range(shared_prefix_blocks)]
        self.tables = np.zeros((len(scheduled), int(blocks_per_seq.max()) + 2), dtype=np.int64)  # + padding columns
        for b, count in enumerate(blocks_per_seq):
            # Only whole cached blocks are shared (as the prefix cache shares them): never written here.
            num_shared = shared_prefix_blocks if self.computed[b] >= shared_prefix_blocks * block_size else 0
            self.tables[b, :count] = shared[:num_shared] + [pool.pop() for _ in range(count - num_shared)]
        self.query_start = np.concatenate(([0], np.cumsum(self.scheduled)[:-1])).astype(np.int64)
        rows = [(b, p) for b in range(len(scheduled)) for p in range(self.computed[b], self.context[b])]
        self.slot_mapping = np.array([self.tables[b, p // block_size] * block_size + p % block_size for b, p in rows], dtype=np.int64)
        rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
        self.k_cache, self.v_cache = rand(num_blocks, kv_heads, block_size, head_dim), rand(num_blocks, kv_heads, block_size, head_dim)
        self.k_cache[0] = self.v_cache[0] = 0
        t = len(rows)
        self.q, self.k, self.v = rand(t, heads, head_dim), rand(t, kv_heads, head_dim), rand(t, kv_heads, head_dim)

    def meta(self):
        t = lambda a: torch.from_numpy(a)  # noqa: E731
        return build_attention_metadata(t(self.slot_mapping), t(self.query_start), t(self.scheduled), t(self.context), t(self.tables),
                                        self.block_size, int(self.scheduled.max()), int(self.context.max()))

    def run(self, isa, attention=None):
        """(output [T, H, D], caches after the write)."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        if attention is None:
            out = paged_attention(self.q, self.k, self.v, k_cache, v_cache, self.meta(), isa=isa)
        else:
            out = attention(self.q, self.k, self.v, k_cache, v_cache, self.meta())
        return out.view(self.q.shape), k_cache, v_cache

    def reference(self, k_cache, v_cache) -> torch.Tensor:
        """float64 attention over each sequence's gathered context, causal by position."""
        _, heads, head_dim = self.q.shape
        kv_heads, bs = k_cache.shape[1], self.block_size
        out = torch.zeros(self.q.shape, dtype=torch.float64)
        for b, context in enumerate(self.context.tolist()):
            blocks = torch.from_numpy(self.tables[b, : -(-context // bs)])
            keys = k_cache[blocks].double().permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :context]
            values = v_cache[blocks].double().permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :context]
            for r in range(int(self.scheduled[b])):
                row, position = int(self.query_start[b]) + r, context - int(self.scheduled[b]) + r
                for h in range(heads):
                    kv = h // (heads // kv_heads)
                    scores = keys[kv, : position + 1] @ self.q[row, h].double() * head_dim**-0.5
                    out[row, h] = scores.softmax(0) @ values[kv, : position + 1]
        return out


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    err = (out.double() - ref).abs()
    if dtype == torch.float32:
        assert err.max().item() <= 2e-5, f"max error {err.max().item():.3g}"
    else:
        bound = ref.abs() * 2.0**-8 + 1e-4
        assert (err <= bound).all(), f"max error {err.max().item():.3g} beyond 2^-8 |ref| + 1e-4"


# Decodes and prompt chunks mixed in one call; context lengths from 1 to 2,000; long chunks
# cross several KV splits (256 positions) and short ones run their splits as separate items.
MIXED = dict(scheduled=[1, 37, 1, 5, 1, 300, 1, 16], computed=[0, 0, 1999, 600, 255, 1100, 40, 240])


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 128)],
                         ids=["gqa1-d64", "gqa3-d64", "gqa4-d128", "gqa8-d128"])
def test_kernel_matches_float64_reference(isa, dtype, heads, kv_heads, head_dim):
    batch = Batch(**MIXED, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16, dtype=dtype,
                  shared_prefix_blocks=2)
    out, k_cache, v_cache = batch.run(isa)
    # The step's rows were written where slot_mapping says, in the [NB, KVH, BS, D] layout.
    blocks, offsets = torch.from_numpy(batch.slot_mapping // 16), torch.from_numpy(batch.slot_mapping % 16)
    assert torch.equal(k_cache[blocks, :, offsets], batch.k) and torch.equal(v_cache[blocks, :, offsets], batch.v)
    assert_close_to_reference(out, batch.reference(k_cache, v_cache), dtype)


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_views_of_a_fused_qkv_row_give_the_same_bits(isa, dtype):
    """q, k, v as column views of one [T, (H + 2 KVH) * D] QKV output (rows wider than each part,
    as the fused layers pass them) give the bits of contiguous copies: same output, same cache."""
    batch = Batch(**MIXED, heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    out, k_cache, v_cache = batch.run(isa)
    qkv = torch.cat([t.flatten(1) for t in (batch.q, batch.k, batch.v)], dim=1)
    q, k, v = (part.unflatten(1, (-1, 64)) for part in qkv.split([9 * 64, 3 * 64, 3 * 64], dim=1))
    assert q.stride(0) == qkv.shape[1] and not q.is_contiguous()
    strided_k, strided_v = batch.k_cache.clone(), batch.v_cache.clone()
    strided = paged_attention(q, k, v, strided_k, strided_v, batch.meta(), isa=isa)
    assert torch.equal(strided.view(out.shape), out)
    assert torch.equal(strided_k, k_cache) and torch.equal(strided_v, v_cache)


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("block_size, head_dim", [(1, 64), (8, 80), (32, 128)])
def test_odd_block_sizes_and_head_dims(isa, block_size, head_dim):
    """Blocks smaller and larger than a vector, head dims that leave a vector tail."""
    for dtype in (torch.float32, torch.bfloat16):
        batch = Batch([1, 9, 1], [300, 20, 0], 6, 2, head_dim, block_size, dtype, seed=3)
        out, k_cache, v_cache = batch.run(isa)
        assert_close_to_reference(out, batch.reference(k_cache, v_cache), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_torch_path_matches_reference(dtype):
    """The gather + SDPA path other devices use, on the same layouts."""
    batch = Batch(**MIXED, heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    out, k_cache, v_cache = batch.run(None, attention=_torch_attention)
    ref = batch.reference(k_cache, v_cache)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2  # SDPA's bf16 kernel rounds P to bf16
    assert (out.double() - ref).abs().max().item() <= tolerance


class Sequence:
    """One sequence's full K/V and queries for positions 0..length-1, placed into any batch."""

    def __init__(self, length, heads, kv_heads, head_dim, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        self.length = length
        self.q, self.k, self.v = (torch.randn(length, n, head_dim, generator=gen).to(dtype) for n in (heads, kv_heads, kv_heads))


def run_together(seqs_and_rows, heads, kv_heads, head_dim, dtype, isa, block_size=16):
    """Attend several sequences in one call: (Sequence, rows computed this call) each; the
    positions before those rows are already in the cache. Returns each sequence's last row."""
    scheduled = np.array([rows for _, rows in seqs_and_rows], dtype=np.int64)
    context = np.array([s.length for s, _ in seqs_and_rows], dtype=np.int64)
    blocks_per_seq = -(-context // block_size)
    num_blocks = int(blocks_per_seq.sum()) + 1
    ids = np.random.default_rng(int(context.sum())).permutation(np.arange(1, num_blocks))  # shuffled, per batch
    tables = np.zeros((len(seqs_and_rows), blocks_per_seq.max()), dtype=np.int64)
    k_cache = torch.zeros(num_blocks, kv_heads, block_size, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q, k, v, slots, first = [], [], [], [], 0
    for b, (seq, rows) in enumerate(seqs_and_rows):
        tables[b, : blocks_per_seq[b]] = ids[first : first + blocks_per_seq[b]]
        first += blocks_per_seq[b]
        for p in range(seq.length):
            block, offset = tables[b, p // block_size], p % block_size
            if p < seq.length - rows:
                k_cache[block, :, offset], v_cache[block, :, offset] = seq.k[p], seq.v[p]
            else:
                slots.append(block * block_size + offset)
        q.append(seq.q[seq.length - rows :]), k.append(seq.k[seq.length - rows :]), v.append(seq.v[seq.length - rows :])
    query_start = np.concatenate(([0], np.cumsum(scheduled)[:-1])).astype(np.int64)
    t = torch.from_numpy
    meta = build_attention_metadata(t(np.array(slots, dtype=np.int64)), t(query_start), t(scheduled), t(context), t(tables),
                                    block_size, int(scheduled.max()), int(context.max()))
    out = paged_attention(torch.cat(q), torch.cat(k), torch.cat(v), k_cache, v_cache, meta, isa=isa).view(-1, heads, head_dim)
    return [out[query_start[b] + scheduled[b] - 1] for b in range(len(seqs_and_rows))]


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("length", [1, 17, 256, 700])
def test_row_is_bitwise_the_same_alone_in_a_batch_and_in_a_chunk(isa, dtype, length):
    """A row's output is bitwise equal: decoded alone; decoded beside 15 other rows of other
    lengths (decodes and a chunk); as the last row of a prompt chunk of several sizes (short
    chunks run KV splits as separate items, long ones inside row tiles: both must agree)."""
    heads, kv_heads, head_dim = 9, 3, 64
    seq = Sequence(length, heads, kv_heads, head_dim, dtype, seed=length)
    alone = run_together([(seq, 1)], heads, kv_heads, head_dim, dtype, isa)[0]
    others = [(Sequence(n, heads, kv_heads, head_dim, dtype, seed=100 + n), 1) for n in (3, 40, 129, 260, 511, 1030, 64, 9, 300, 2, 77, 800, 18, 1500)]
    others.append((Sequence(90, heads, kv_heads, head_dim, dtype, seed=7), 33))  # a chunk of 33 rows
    crowd = run_together(others[:7] + [(seq, 1)] + others[7:], heads, kv_heads, head_dim, dtype, isa)
    assert len(crowd) == 16
    assert torch.equal(crowd[7], alone)
    for chunk in sorted({1, 2, 8, 9, 16, 40, length} & set(range(1, length + 1))):
        in_chunk = run_together([(Sequence(5, heads, kv_heads, head_dim, dtype, seed=1), 1), (seq, chunk)],
                                heads, kv_heads, head_dim, dtype, isa)[1]
        assert torch.equal(in_chunk, alone), f"last row of a {chunk}-row chunk differs from the decode"


def test_bad_indices_are_refused_not_read():
    batch = Batch([1, 3], [10, 0], 4, 2, 64, 16, torch.float32)
    batch.tables[0, 0] = batch.k_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="block_tables entry outside the cache"):
        batch.run("portable")
    batch = Batch([1, 3], [10, 0], 4, 2, 64, 16, torch.float32)
    batch.slot_mapping[1] = -1
    with pytest.raises(ValueError, match="slot_mapping entry outside the cache"):
        batch.run("portable")


def test_split_length_is_whole_blocks():
    assert split_positions(16) == 256 and split_positions(12) == 264 and split_positions(1) == 256


def _functions_of(listing: str, namespace: str) -> list[str]:
    functions = re.split(r"\n(?=[0-9a-f]+ <)", listing)
    return [f for f in functions if f"{namespace}::" in f.split("\n", 1)[0]]


def test_object_code_of_each_path_stays_within_its_isa():
    """The portable path is built without ISA flags: no AVX (ymm) or AVX-512 (zmm) register in
    its object code, nor in the dispatcher's; the AVX2 path has no zmm; the AVX-512 paths do use
    zmm (they were built with their flags)."""
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", native.__file__], check=True,
                             capture_output=True, text=True).stdout
    dispatcher = [f for f in re.split(r"\n(?=[0-9a-f]+ <)", listing)
                  if re.match(r"[0-9a-f]+ <(pa_paged_attention|pa_fold_split|pa_run_items_portable)\b", f)]
    portable = _functions_of(listing, "planserve_pa_portable") + dispatcher
    assert len(portable) >= 4
    offenders = [f.split("\n", 1)[0] for f in portable if "ymm" in f or "zmm" in f]
    assert not offenders, f"AVX or AVX-512 registers in the portable path: {offenders}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return  # other architectures build the portable path alone
    avx2 = _functions_of(listing, "planserve_pa_avx2")
    assert avx2 and not [f.split("\n", 1)[0] for f in avx2 if "zmm" in f]
    assert any("ymm" in f for f in avx2), "the AVX2 path was built without AVX code"
    assert any("zmm" in f for f in _functions_of(listing, "planserve_pa_avx512")), "the AVX-512 path has no AVX-512 code"
