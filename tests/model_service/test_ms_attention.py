"""Paged attention of a mixed step: split into a decode group and a chunk group (each padded to
its own longest query and context) it gives the same outputs as one padded call, in float32 and,
through the batched-matmul decode path, in bfloat16."""
import numpy as np
import pytest
import torch

from model_service.attention import build_attention_metadata, paged_attention

BS, H, KVH, D = 4, 6, 2, 8


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_split_groups_equal_one_padded_call(dtype, tolerance):
    gen = torch.Generator().manual_seed(0)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, BS, KVH, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BS, KVH, D, generator=gen).to(dtype)
    k_cache[0] = v_cache[0] = 0  # block 0 is reserved
    # Three decodes and two chunks, interleaved in plan order.
    num_scheduled = np.array([1, 7, 1, 5, 1])
    computed = np.array([13, 0, 29, 6, 2])
    context = computed + num_scheduled
    query_start = np.concatenate(([0], np.cumsum(num_scheduled)[:-1]))
    blocks_per_seq = -(-context // BS)
    tables = np.zeros((5, blocks_per_seq.max()), dtype=np.int64)
    next_block = 1
    for b, count in enumerate(blocks_per_seq):
        tables[b, :count] = np.arange(next_block, next_block + count)
        next_block += count
    rows = [(b, p) for b in range(5) for p in range(computed[b], context[b])]
    slot_mapping = np.array([tables[b, p // BS] * BS + p % BS for b, p in rows])
    T = len(rows)
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    k = torch.randn(T, KVH, D, generator=gen).to(dtype)
    v = torch.randn(T, KVH, D, generator=gen).to(dtype)

    def run(split: bool):
        meta = build_attention_metadata(
            torch.from_numpy(slot_mapping), torch.from_numpy(query_start), torch.from_numpy(num_scheduled),
            torch.from_numpy(context), torch.from_numpy(tables), BS, int(num_scheduled.max()), int(context.max()),
            host_num_scheduled=num_scheduled if split else None, host_context_lens=context if split else None)
        assert len(meta.groups) == (2 if split else 1)
        return paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta).float()

    torch.testing.assert_close(run(True), run(False), atol=tolerance, rtol=tolerance)
