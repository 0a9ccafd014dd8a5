"""The native loop's per-row LoRA products (cython_ext/csrc/lora_rows.h: each row against its own
adapter's blocks of the stack only), on every ISA path this machine runs, each forced (portable,
avx2, avx512, avx512_bf16): against a float64 reference; bit for bit the stacked products of
model_service/lora/stacked.py packed for the same GEMM path (what the Python loop computes); each
row bitwise itself alone, whatever the thread count; base rows untouched.

A fused module like qkv: three targets of uneven widths (40, 16, 24 columns: panels cut short),
three adapters (ranks 4, 16 and an odd 7, padded to 8), the second adapting two targets only.

Tolerance against float64: u rounded to bfloat16 (2^-8 relative) before the expand, and the
result's bfloat16 rounding.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import vector_registers

from cython_ext import decoder as native
from cython_ext import gemm as native_gemm
from model_service.lora.stacked import _module_stack
from model_service.lora.targets import TargetSlice
from model_service.models.decoder_loop import rows_by_adapter

ISAS = [
    name
    for index, name in enumerate(native_gemm.ISAS)
    if native_gemm.isa_supported(name) and native.lora_isa_supported(index)
]
IN = 64
SLICES = {
    name: TargetSlice("qkv_proj", start, end, IN)
    for name, start, end in [("q_proj", 0, 40), ("k_proj", 40, 56), ("v_proj", 56, 80)]
}
WIDTH = 80
ADAPTERS = [
    (1, 4, ("q_proj", "k_proj", "v_proj")),
    (2, 16, ("q_proj", "v_proj")),
    (3, 7, tuple(SLICES)),
]
SCALE = {1: 2.0, 2: 0.5, 3: 16 / 7}


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _adapters():
    adapters = []
    for lora_id, rank, targets in ADAPTERS:
        pairs = []
        for n, name in enumerate(targets):
            place = SLICES[name]
            a = _randn(rank, IN, seed=10 * lora_id + n) * IN**-0.5
            b = _randn(place.end - place.start, rank, seed=100 * lora_id + n) * rank**-0.5
            weights = (SimpleNamespace(weight=a), SimpleNamespace(weight=b))
            pairs.append(
                SimpleNamespace(target=name, a=weights[0], b=weights[1], start=place.start)
            )
        layers = [{"qkv_proj": pairs}]
        adapters.append(SimpleNamespace(lora_id=lora_id, layers=layers, scale=SCALE[lora_id]))
    return adapters


@pytest.fixture(scope="module")
def factors():
    return _adapters()


def _stack(adapters, isa):
    stack = _module_stack(tuple(adapters), 0, "qkv_proj", isa, SLICES)
    table = native.LoraTable(1, len(stack.parts))
    targets = [
        (b.packed.data_ptr(), k0, k1, start, end, blocks.ctypes.data, len(blocks))
        for (k0, k1, b, start, end), blocks in zip(stack.parts, stack.blocks)
    ]
    table.set_module(0, "qkv_proj", stack.a.packed.data_ptr(), stack.a.out_features, targets)
    return stack, table


def _native(table, isa, x, y, row_owner, threads=2):
    y = y.clone()
    order, groups = rows_by_adapter(np.asarray(row_owner, dtype=np.int64))
    scale = torch.tensor([SCALE.get(int(i), 0.0) for i in row_owner], dtype=torch.float32)
    u = torch.full((len(row_owner), table.max_rank), 7, dtype=torch.int16).view(torch.bfloat16)
    table.add(
        0,
        "qkv_proj",
        x.data_ptr(),
        IN,
        IN,
        y.data_ptr(),
        WIDTH,
        order.ctypes.data,
        groups.ctypes.data,
        len(groups),
        scale.data_ptr(),
        u.data_ptr(),
        table.max_rank,
        native_gemm.ISAS.index(isa),
        threads,
    )
    return y


def _stacked(stack, x, y, row_owner):
    scale = torch.tensor([[SCALE.get(int(i), 0.0)] for i in row_owner], dtype=torch.float32)
    y = y.clone()
    stack.add_(x, y, np.asarray(row_owner, dtype=np.int64), scale)
    return y


def _float64(adapters, x, y, row_owner):
    """y + scale * (bf16(x @ A^T) @ B^T) per row and target, in float64; and the bound's scale."""
    out, bound = y.double().clone(), y.double().abs().clone()
    for r, lora_id in enumerate(row_owner):
        for adapter in adapters:
            if adapter.lora_id != lora_id:
                continue
            for pair in adapter.layers[0]["qkv_proj"]:
                place = slice(SLICES[pair.target].start, SLICES[pair.target].end)
                u = (x[r].double() @ pair.a.weight.double().T).to(torch.bfloat16).double()
                b = pair.b.weight.double()
                out[r, place] += adapter.scale * (u @ b.T)
                bound[r, place] += adapter.scale * (u.abs() @ b.abs().T)
    return out, bound


ROWS = [0, 1, 3, 0, 2, 3, 3, 1, 0, 2, 1, 3, 2, 1, 1, 1, 1, 1, 3, 2]  # base rows, groups of 1 to 9


