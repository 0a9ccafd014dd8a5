"""Llama forward over a packed mixed batch with a paged KV cache.

Module and parameter names follow Hugging Face's `LlamaForCausalLM` (`model.embed_tokens.weight`,
`model.layers.N.self_attn.q_proj.weight`, ...), so a state dict moves between the two unchanged
and token parity can be checked against transformers. The numerics follow transformers too:
RMSNorm in float32, rotate-half RoPE with inv_freq computed the same way, SwiGLU MLP.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from model_service.attention import AttentionMetadata, paged_attention
from model_service.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class LlamaArchConfig:
    """The architecture facts the forward needs (Hugging Face LlamaConfig names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for rotate-half RoPE, computed in float32 as transformers does."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class LlamaAttention(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        d = arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, d
        self.q_proj = nn.Linear(arch.hidden_size, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, arch.hidden_size, bias=False)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(paged_attention(q, k, v, k_cache, v_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch)
        self.mlp = LlamaMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Hugging Face names, our forward: packed tokens in, logits of the sampled rows out."""

    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids/positions [T]; returns float32 logits [R, vocab] for packed rows logits_indices [R]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.arch.head_dim, self.arch.rope_theta, x.dtype)
        for index, layer in enumerate(self.model.layers):
            k_cache, v_cache = kv_cache.layer(index)
            x = layer(x, cos, sin, k_cache, v_cache, meta)
        # Norm and lm_head only for the rows that get sampled: a prefill chunk needs none.
        x = self.model.norm(x[logits_indices])
        return self.lm_head(x).float()
