"""Tensor parallelism (Megatron style) over torch.distributed: how one model is split across ranks.

Every rank holds, per decoder layer, its share of the attention heads and of the MLP columns:

    qkv_proj                 column-parallel: rank r keeps query heads [r*H/N, (r+1)*H/N) and KV
                             heads [r*KVH/N, (r+1)*KVH/N) of each of q, k and v, fused again
                             as [q | k | v] (GQA groups stay whole: query head h uses KV head
                             h // (H/KVH) on every rank alike)
    o_proj                   row-parallel: the input columns of those heads, then all_reduce(sum)
    gate_up_proj             column-parallel: rows [r*I/N, (r+1)*I/N) of gate and of up, fused again
    down_proj                row-parallel: the same columns, then all_reduce(sum)
    embedding                vocab-parallel: rows [r*V/N, (r+1)*V/N); a token outside them looks up
                             zeros, then all_reduce(sum) (exactly one rank holds each row)
    lm_head                  vocab-parallel: the same rows (shared when tied), then all_gather of
                             the [R, V/N] logits: every rank has all R x V logits and samples alike
    norms                    replicated
The embedding and lm_head stay replicated when N does not divide V, or with int8 quantization
(its tied Int8Weight is made for the whole matrix).

So a layer costs two all_reduces of [T, hidden] per step, and each rank's paged KV cache holds only
its KVH/N heads: with the same memory per rank, N ranks hold N times the blocks of one.

The split needs H, KVH and I divisible by N; the check names the counts that are not.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model_service.models.arch import LlamaArchConfig


def check_divisible(arch: LlamaArchConfig, world_size: int) -> None:
    """Raise ValueError naming tensor_parallel_size and each count it does not divide."""
    counts = {
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "intermediate_size": arch.intermediate_size,
    }
    bad = [f"{name} {count}" for name, count in counts.items() if count % world_size]
    if bad:
        raise ValueError(f"tensor_parallel_size: {world_size} does not divide {', '.join(bad)}")


class RowParallelLinear(nn.Module):
    """A linear over this rank's input columns, summed over the ranks (all_reduce in place)."""

    def __init__(self, linear: nn.Module, group) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; ids outside them read zeros, summed over the ranks."""

    def __init__(self, weight: torch.Tensor, first_row: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.first_row = first_row
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first_row
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0.0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered from every rank into [R, V] in rank order."""

    def __init__(self, weight: nn.Parameter, world_size: int, group) -> None:
        super().__init__()
        self.weight = weight  # shared with VocabParallelEmbedding when the embeddings are tied
        self.world_size = world_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight)
        if local.shape[0] == 0:  # no row sampled this step (same on every rank): nothing to gather
            return local.new_empty((0, local.shape[1] * self.world_size))
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclasses.dataclass(frozen=True)
class RankShare:
    """Which rows and columns of each checkpoint tensor this rank loads (the module docstring's
    table); the loader reads only those (model_service/loading/build.py), then `wrap_parallel_`
    adds the collectives. world_size 1 is the whole model."""

    rank: int = 0
    world_size: int = 1
    group: object = None  # the compute process group of the collectives
    vocab_parallel: bool = True
    """Split the embedding and lm_head by vocabulary rows (when world_size divides the
    vocabulary)."""

    def _part(self, total: int) -> slice:
        size = total // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def q_rows(self, arch: LlamaArchConfig) -> slice:
        """Rows of q_proj (and columns of o_proj): this rank's query heads."""
        return self._part(arch.num_attention_heads * arch.head_dim)

    def kv_rows(self, arch: LlamaArchConfig) -> slice:
        return self._part(arch.num_key_value_heads * arch.head_dim)

    def mlp_rows(self, arch: LlamaArchConfig) -> slice:
        """Rows of gate_proj and up_proj (and columns of down_proj)."""
        return self._part(arch.intermediate_size)

    def vocab_rows(self, arch: LlamaArchConfig) -> slice | None:
        """Rows of the embedding and lm_head, or None where they stay replicated."""
        if self.world_size == 1 or not self.vocab_parallel or arch.vocab_size % self.world_size:
            return None
        return self._part(arch.vocab_size)


def wrap_parallel_(model: nn.Module, share: RankShare) -> nn.Module:
    """Give a model loaded with `share`'s rows and columns its collectives, in place: o_proj and
    down_proj sum over the ranks, a vocab-parallel embedding and lm_head look up and gather."""
    arch: LlamaArchConfig = model.arch
    rows = share.vocab_rows(arch)
    if rows is not None:
        embedding = VocabParallelEmbedding(model.model.embed_tokens.weight, rows.start, share.group)
        lm_weight = embedding.weight if arch.tie_word_embeddings else model.lm_head.weight
        model.model.embed_tokens = embedding
        model.lm_head = VocabParallelLMHead(lm_weight, share.world_size, share.group)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj, share.group)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, share.group)
    return model
