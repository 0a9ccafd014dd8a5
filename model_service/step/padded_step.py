"""A step's inputs padded to a token bucket, in buffers that never move: what a captured CUDA
graph reads (model_service/step/cuda_graphs.py), and what the CPU runs eagerly through the same
bookkeeping, so that CI checks it without a GPU.

A step of T token rows over B sequences, R of its rows sampled, runs as the smallest bucket
Tb >= T. The bucket's views hold Tb token rows, Sb = min(Tb, max_seqs) sequences and Sb logits
rows (R <= T and B <= T, so a step whose rows fit the bucket fits its views, unless it wants more
logits rows than Sb: prompt logprobs over a long chunk; that step runs unpadded).

Padding is inert by construction:
    token rows T .. Tb     token 0 at position 0, K/V written to slot 0 (block 0 is reserved:
                           no block table holds it), in no sequence: attention leaves them be
    sequences B .. Sb      0 rows scheduled, context 0: no tile reads them
    logits rows R .. Sb    row 0 again (their logits are computed and never read)
    tiles past the step's  first row PAD_ROW: the kernel's program returns at once
    LoRA slots T .. Tb     -1 (no adapter: the LoRA kernels' programs return at once)
Every op of the forward is row-wise or a GEMM, so a padding row never touches a live row.
With the LoRA kernels in the graphs (lora/triton_stack.py), each row's adapter slot is one more
token section, filled from the step's rows (-1 for base-model rows and padding).

On CUDA the host writes a pinned staging copy of the buffer and one copy moves it (plus the
block tables' used rows and columns) to the device before the replay. There are two staging
copies, used in turn, each rewritten only once its last copy to the device is done: a step
launched ahead (model_service/step/launch_ahead.py) fills its inputs while the step before it
may still be waiting for its own copy.

A step launched ahead may take some input tokens from the step before it on the device: the
rows `take_rows` read their token from that step's sampled ids at `take_from` (a section of the
same buffer, so the one copy carries them), after the copy and before the replay.
"""

from __future__ import annotations

import numpy as np
import torch

from model_service.attention import cuda_attention
from model_service.attention.paged import AttentionMetadata, build_attention_metadata


def token_buckets(max_tokens: int) -> list[int]:
    """The padded token counts, ascending, the last max_tokens itself: every size up to 8, steps
    of 16 to 256 (decode batches: vLLM's sizes), then steps of an eighth of a power of two, so
    that padding wastes at most ~1/8 of a bucket's rows."""
    sizes = [1, 2, 4, 8, *range(16, 257, 16)]
    while sizes[-1] < max_tokens:
        step = sizes[-1] // 8
        sizes += list(range(sizes[-1] + step, sizes[-1] * 2 + 1, step))
    return [s for s in sizes if s < max_tokens] + [max_tokens]


_TOKEN_SECTIONS = ("input_ids", "positions", "slot_mapping")
_SEQ_SECTIONS = ("query_start", "num_scheduled", "context_lens", "logits_indices")
_TAKE_SECTIONS = ("take_rows", "take_from")
_NAMES = (*_TOKEN_SECTIONS, "lora_slot", *_SEQ_SECTIONS, *_TAKE_SECTIONS, "tiles")


