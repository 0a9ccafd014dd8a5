"""Paged attention over a packed mixed batch (prefill chunks and decodes together).

Every layer does the same two things:

1. write this step's K/V rows into the layer's paged cache at `slot_mapping`
   (flat index = block_id * block_size + offset inside the block);
2. gather each sequence's whole context (cached prefix + this step's tokens) through its block
   table, padded to the longest context of the batch, and run ONE
   `scaled_dot_product_attention` call for the whole batch.

Index tables built once per step (shared by all layers), B sequences, T packed tokens,
Q = longest chunk, C = longest context:

    packed tokens   [ seq0 chunk | seq1 chunk | ... ]              T rows
    query_index     [B, Q]  packed row of query q of sequence b     (0 where padding)
    query_valid     [B, Q]  q < num_scheduled_tokens[b]
    kv_index        [B, C]  flat cache slot of context position c   (block_table[b, c // bs] * bs + c % bs)
    mask            [B, 1, Q, C]  c <= position of query q

A mixed step (decodes beside prompt chunks) is attended in two groups, decodes (Q = 1) and
chunks, each padded only to its own longest query and context: one padded call would give every
decode Q query rows (a 512-token chunk beside 16 decodes made 16 x 512 padded rows per layer).
Each group's rows go back to their packed positions.

The mask is causal inside the chunk and full over the cached prefix, because the position of query
q is `num_computed_tokens + q` and every cached position is below it. Padded context columns point
into block 0 (reserved, zero-filled) or past the context end and are masked out; padded query rows
see at least column 0, so softmax never gets an all-masked row (no NaN), and are dropped afterwards.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class AttentionGroup:
    """Index tensors of one group of sequences attended in one call."""

    query_index: torch.Tensor  # [B, Q] int64
    query_valid: torch.Tensor  # [B, Q] bool
    kv_index: torch.Tensor  # [B, C] int64
    mask: torch.Tensor  # [B, 1, Q, C] bool
    rows: torch.Tensor | None = None  # packed rows of the valid queries, when not all of them


@dataclasses.dataclass
class AttentionMetadata:
    """Per-step index tensors, on the model's device, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64, KV write slot of each packed token
    groups: list[AttentionGroup]


def build_attention_metadata(
    slot_mapping: torch.Tensor,
    query_start: torch.Tensor,
    num_scheduled_tokens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    max_query_len: int,
    max_context_len: int,
    host_num_scheduled=None,
    host_context_lens=None,
) -> AttentionMetadata:
    """Build the step's index tables on the device of the inputs.

    `query_start[b]` is the packed row of sequence b's first token, `context_lens[b]` its
    computed + scheduled tokens, `block_tables[b]` its block ids padded with 0 to at least
    ceil(max_context_len / block_size) columns. The host passes the two maxima so that no
    device-to-host sync is needed here; with the host copies of num_scheduled_tokens and
    context_lens (numpy), a step mixing decodes and chunks is split into two groups.
    """
    args = (query_start, num_scheduled_tokens, context_lens, block_tables, block_size)
    if host_num_scheduled is not None and 1 < int(host_num_scheduled.max()) and (host_num_scheduled == 1).any():
        decodes = host_num_scheduled == 1
        groups = []
        for members in (decodes.nonzero()[0], (~decodes).nonzero()[0]):
            index = torch.from_numpy(members).to(slot_mapping.device)
            group = _group(*(t[index] for t in args[:4]), block_size,
                           int(host_num_scheduled[members].max()), int(host_context_lens[members].max()))
            group.rows = group.query_index[group.query_valid]
            groups.append(group)
        return AttentionMetadata(slot_mapping=slot_mapping, groups=groups)
    return AttentionMetadata(slot_mapping=slot_mapping, groups=[_group(*args, max_query_len, max_context_len)])


def _group(query_start, num_scheduled_tokens, context_lens, block_tables, block_size: int,
           max_query_len: int, max_context_len: int) -> AttentionGroup:
    device = query_start.device
    q_off = torch.arange(max_query_len, device=device)
    query_valid = q_off[None, :] < num_scheduled_tokens[:, None]
    query_index = torch.where(query_valid, query_start[:, None] + q_off[None, :], 0)
    query_pos = (context_lens - num_scheduled_tokens)[:, None] + q_off[None, :]  # [B, Q]

    c = torch.arange(max_context_len, device=device)
    kv_index = block_tables[:, c // block_size] * block_size + (c % block_size)[None, :]
    mask = c[None, None, :] <= query_pos[:, :, None]
    return AttentionGroup(query_index=query_index, query_valid=query_valid, kv_index=kv_index, mask=mask[:, None, :, :])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D]; caches [num_blocks, block_size, KVH, D]. Returns [T, H * D]."""
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))

    if len(meta.groups) == 1:
        return _attend(q, k_flat, v_flat, meta.groups[0]).reshape(q.shape[0], -1)
    out = q.new_empty(q.shape[0], q.shape[1], head_dim)
    for group in meta.groups:
        out[group.rows] = _attend(q, k_flat, v_flat, group)
    return out.reshape(out.shape[0], -1)


def _attend(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """One group's attention; returns its valid queries' outputs [rows, H, D] in packed order."""
    num_kv_heads = k_flat.shape[-2]
    keys = k_flat[group.kv_index].transpose(1, 2)  # [B, KVH, C, D]
    values = v_flat[group.kv_index].transpose(1, 2)
    queries = q[group.query_index].transpose(1, 2)  # [B, H, Q, D]
    if queries.shape[2] == 1 and queries.dtype != torch.float32:
        out = decode_attention(queries, keys, values, group.mask)
    else:
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=group.mask, enable_gqa=queries.shape[1] != num_kv_heads
        )
    # Back to packed rows: boolean indexing walks (b, q) in row-major order, which is exactly the
    # packed order because each sequence's chunk is contiguous and sequences follow plan order.
    return out.transpose(1, 2)[group.query_valid]  # [rows, H, D]


def decode_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one query per sequence, as two batched matmuls with the softmax in float32.

    queries [B, H, 1, D], keys/values [B, KVH, C, D], mask [B, 1, 1, C]; returns [B, H, 1, D]. The
    H / KVH query heads of one KV head are stacked as rows (head h uses KV head h // (H / KVH), as
    SDPA's enable_gqa), so no KV head is repeated. Used for all-decode steps in reduced precision:
    CPU SDPA (flash kernel) took 15.8 ms at B=128, C=256 in bfloat16 against 2.6 ms here (4.3 vs
    5.3 ms in float32, which keeps SDPA).
    """
    b, h, _, d = queries.shape
    kvh, c = keys.shape[1], keys.shape[2]
    grouped = queries.reshape(b, kvh, h // kvh, d)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * d**-0.5  # [B, KVH, H/KVH, C]
    probs = scores.masked_fill(~mask.view(b, 1, 1, c), float("-inf")).softmax(-1)
    return torch.matmul(probs.to(values.dtype), values).reshape(b, h, 1, d)
