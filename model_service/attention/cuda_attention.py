"""Paged attention on CUDA: one Triton kernel that reads the paged KV cache in place.

The same call and semantics as the CPU kernel (layouts in model_service/attention/paged.py): a
packed mixed batch of decodes and prompt chunks, each query row attending its sequence's positions
0 .. p through the block table, with no gather, padding or copy of the context. Sliding windows
are read by the same kernel (the first block it reads is the window's).

One program per (tile of ROWS query rows of one sequence, KV head). A tile carries its rows' G
query heads together (G = heads / KV heads), so one load of a KV block serves every head that
shares it, and walks the blocks in position order with an online softmax in float32.

The tiles come as a map built on the host (`attention_tiles`: each tile's sequence and first row),
so the grid is the step's tile count, not sequences x the longest chunk's tiles: a step of 255
decodes and one 512-row chunk launches ~384 tiles per KV head, not 256 x 128. A CUDA graph pads
the map to its bucket's capacity (`max_tiles`) with tiles whose first row lies past any sequence
(PAD_ROW): they return at once, so one captured launch serves every step of its bucket.

Why Triton rather than FlashInfer or FlashAttention's paged kernels (which the issue named): both
ship binaries built for one torch and CUDA pair, and FlashInfer compiles its kernels on first use;
Triton comes with torch's CUDA wheels, so the kernel runs wherever planserve's torch does. It is
what vLLM's own Triton attention backend does too.

Batch invariance, as on the CPU: every call runs one compiled kernel (ROWS depends only on the
model's head grouping, never on the batch), and a row's arithmetic (its dot products, the order of
the blocks) depends only on its own query, context and position, not on the tile's other rows.

Precision: q.k runs on the tensor cores in bf16 (exact products, float32 sums) or in IEEE float32
for float32 models (never TF32: the parity tests compare float32 with transformers). P.V keeps P
near float32, as the CPU kernel does: FlashAttention rounds P to bf16 there, which on the CPU
kernel's test batch put 4.5% of outputs beyond its bound (docs/design-notes.md). In a 16-bit model
P is split into a high and a low half of V's type, two tensor-core dots whose sum keeps P to about
2^-17 (PV_SPLIT); a float32 model's P.V is one IEEE float32 dot, off the tensor cores. A walk step
reads KV_TILE_KEYS keys (several blocks) at once.

The walk is a counted loop (tl.range), which Triton software-pipelines: the K and V of the next
steps are copied to shared memory asynchronously (cp.async) while the current step computes. A
while loop, as the walk was, is not pipelined: each step waited for its own loads. The
arithmetic of a row is the same either way (the same steps in the same order).
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's CPU wheel does not bring Triton
    triton = None

# The fewest rows a tensor-core dot takes (M and N of tl.dot): a tile's rows x heads, and a block.
MIN_DOT = 16
# Keys one step of a tile's walk reads (whole blocks: block_size 16 reads 4): fewer, larger dots
# than one block a step. Fixed, never from the batch, so a row's arithmetic stays its own.
KV_TILE_KEYS = 64
# bf16/fp16 models: P.V as two 16-bit tensor-core dots (P split in high and low halves) instead
# of one IEEE float32 dot off the tensor cores. Module-level so a bench can time both.
PV_SPLIT = True
# The walk's software pipeline (module docstring): the walk steps whose loads are in flight at
# once, Triton's default depth on CUDA; 1 runs it unpipelined, as a bench times it beside.
WALK_STAGES = 3
# A padding tile's first row: beyond any sequence's rows, so its program returns at once.
PAD_ROW = 1 << 30


def unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why the kernel cannot run this call (the caller then runs the torch path), or None."""
    if triton is None:
        return "triton is not installed"
    if q.device.type != "cuda":
        return f"device {q.device.type}"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {q.dtype}"
    block_size = k_cache.shape[2]
    if block_size < MIN_DOT or block_size & (block_size - 1):
        return f"block_size {block_size} (a power of two >= {MIN_DOT} is needed)"
    return None