@pytest.mark.parametrize("isa", ISAS)
def test_each_isa_path_against_float64_and_the_stacked_products(factors, isa):
    stack, table = _stack(factors, isa)
    x, y = _randn(len(ROWS), IN, seed=1), _randn(len(ROWS), WIDTH, seed=2)
    got = _native(table, isa, x, y, ROWS)
    expected, bound = _float64(factors, x, y, ROWS)
    error = (got.double() - expected).abs()
    assert bool((error <= 2**-7 * bound + 1e-6).all()), float((error / bound).max())
    assert torch.equal(got, _stacked(stack, x, y, ROWS))  # the Python loop's bits
    base = torch.tensor(ROWS) == 0
    assert torch.equal(got[base], y[base])
    assert not torch.equal(got[~base], y[~base])


@pytest.mark.parametrize("isa", ISAS)
def test_each_row_is_itself_alone_at_any_thread_count(factors, isa):
    stack, table = _stack(factors, isa)  # the table reads into the stack: kept alive
    rows = ROWS * 3  # 60 rows: a group's shrink split over items, the products forked
    x, y = _randn(len(rows), IN, seed=3), _randn(len(rows), WIDTH, seed=4)
    together = _native(table, isa, x, y, rows)
    assert torch.equal(together, _native(table, isa, x, y, rows, threads=1))
    for r in range(0, len(rows), 7):
        alone = _native(table, isa, x[r : r + 1].clone(), y[r : r + 1].clone(), rows[r : r + 1])
        assert torch.equal(together[r], alone[0]), r


@pytest.mark.parametrize("isa", ISAS)
def test_a_long_group_split_among_threads_keeps_its_bits(factors, isa):
    """150 rows on one adapter (a prefill chunk): the group's rows split into items that each
    re-read the adapter's factors; the bits are those of one thread and of the stacked GEMMs."""
    stack, table = _stack(factors, isa)
    rows = [3] * 150
    x, y = _randn(len(rows), IN, seed=9), _randn(len(rows), WIDTH, seed=10)
    together = _native(table, isa, x, y, rows)
    assert torch.equal(together, _native(table, isa, x, y, rows, threads=1))
    assert torch.equal(together, _stacked(stack, x, y, rows))


def test_a_block_outside_its_target_is_refused_when_the_table_is_made(factors):
    stack = _module_stack(tuple(factors), 0, "qkv_proj", "portable", SLICES)
    k0, k1, b, start, end = stack.parts[0]
    odd = stack.blocks[0].copy()
    odd[0, 1] += 1  # an odd offset from the target's first rank
    table = native.LoraTable(1, 1)
    target = (b.packed.data_ptr(), k0, k1, start, end, odd.ctypes.data, len(odd))
    with pytest.raises(ValueError, match="layer 0 qkv_proj: a block outside its target's ranks"):
        table.set_module(0, "qkv_proj", stack.a.packed.data_ptr(), stack.a.out_features, [target])


def test_another_adapter_in_the_stack_changes_no_bits(factors):
    isa = ISAS[-1]
    kept, with_all = _stack(factors, isa)  # a table holds addresses: its stack stays alive
    kept_too, without_two = _stack([a for a in factors if a.lora_id != 2], isa)
    rows = [r for r in ROWS if r != 2]
    x, y = _randn(len(rows), IN, seed=5), _randn(len(rows), WIDTH, seed=6)
    assert torch.equal(_native(with_all, isa, x, y, rows), _native(without_two, isa, x, y, rows))
    assert [len(b) for b in kept.blocks] == [3, 2, 3] and [len(b) for b in kept_too.blocks] == [
        2,
        2,
        2,
    ]


def test_bad_arguments_are_refused_by_the_kernel(factors):
    stack, table = _stack(factors, "portable")
    x, y = _randn(2, IN, seed=7), _randn(2, WIDTH, seed=8)
    order, groups = rows_by_adapter(np.array([1, 3], dtype=np.int64))
    scale = torch.ones(2)
    u = torch.empty((2, table.max_rank), dtype=torch.bfloat16)
    args = (order.ctypes.data, groups.ctypes.data, len(groups), scale.data_ptr(), u.data_ptr())
    with pytest.raises(ValueError, match="qkv_proj: a row count, column count or row stride"):
        table.add(
            0,
            "qkv_proj",
            x.data_ptr(),
            IN,
            IN,
            y.data_ptr(),
            WIDTH,
            *args,
            table.max_rank - 1,
            0,
            1,
        )
    with pytest.raises(ValueError, match="qkv_proj: a row count, column count or row stride"):
        table.add(
            0,
            "qkv_proj",
            x.data_ptr(),
            IN,
            IN,
            y.data_ptr(),
            WIDTH - 1,
            *args,
            table.max_rank,
            0,
            1,
        )
    with pytest.raises(ValueError, match="layer 0 o_proj: no adapter adapts it"):
        table.add(
            0, "o_proj", x.data_ptr(), IN, IN, y.data_ptr(), WIDTH, *args, table.max_rank, 0, 1
        )


def test_vector_registers_only_in_their_paths():
    """zmm registers only in the AVX-512 paths' code, ymm only in AVX2 or AVX-512 code (setup.py
    builds each lora_rows path with its own flags; the loop nest keeps std:: templates out): so the
    decoder loop, the dispatcher and the portable path run on any x86-64 CPU."""
    if not vector_registers.objdump_available() or "avx2" not in native_gemm.ISAS:
        pytest.skip("objdump or an x86-64 build needed")
    owners = vector_registers.owners(native.__file__)
    vector_registers.assert_only_in_their_paths(owners)
    assert any("planserve_lr_avx2" in f for f in owners["ymm"]), "the AVX2 path's code not found"
    assert any("planserve_lr_avx512_bf16" in f for f in owners["zmm"])
    assert not any("planserve_lr_avx2" in f for f in owners["zmm"])
