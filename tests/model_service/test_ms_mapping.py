"""cython_ext.mapping.StepInputBuilder against the numpy original it replaced in runner.py.

`numpy_step_inputs` is that original, kept verbatim as the oracle (STYLE.md item 12): every output
of the builder must equal it on every workload, golden shapes first, then random ones.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cython_ext.mapping import StepInputBuilder
from model_service.step.slot_table import SlotTable


def numpy_step_inputs(c: SlotTable, slots: np.ndarray, n: np.ndarray, bs: int) -> dict:
    """runner.py's _execute input building before the Cython builder (the oracle)."""
    computed = c.num_computed[slots]
    total = int(n.sum())
    query_start = np.concatenate(([0], np.cumsum(n)[:-1]))
    row_slot = np.repeat(slots, n)
    positions = np.repeat(computed - query_start, n) + np.arange(total)
    input_ids = c.tokens[row_slot, positions]
    slot_mapping = c.block_table[row_slot, positions // bs].astype(np.int64) * bs + positions % bs
    context_lens = computed + n
    max_context = int(context_lens.max())
    block_tables = c.block_table[slots, : -(-max_context // bs)]
    needs_sample = context_lens == c.num_tokens[slots]
    logits_indices = (query_start + n - 1)[needs_sample]
    return dict(
        positions=positions, input_ids=input_ids, slot_mapping=slot_mapping, query_start=query_start,
        context_lens=context_lens, needs_sample=needs_sample, logits_indices=logits_indices,
        sample_slots=slots[needs_sample], block_tables=block_tables,
        num_tokens=total, max_query_len=int(n.max()), max_context_len=max_context,
    )


@dataclasses.dataclass
class Workload:
    slot_table: SlotTable
    slots: np.ndarray
    num_scheduled: np.ndarray
    block_size: int


def make_workload(specs, *, max_num_slots=16, max_model_len=256, block_size=16, seed=0) -> Workload:
    """specs: (slot, num_tokens, num_computed, num_scheduled) per scheduled slot, in schedule order.

    Every block-table entry is a random id (also past the blocks a slot needs), so a gather that
    reads the wrong column or row shows up."""
    rng = np.random.default_rng(seed)
    cache = SlotTable(max_num_slots, max_model_len, block_size)
    cache.tokens[:] = rng.integers(0, 2**31 - 1, size=cache.tokens.shape, dtype=np.int32)
    cache.block_table[:] = rng.integers(1, 2**31 - 1, size=cache.block_table.shape, dtype=np.int32)
    for slot, num_tokens, num_computed, _ in specs:
        assert 0 <= num_computed < num_tokens <= max_model_len
        cache.num_tokens[slot], cache.num_computed[slot] = num_tokens, num_computed
        cache.num_blocks[slot] = -(-num_tokens // block_size)
        cache.active[slot] = True
    slots = np.array([s[0] for s in specs], dtype=np.int64)
    n = np.array([s[3] for s in specs], dtype=np.int64)
    return Workload(cache, slots, n, block_size)


def build(builder: StepInputBuilder, w: Workload):
    c = w.slot_table
    return builder.build(c.tokens, c.block_table, c.num_computed, c.num_tokens, w.slots, w.num_scheduled)


def new_builder(w: Workload, max_num_tokens: int = 4096) -> StepInputBuilder:
    return StepInputBuilder(max_num_tokens, w.slot_table.max_num_slots, w.slot_table.max_blocks_per_seq, w.block_size)


def assert_parity(builder: StepInputBuilder, w: Workload):
    got = build(builder, w)
    want = numpy_step_inputs(w.slot_table, w.slots, w.num_scheduled, w.block_size)
    for name, expected in want.items():
        value = getattr(got, name)
        if isinstance(expected, np.ndarray):
            assert value.dtype == np.int64, name
            assert value.shape == expected.shape, name
            np.testing.assert_array_equal(value, expected.astype(np.int64), err_msg=name)
        else:
            assert value == expected, name
    assert got.block_tables.flags.c_contiguous
    return got


# -- golden workloads ---------------------------------------------------------------------------


def test_only_prefill():
    # Whole prompts, one after a prefix hit (computed 32 of 40), one of a single token.
    w = make_workload([(3, 100, 0, 100), (0, 40, 32, 8), (7, 1, 0, 1), (1, 17, 0, 17)])
    got = assert_parity(new_builder(w), w)
    assert got.needs_sample.tolist() == [1, 1, 1, 1]
    assert got.query_start.tolist() == [0, 100, 108, 109]
    assert got.logits_indices.tolist() == [99, 107, 108, 125]


def test_only_decode():
    rng = np.random.default_rng(1)
    lens = rng.integers(2, 256, size=256)
    w = make_workload([(s, int(k), int(k) - 1, 1) for s, k in zip(rng.permutation(256), lens)], max_num_slots=256)
    got = assert_parity(new_builder(w), w)
    assert got.num_tokens == 256 and got.max_query_len == 1
    np.testing.assert_array_equal(got.logits_indices, np.arange(256))


def test_mixed_with_chunked_prefill():
    # Decodes, a first chunk, a middle chunk (neither samples), a last chunk (samples).
    specs = [(0, 50, 49, 1), (5, 300, 0, 64), (2, 300, 128, 64), (9, 130, 96, 34), (4, 9, 8, 1)]
    w = make_workload(specs, max_model_len=512)
    got = assert_parity(new_builder(w), w)
    assert got.needs_sample.tolist() == [1, 0, 0, 1, 1]
    assert got.sample_slots.tolist() == [0, 9, 4]


def test_near_max_model_len_and_many_blocks():
    # max_model_len 512 = 32 blocks: a slot ending exactly at 512, one at 511, a last chunk that
    # fills the final block, and a decode at position 0 of a fresh block.
    specs = [(0, 512, 511, 1), (1, 511, 0, 511), (2, 512, 400, 112), (3, 257, 256, 1)]
    w = make_workload(specs, max_num_slots=4, max_model_len=512)
    got = assert_parity(new_builder(w), w)
    assert got.block_tables.shape == (4, 32)
    assert got.max_context_len == 512


@pytest.mark.parametrize("block_size", [1, 3, 7, 16, 32])
def test_block_sizes_that_do_not_divide_anything(block_size):
    specs = [(0, 100, 37, 50), (1, 100, 99, 1), (2, 64, 0, 64), (3, 5, 4, 1)]
    w = make_workload(specs, max_num_slots=4, max_model_len=128, block_size=block_size)
    assert_parity(new_builder(w), w)


def test_empty_step():
    w = make_workload([])
    got = build(new_builder(w), w)
    assert got.num_tokens == 0 and got.max_query_len == 0 and got.max_context_len == 0
    assert got.positions.shape == (0,) and got.logits_indices.shape == (0,) and got.block_tables.shape == (0, 0)


# -- buffers ------------------------------------------------------------------------------------


def test_steps_reuse_the_same_buffers():
    w = make_workload([(0, 50, 49, 1), (1, 30, 0, 30)])
    builder = new_builder(w)
    first, second = build(builder, w), build(builder, w)
    for name in ("positions", "input_ids", "slot_mapping", "query_start", "block_tables", "logits_indices"):
        assert np.shares_memory(getattr(first, name), getattr(second, name)), name


def test_grows_when_a_step_packs_more_rows_than_capacity():
    small = make_workload([(0, 4, 0, 4)], seed=1)
    big = make_workload([(0, 200, 0, 200), (1, 90, 10, 80)], seed=2)
    builder = new_builder(small, max_num_tokens=8)
    old = assert_parity(builder, small)
    old_positions = old.positions.copy()
    assert_parity(builder, big)
    assert builder.max_num_tokens >= 280
    np.testing.assert_array_equal(old.positions, old_positions)  # the old view still reads its buffer
    assert_parity(builder, small)


def test_builder_is_reused_across_workloads():
    builder = StepInputBuilder(64, 16, 16, 16)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        slots = rng.choice(16, size=int(rng.integers(1, 16)), replace=False)
        specs = []
        for s in slots:
            k = int(rng.integers(1, 257))
            c = int(rng.integers(0, k))
            specs.append((int(s), k, c, int(rng.integers(1, k - c + 1))))
        assert_parity(builder, make_workload(specs, seed=seed))


# -- bad input: an error, never a read outside the arrays -----------------------------------------


@pytest.mark.parametrize(
    "specs_override, match",
    [
        (dict(slots=[0, 16]), "slots\\[1\\] = 16 is outside"),
        (dict(slots=[0, -1]), "slots\\[1\\] = -1 is outside"),
        (dict(num_scheduled=[1, 0]), "num_scheduled\\[1\\] = 0"),
        (dict(num_scheduled=[1, 300]), "outside the 257 token columns"),
        (dict(num_scheduled=[1, 2**62]), "outside the 257 token columns"),
        (dict(num_scheduled=[1, 257]), "block columns"),
    ],
)
def test_out_of_bounds_rows_raise(specs_override, match):
    w = make_workload([(0, 50, 49, 1), (1, 30, 0, 30)])
    for name, values in specs_override.items():
        setattr(w, name, np.array(values, dtype=np.int64))
    with pytest.raises(ValueError, match=match):
        build(new_builder(w), w)


def test_negative_computed_raises():
    w = make_workload([(0, 50, 49, 1)])
    w.slot_table.num_computed[0] = -1
    with pytest.raises(ValueError, match="computed -1"):
        build(new_builder(w), w)


def test_shape_mismatches_raise():
    w = make_workload([(0, 50, 49, 1), (1, 30, 0, 30)])
    c = w.slot_table
    builder = new_builder(w)
    with pytest.raises(ValueError, match="num_scheduled has length 1"):
        builder.build(c.tokens, c.block_table, c.num_computed, c.num_tokens, w.slots, w.num_scheduled[:1])
    with pytest.raises(ValueError, match="tokens has 16 slots"):
        builder.build(c.tokens, c.block_table[:8], c.num_computed, c.num_tokens, w.slots, w.num_scheduled)
    with pytest.raises(ValueError, match="max_num_seqs 1"):
        StepInputBuilder(64, 1, 16, 16).build(c.tokens, c.block_table, c.num_computed, c.num_tokens, w.slots, w.num_scheduled)
    with pytest.raises(ValueError, match="max_blocks_per_seq 4"):
        StepInputBuilder(64, 16, 4, 16).build(c.tokens, c.block_table, c.num_computed, c.num_tokens, w.slots, w.num_scheduled)
    with pytest.raises(ValueError):  # not C-contiguous
        builder.build(c.tokens, c.block_table, c.num_computed, c.num_tokens, np.array([0, 9, 1])[::2], w.num_scheduled)
    with pytest.raises(ValueError):  # wrong dtype
        builder.build(c.tokens.astype(np.int64), c.block_table, c.num_computed, c.num_tokens, w.slots, w.num_scheduled)
    with pytest.raises(ValueError, match="must be >= 1"):
        StepInputBuilder(0, 16, 16, 16)


# -- random workloads ---------------------------------------------------------------------------


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 5, 16]))
    max_model_len = draw(st.integers(1, 96))
    max_num_slots = draw(st.integers(1, 8))
    slots = draw(st.lists(st.integers(0, max_num_slots - 1), unique=True, max_size=max_num_slots))
    specs = []
    for slot in slots:
        num_tokens = draw(st.integers(1, max_model_len))
        computed = draw(st.integers(0, num_tokens - 1))
        scheduled = draw(st.integers(1, num_tokens - computed))
        specs.append((slot, num_tokens, computed, scheduled))
    seed = draw(st.integers(0, 2**16))
    return make_workload(specs, max_num_slots=max_num_slots, max_model_len=max_model_len, block_size=block_size, seed=seed)


@settings(max_examples=300, deadline=None)
@given(w=workloads(), capacity=st.integers(1, 64))
def test_random_workloads_match_numpy(w, capacity):
    builder = new_builder(w, max_num_tokens=capacity)
    if w.slots.size == 0:
        assert build(builder, w).num_tokens == 0
    else:
        assert_parity(builder, w)
        assert_parity(builder, w)  # the second step over the same buffers
