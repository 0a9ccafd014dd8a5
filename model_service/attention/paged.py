"""Paged attention over a packed mixed batch (prompt chunks and decodes together).

One call per layer does two things:

1. write this step's K/V rows into the layer's paged cache at `slot_mapping`
   (slot = block_id * block_size + offset inside the block);
2. attend every query row in place through its sequence's block table: no context is gathered,
   padded or copied. Decode rows and prompt-chunk rows go through the same kernel.

Layouts (B sequences, T packed query rows, H query heads, KVH KV heads, D head dim, G = H / KVH):

    q, out        [T, H, D]          rows of seq b: query_start[b] .. + num_scheduled[b]
    k, v          [T, KVH, D]        this step's K/V rows
    k/v cache     [NB, KVH, BS, D]   one layer; block 0 is reserved (never in a live table)
    block_tables  [B, MB]  int64     block ids of seq b's context; column c covers positions
                                     c * BS .. c * BS + BS - 1
    context_lens  [B]      int64     cached prefix + num_scheduled[b]

    query row r of seq b:  position p = context_lens[b] - num_scheduled[b] + r
                           attends positions 0 .. p (causal inside its chunk, the whole prefix)

    cache[block_tables[b, c], h, i, :]  =  K/V of position c * BS + i of seq b, KV head h
    query heads h * G .. h * G + G - 1 share KV head h and are computed together.

On the CPU the kernel is native (cython_ext/paged_attention.pyx over cython_ext/csrc/): online
softmax with float32 accumulation, the context cut into KV splits at fixed positions
(KV_SPLIT_POSITIONS) folded in order, work spread over (sequence, KV head, row tile, split). A row's
result depends only on its own query, context and position: never on the other rows of the call,
on padding, or on whether it is a decode or inside a chunk (batch invariance by construction).
The ISA path is the fastest the CPU runs, or the one the config's attention_isa names (portable,
avx2, avx512, avx512_bf16; `torch` runs the plain-torch path below instead, for A/B checks). On
CUDA the kernel is a Triton one (model_service/attention/cuda_attention.py), same semantics and
invariance; attention_isa "torch" runs the torch path there too. Other devices, and CUDA
without Triton or with a block size the kernel does not take, use `_torch_attention` (gather +
SDPA).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from cython_ext import paged_attention as native
from model_service.attention import cuda_attention
from model_service.kernels import kernel_isa

# KV split length in positions: fixed, never chosen from the batch's shape (see the docstring).
# 256 gives a batch-1 decode at context ~300 six items (2 splits x 3 KV heads) for two cores.
KV_SPLIT_POSITIONS = 256
TORCH_PATH = kernel_isa.TORCH_PATH  # the gather + SDPA path, selectable on the CPU for comparisons
_DTYPES = {
    torch.float32: native.DTYPES.index("float32"),
    torch.bfloat16: native.DTYPES.index("bfloat16"),
}


# The config's attention_isa, selected at start.
PATH = kernel_isa.PathChoice(native, "attention_isa")
resolve_isa = PATH.resolve


def cuda_path(k_cache: torch.Tensor) -> str:
    """The attention path a model with this (5-D, all layers') cache runs off the CPU, for
    Describe's `compute`: "triton", or "torch (why)"."""
    probe = torch.empty(1, 1, k_cache.shape[-1], dtype=k_cache.dtype, device=k_cache.device)
    reason = _triton_unsupported(probe, k_cache[0], PATH.current)
    return "triton" if reason is None else f"torch ({reason})"


def _triton_unsupported(q: torch.Tensor, k_cache: torch.Tensor, isa: str) -> str | None:
    """Why a CUDA call runs the torch path instead of the Triton kernel; None where it runs the
    kernel. The one decider, for the calls and for Describe."""
    if isa == TORCH_PATH:
        return "attention_isa=torch"
    return cuda_attention.unsupported_reason(q, k_cache)


def split_positions(block_size: int) -> int:
    """KV_SPLIT_POSITIONS rounded up to whole blocks."""
    return -(-KV_SPLIT_POSITIONS // block_size) * block_size


@dataclasses.dataclass
class AttentionMetadata:
    """Per-step indices, shared by every layer (layouts in the module docstring)."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start: torch.Tensor  # [B] int64
    num_scheduled: torch.Tensor  # [B] int64
    context_lens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, MB] int64
    block_size: int
    max_query_len: int
    max_context_len: int
    native_step: native.AttentionStep | None = None  # CPU: the kernel's view of the indices
    num_threads: int = 1
    tiles: torch.Tensor | None = None  # CUDA: the Triton kernel's tile map [2, N] int64


def build_attention_metadata(
    slot_mapping: torch.Tensor,
    query_start: torch.Tensor,
    num_scheduled_tokens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    max_query_len: int,
    max_context_len: int,
    tiles: torch.Tensor | None = None,
) -> AttentionMetadata:
    """The step's indices on the device of the inputs.

    `query_start[b]` is the packed row of sequence b's first token, `context_lens[b]` its
    computed + scheduled tokens, `block_tables[b]` its block ids (padding beyond its context is
    never read). The two maxima come from the host, so no device-to-host sync is needed; so does
    the CUDA kernel's tile map (`tiles`, cuda_attention.attention_tiles: without it the kernel's
    call builds one from num_scheduled, which waits for the device).
    """
    meta = AttentionMetadata(
        slot_mapping,
        query_start,
        num_scheduled_tokens,
        context_lens,
        block_tables,
        block_size,
        max_query_len,
        max_context_len,
        tiles=tiles,
    )
    if slot_mapping.device.type == "cpu":
        meta.native_step = native.AttentionStep(
            slot_mapping.numpy(),
            query_start.numpy(),
            num_scheduled_tokens.numpy(),
            context_lens.numpy(),
            block_tables.numpy(),
        )
        meta.num_threads = torch.get_num_threads()
    return meta


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    isa: str | None = None,
    sliding_window: int | None = None,
    kv_written: bool = False,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D]; caches [NB, KVH, BS, D]. Writes k/v into the caches at
    meta.slot_mapping (unless kv_written: the caller's kernel did, layer_ops.rope_and_cache_kv_
    on CUDA; the CPU's native kernel writes them anyway) and returns the attention output
    [T, H * D] in q's dtype. `isa` forces a CPU path (tests); None runs the selected one (PATH).
    With a sliding_window W, the row at position p attends positions p - W + 1 .. p only, on the
    torch path (the native kernel attends whole prefixes; a window inside it is not written yet).
    float16 runs the torch path too (the native kernel is float32 and bfloat16)."""
    isa = isa or PATH.current
    if q.is_cuda and _triton_unsupported(q, k_cache, isa) is None:
        return _cuda_attention(q, k, v, k_cache, v_cache, meta, sliding_window, not kv_written)
    if (
        meta.native_step is None
        or isa == TORCH_PATH
        or sliding_window is not None
        or q.dtype == torch.float16
    ):
        return _torch_attention(q, k, v, k_cache, v_cache, meta, sliding_window, not kv_written)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    dtype = _native_dtype(q, k_cache, v_cache)
    # Rows may lie apart (views of a fused QKV output); within a row, heads and dims are dense.
    q, k, v = (_dense_rows(t.to(q.dtype)) for t in (q, k, v))
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    meta.native_step.run(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_blocks=num_blocks,
        split_positions=split_positions(block_size),
        scale=head_dim**-0.5,
        dtype=dtype,
        isa=native.ISAS.index(isa),
        num_threads=meta.num_threads,
        q_row_stride=q.stride(0),
        k_new_row_stride=k.stride(0),
        v_new_row_stride=v.stride(0),
    )
    return out.view(num_tokens, num_heads * head_dim)


def _native_dtype(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The kernel's dtype index for q and the caches (float32 or bfloat16, all alike; contiguous
    caches), or ValueError naming what is wrong."""
    dtype = _DTYPES.get(q.dtype)
    if dtype is None or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"paged_attention: q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype}; float32 or "
            "bfloat16, all alike"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(
            "paged_attention: the KV caches must be contiguous [num_blocks, kv_heads, block_size, "
            "head_dim]"
        )
    return dtype


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with each row's heads and dims dense (a copy only when they are not)."""
    heads, dim = x.shape[1:]
    if x.stride(2) == 1 and (x.stride(1) == dim or heads == 1) and x.stride(0) >= heads * dim:
        return x
    return x.contiguous()


def _cuda_attention(
    q, k, v, k_cache, v_cache, meta: AttentionMetadata, sliding_window, write_kv: bool = True
):
    """The Triton kernel's call (model_service/attention/cuda_attention.py), after the cache
    write (unless write_kv is False: written already)."""
    if write_kv:
        _write_kv(k, v, k_cache, v_cache, meta)
    if meta.tiles is None:  # callers outside the runner's step (tests, benches): one sync
        rows = cuda_attention.rows_per_tile(q.shape[1] // k_cache.shape[1])
        _, host = cuda_attention.attention_tiles(meta.num_scheduled.cpu().numpy(), rows)
        meta.tiles = torch.from_numpy(host).to(q.device)  # the step's other layers reuse it
    tiles = meta.tiles
    out = cuda_attention.paged_attention(
        q,
        k_cache,
        v_cache,
        meta.query_start,
        meta.num_scheduled,
        meta.context_lens,
        meta.block_tables,
        tiles,
        sliding_window,
    )
    return out.view(q.shape[0], -1)


def _write_kv(k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
    """This step's K/V rows into the caches at meta.slot_mapping (torch ops, any device)."""
    block_size = k_cache.shape[2]
    blocks, offsets = meta.slot_mapping // block_size, meta.slot_mapping % block_size
    k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)


def _torch_attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    sliding_window: int | None = None,
    write_kv: bool = True,
) -> torch.Tensor:
    """Gather + SDPA in plain torch, where neither the CPU kernel nor the Triton one runs (and for
    A/B checks). Same layouts and semantics as the CPU kernel; write_kv False: the caches hold
    this step's K/V already."""
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    if write_kv:
        _write_kv(k, v, k_cache, v_cache, meta)
    width = -(-meta.max_context_len // block_size)
    tables = meta.block_tables[:, :width]
    b = tables.shape[0]
    # [B, MB, KVH, BS, D] -> [B, KVH, MB * BS, D]
    keys = (
        k_cache[tables]
        .permute(0, 2, 1, 3, 4)
        .reshape(b, num_kv_heads, width * block_size, head_dim)
    )
    values = (
        v_cache[tables]
        .permute(0, 2, 1, 3, 4)
        .reshape(b, num_kv_heads, width * block_size, head_dim)
    )
    q_off = torch.arange(meta.max_query_len, device=q.device)
    valid = q_off[None, :] < meta.num_scheduled[:, None]
    rows = torch.where(valid, meta.query_start[:, None] + q_off[None, :], 0)
    positions = (meta.context_lens - meta.num_scheduled)[:, None] + q_off[None, :]
    key_positions = torch.arange(width * block_size, device=q.device)[None, None, :]
    mask = key_positions <= positions[:, :, None]
    if sliding_window is not None:
        mask &= key_positions > positions[:, :, None] - sliding_window
    queries = q[rows].transpose(1, 2)
    if q.device.type == "cpu":
        # torch's CPU SDPA with a mask rounds bf16 scores before the softmax; the native kernel
        # accumulates in float32, and so does this path on the CPU (measured: bf16 logprobs of a
        # windowed Mistral 2.6x farther from float32 than transformers' bf16 without it).
        queries, keys, values = queries.float(), keys.float(), values.float()
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask[:, None], enable_gqa=q.shape[1] != num_kv_heads
    )
    result = q.new_empty(q.shape)
    result[rows[valid]] = out.transpose(1, 2)[valid].to(q.dtype)
    return result.reshape(q.shape[0], -1)