class PaddedStep:
    """The buffers of the largest bucket (every bucket uses their first rows), on the host and
    on `device`, and how a step fills them."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        tile_rows: int,
        device: torch.device,
    ) -> None:
        self.max_tokens, self.max_seqs, self.block_size = max_tokens, max_seqs, block_size
        self.tile_rows, self.device = tile_rows, device
        self.max_tiles = cuda_attention.max_tiles(max_tokens, max_seqs, tile_rows)
        sizes = [max_tokens] * (len(_TOKEN_SECTIONS) + 1) + [max_seqs] * len(_SEQ_SECTIONS)
        sizes += [max_seqs] * len(_TAKE_SECTIONS)
        sizes.append(2 * self.max_tiles)
        self._offsets = np.concatenate(([0], np.cumsum(sizes)))
        pinned = device.type == "cuda"
        hosts = [torch.zeros(int(self._offsets[-1]), dtype=torch.int64) for _ in range(2)]
        # A step's block tables are staged packed, [its sequences, its width] (a copy from a
        # strided host view would go through pageable memory, which waits for the stream).
        tables = [torch.zeros(max_seqs * max_blocks_per_seq, dtype=torch.int64) for _ in range(2)]
        # On the CPU the host buffer is the device's: one, and nothing to copy.
        self._hosts = [h.pin_memory() for h in hosts] if pinned else hosts[:1]
        self._host_tables = [t.pin_memory() for t in tables] if pinned else tables[:1]
        self._host_nps = [self._sections(h) for h in self._hosts]
        self._copied: list = [None] * len(self._hosts)  # each staging copy's last copy done
        self._turn = 0  # the staging copy the next fill writes
        self.buffer = self._hosts[0].to(device) if pinned else self._hosts[0]
        self.tables = torch.zeros((max_seqs, max_blocks_per_seq), dtype=torch.int64, device=device)
        self._packed_tables = self._host_tables[0].to(device) if pinned else None
        self._device = {n: self._section(self.buffer, i) for i, n in enumerate(_NAMES)}
        self._device["tiles"] = self._device["tiles"].view(2, self.max_tiles)

    def _sections(self, buffer: torch.Tensor) -> dict[str, np.ndarray]:
        sections = {n: self._section(buffer, i).numpy() for i, n in enumerate(_NAMES)}
        sections["tiles"] = sections["tiles"].reshape(2, self.max_tiles)
        return sections

    def clear(self) -> None:
        """Every row padding (a graph's warm-up and capture run on this), copied to the device."""
        host, h = self._hosts[0], self._host_nps[0]
        self._wait_for(0)
        host.zero_()
        h["lora_slot"][:] = -1
        cuda_attention.attention_tiles(np.zeros(0, dtype=np.int64), 1, h["tiles"])
        if self.buffer is not host:
            self.buffer.copy_(host)

    def _wait_for(self, turn: int) -> None:
        """Returns once the staging copy `turn` may be written: its last copy is done."""
        copied = self._copied[turn]
        if copied is not None:
            copied.synchronize()
            self._copied[turn] = None

    def _section(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        return buffer[int(self._offsets[index]) : int(self._offsets[index + 1])]

    def seqs_of(self, tokens: int) -> int:
        """Sb: the sequences (and logits rows) a bucket of `tokens` rows holds."""
        return min(tokens, self.max_seqs)

    def tiles_of(self, bucket: int) -> int:
        """The tile map's length for a bucket: the most tiles its rows and sequences can need."""
        return cuda_attention.max_tiles(bucket, self.seqs_of(bucket), self.tile_rows)

    def fits(self, x, num_scheduled: np.ndarray, logits_indices: np.ndarray, bucket: int) -> bool:
        """Whether a step fits `bucket`'s views (False: it runs unpadded): its rows, sequences
        and logits rows, and its block tables' width."""
        return (
            x.num_tokens <= bucket <= self.max_tokens
            and num_scheduled.size <= self.seqs_of(bucket)
            and logits_indices.size <= self.seqs_of(bucket)
            and x.block_tables.shape[1] <= self.tables.shape[1]
        )

    def lora_slots(self, bucket: int) -> torch.Tensor:
        """Each token row's LoRA slot on the device (-1: none), a bucket's view."""
        return self._device["lora_slot"][:bucket]

    def fill(
        self,
        x,
        num_scheduled: np.ndarray,
        logits_indices: np.ndarray,
        bucket: int,
        lora_slot: np.ndarray | None = None,
        taken=None,
    ) -> None:
        """The step's rows into a host staging copy, the bucket's padding after them, then
        (CUDA) the copy to the device, on the current stream. `lora_slot`: each row's adapter
        slot (None: every row the base model's). `taken`: (rows, from, sampled): the input token
        of each of `rows` is sampled[from], ids on the device of a step launched before."""
        turn = self._turn
        self._wait_for(turn)
        self._turn = (turn + 1) % len(self._hosts)
        h, tokens, count = self._host_nps[turn], int(x.num_tokens), num_scheduled.size
        seqs = self.seqs_of(bucket)
        for name in _TOKEN_SECTIONS:
            h[name][:tokens] = getattr(x, name)[:tokens]
            h[name][tokens:bucket] = 0
        h["lora_slot"][:tokens] = -1 if lora_slot is None else lora_slot[:tokens]
        h["lora_slot"][tokens:bucket] = -1
        h["query_start"][:count] = x.query_start[:count]
        h["num_scheduled"][:count] = num_scheduled
        h["context_lens"][:count] = x.context_lens[:count]
        for name in ("query_start", "num_scheduled", "context_lens"):
            h[name][count:seqs] = 0
        h["logits_indices"][: logits_indices.size] = logits_indices
        h["logits_indices"][logits_indices.size : seqs] = 0
        cuda_attention.attention_tiles(
            num_scheduled, self.tile_rows, h["tiles"][:, : self.tiles_of(bucket)]
        )
        width = x.block_tables.shape[1]
        host, packed = self._hosts[turn], self._host_tables[turn][: count * width]
        packed.numpy().reshape(count, width)[:] = x.block_tables[:count]
        num_taken = 0
        if taken is not None:
            rows, sources, _ = taken
            num_taken = rows.size
            h["take_rows"][:num_taken] = rows
            h["take_from"][:num_taken] = sources
        if self._packed_tables is None:
            self.tables[:count, :width] = packed.view(count, width)
        else:
            self.buffer.copy_(host, non_blocking=True)
            on_device = self._packed_tables[: count * width]
            on_device.copy_(packed, non_blocking=True)
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
            self.tables[:count, :width].copy_(on_device.view(count, width))  # on the device
        if num_taken:
            d, sampled = self._device, taken[2]
            d["input_ids"].index_copy_(
                0, d["take_rows"][:num_taken], sampled.index_select(0, d["take_from"][:num_taken])
            )

    def args(self, bucket: int, eager_step=None):
        """The model's arguments over a bucket's views: (input_ids, positions, metadata,
        logits_indices). A graph reads every bucket-sized view; an eager run (`eager_step`: the
        step's inputs) passes its own sequence count and maxima instead: the CPU's kernel takes
        no empty sequence, and the torch attention path sizes its gather from the maxima."""
        d, seqs = self._device, self.seqs_of(bucket)
        live = seqs if eager_step is None else eager_step.query_start.size
        meta: AttentionMetadata = build_attention_metadata(
            d["slot_mapping"][:bucket],
            d["query_start"][:live],
            d["num_scheduled"][:live],
            d["context_lens"][:live],
            self.tables[:live],
            self.block_size,
            bucket if eager_step is None else eager_step.max_query_len,
            self.tables.shape[1] * self.block_size
            if eager_step is None
            else eager_step.max_context_len,
            tiles=d["tiles"][:, : self.tiles_of(bucket)] if self.device.type == "cuda" else None,
        )
        return d["input_ids"][:bucket], d["positions"][:bucket], meta, d["logits_indices"][:seqs]