def rows_per_tile(group: int) -> int:
    """Query rows per program: enough that rows x (G rounded up to a power of two) fill a dot."""
    return max(1, MIN_DOT // _next_power_of_2(group))


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def max_tiles(num_tokens: int, num_seqs: int, rows: int) -> int:
    """The most tiles a step of num_tokens rows over num_seqs sequences can need: each sequence's
    last tile may be partial."""
    return -(-num_tokens // rows) + num_seqs


def attention_tiles(num_scheduled: np.ndarray, rows: int, out: np.ndarray | None = None):
    """The tile map [2, N] int64 of a step (row 0: each tile's sequence, row 1: its first query
    row), tiles of `rows` rows in sequence order. With `out` ([2, capacity]), written into it and
    the rest padded (sequence 0, PAD_ROW); returns the number of live tiles and the map."""
    per_seq = -(-num_scheduled // rows)
    count = int(per_seq.sum())
    first = np.cumsum(per_seq) - per_seq
    if out is None:
        out = np.empty((2, count), dtype=np.int64)
    out[0, :count] = np.repeat(np.arange(num_scheduled.size), per_seq)
    out[1, :count] = (np.arange(count) - np.repeat(first, per_seq)) * rows
    out[0, count:] = 0
    out[1, count:] = PAD_ROW
    return count, out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    num_scheduled: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    tiles: torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor:
    """q [T, H, D] (rows may lie apart; within a row, dense); caches [NB, KVH, BS, D] contiguous,
    already holding this step's K/V; tiles [2, N] the step's tile map (attention_tiles, with the
    rows_per_tile of this head grouping). Returns [T, H, D] in q's dtype; rows of no sequence (a
    graph's padding) are left unwritten."""
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    grid = (tiles.shape[1], num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        query_start, num_scheduled, context_lens, block_tables, tiles[0], tiles[1],
        q.stride(0), block_tables.stride(0),
        head_dim**-0.5, sliding_window or 0,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=_next_power_of_2(group),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(MIN_DOT, _next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, ROWS=rows_per_tile(group),
        KV_BLOCKS=max(1, KV_TILE_KEYS // block_size), USE_WINDOW=sliding_window is not None,
        QK_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PV_SPLIT=PV_SPLIT and q.dtype != torch.float32, WALK_STAGES=WALK_STAGES,
    )  # fmt: skip
    return out


# Defined only where Triton is (a CPU-only install imports this module for unsupported_reason).
if triton is not None:

    @triton.jit
    def _attend_blocks(
        q, position, k_cache_ptr, v_cache_ptr, table_row_ptr, end_block, g, kv_head, scale,
        window, max_score, denominator, acc,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, KV_BLOCKS: tl.constexpr, USE_WINDOW: tl.constexpr,
        QK_PRECISION: tl.constexpr, PV_SPLIT: tl.constexpr,
    ):  # fmt: skip
        """KV_BLOCKS blocks (table columns g * KV_BLOCKS ..) folded into the tile's online
        softmax; columns past end_block read block 0 and are masked off by position."""
        key = tl.arange(0, KV_BLOCKS * BLOCK_SIZE)
        column = g * KV_BLOCKS + key // BLOCK_SIZE
        block = tl.load(table_row_ptr + column, mask=column < end_block, other=0).to(tl.int64)
        kv_rows = (block * NUM_KV_HEADS + kv_head) * BLOCK_SIZE + key % BLOCK_SIZE
        d = tl.arange(0, HEAD_DIM_PAD)
        d_live = d < HEAD_DIM
        kv_offsets = kv_rows[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=d_live[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=d_live[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * scale
        key_position = g * KV_BLOCKS * BLOCK_SIZE + tl.arange(0, KV_BLOCKS * BLOCK_SIZE)
        allowed = key_position[None, :] <= position[:, None]
        if USE_WINDOW:
            allowed = allowed & (key_position[None, :] > position[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(max_score, tl.max(scores, 1))
        # A row with nothing allowed yet keeps max -inf: shift by 0 so exp gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(max_score - shift)
        p = tl.exp(scores - shift[:, None])
        denominator = denominator * rescale + tl.sum(p, 1)
        if PV_SPLIT:
            # P in two halves of V's 16-bit type, each exact on the tensor cores: P's float32
            # value to ~2^-17, not the one rounding to bf16 FlashAttention makes (module doc).
            p_high = p.to(v.dtype)
            p_low = (p - p_high.to(tl.float32)).to(v.dtype)
            pv = tl.dot(p_high, v) + tl.dot(p_low, v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * rescale[:, None] + pv
        return new_max, denominator, acc

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        query_start_ptr, num_scheduled_ptr, context_lens_ptr, block_tables_ptr,
        tile_seq_ptr, tile_row_ptr, q_row_stride, table_stride, scale, window,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        ROWS: tl.constexpr, KV_BLOCKS: tl.constexpr, USE_WINDOW: tl.constexpr,
        QK_PRECISION: tl.constexpr, PV_SPLIT: tl.constexpr, WALK_STAGES: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile)
        first_row = tl.load(tile_row_ptr + tile)
        num_rows = tl.load(num_scheduled_ptr + seq)
        if first_row >= num_rows:
            return
        row_start = tl.load(query_start_ptr + seq)
        context = tl.load(context_lens_ptr + seq)

        # Tile element m: query row first_row + m // GROUP_PAD, query head kv_head * G + m % GP.
        m = tl.arange(0, ROWS * GROUP_PAD)
        row = first_row + m // GROUP_PAD
        head = kv_head * GROUP + m % GROUP_PAD
        live = (row < num_rows) & (m % GROUP_PAD < GROUP)
        position = context - num_rows + row
        d = tl.arange(0, HEAD_DIM_PAD)
        live_2d = live[:, None] & (d < HEAD_DIM)[None, :]
        q_rows = (row_start + row).to(tl.int64)
        q_offsets = q_rows[:, None] * q_row_stride + head[:, None] * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=live_2d, other=0.0)

        max_score = tl.full([ROWS * GROUP_PAD], float("-inf"), tl.float32)
        denominator = tl.zeros([ROWS * GROUP_PAD], tl.float32)
        acc = tl.zeros([ROWS * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        c = 0
        if USE_WINDOW:
            c = tl.maximum(context - num_rows + first_row - window + 1, 0) // BLOCK_SIZE
        end_block = (
            context - num_rows + tl.minimum(first_row + ROWS, num_rows) - 1
        ) // BLOCK_SIZE + 1
        table_row_ptr = block_tables_ptr + seq * table_stride
        end_step = (end_block + KV_BLOCKS - 1) // KV_BLOCKS
        for g in tl.range(c // KV_BLOCKS, end_step, num_stages=WALK_STAGES):
            max_score, denominator, acc = _attend_blocks(
                q, position, k_cache_ptr, v_cache_ptr, table_row_ptr, end_block, g, kv_head,
                scale, window, max_score, denominator, acc, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM_PAD,
                BLOCK_SIZE, KV_BLOCKS, USE_WINDOW, QK_PRECISION, PV_SPLIT,
            )  # fmt: skip

        result = acc / tl.where(denominator == 0.0, 1.0, denominator)[:, None]
        out_offsets = q_rows[:, None] * (NUM_KV_HEADS * GROUP * HEAD_DIM)
        out_offsets += head[:, None] * HEAD_DIM + d[None, :]
        tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=live_2d)
