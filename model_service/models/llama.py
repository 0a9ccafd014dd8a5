"""Llama forward over a packed mixed batch with a paged KV cache.

Checkpoints arrive in Hugging Face's `LlamaForCausalLM` naming
(`model.layers.N.self_attn.q_proj.weight`, ...). At load, model_service/loading/build.py
concatenates q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj`, so a layer runs two
fewer GEMMs; `hf_state_dict` hands the HF names back (views into the fused weights) for parity
checks against transformers.

One decoder layer per step, every token row of the step packed together:

    x = add_rms_norm_(residual, delta)        residual += previous sublayer's output; normed
    qkv = qkv_proj(x)                          [T, (H + 2 KVH) * D]
    rope_(qkv, positions)                      q and k heads rotated in place (float32 table); on
                                               CUDA the same kernel writes K/V into the cache
    delta = o_proj(paged_attention(q, k, v))   q, k, v: views of qkv, no copies
    x = add_rms_norm_(residual, delta)
    delta = down_proj(silu_mul(gate_up_proj(x)))

The residual add is folded into the next norm (model_service/kernels/layer_ops.py), the norm and
lm_head run only on the rows that get sampled. Numerics follow transformers: RMSNorm in float32
with the same roundings, rotate-half RoPE with inv_freq computed the same way, SwiGLU MLP. Every
row-wise operation is batch-invariant by construction (layer_ops.py); the GEMMs are torch's, through
layer_ops.linear, which keeps them batch-invariant too.
"""

from __future__ import annotations

import torch
from torch import nn

from model_service.attention.kv_cache import KVCache
from model_service.attention.paged import AttentionMetadata, paged_attention
from model_service.kernels import layer_ops
from model_service.models import decoder_loop
from model_service.models.arch import LlamaArchConfig
from model_service.models.decoder_loop import NativeLayers
from model_service.models.rope import rope_table


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """residual += delta in place (when given), then the normed residual as a new tensor."""
        return layer_ops.add_rms_norm_(residual, delta, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        d = arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_attention_heads,
            arch.num_key_value_heads,
            d,
        )
        self.qkv_proj = nn.Linear(
            arch.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * d, bias=arch.attention_bias
        )
        self.o_proj = nn.Linear(self.num_heads * d, arch.hidden_size, bias=False)
        # Qwen3: one RMSNorm over each head's d values of q, one of k (weights [d], shared by
        # heads).
        self.q_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.sliding_window = arch.sliding_window

    def forward(
        self, x, positions, rope, k_cache, v_cache, meta: AttentionMetadata, lora=None
    ) -> torch.Tensor:
        qkv = layer_ops.linear(self.qkv_proj, x)
        if lora is not None:
            lora.add_("qkv_proj", x, qkv)
        d, heads, kv_heads = self.head_dim, self.num_heads, self.num_kv_heads
        if self.q_norm is not None:
            _norm_heads_(qkv, 0, heads, d, self.q_norm)
            _norm_heads_(qkv, heads * d, kv_heads, d, self.k_norm)
        kv_written = layer_ops.rope_and_cache_kv_(
            qkv, positions, rope, heads, kv_heads, d, k_cache, v_cache, meta.slot_mapping
        )
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        out = paged_attention(
            q.unflatten(1, (heads, d)),
            k.unflatten(1, (kv_heads, d)),
            v.unflatten(1, (kv_heads, d)),
            k_cache,
            v_cache,
            meta,
            sliding_window=self.sliding_window,
            kv_written=kv_written,
        )
        if lora is None:
            return layer_ops.linear(self.o_proj, out)
        out = out.flatten(1)
        return lora.add_("o_proj", out, layer_ops.linear(self.o_proj, out))


def _norm_heads_(
    qkv: torch.Tensor, first_column: int, num_heads: int, head_dim: int, norm: "RMSNorm"
) -> None:
    """RMSNorm, in place, over each of num_heads heads of qkv's rows starting at first_column
    (each head normed by itself, as one [T * heads, head_dim] batch of rows)."""
    columns = qkv[:, first_column : first_column + num_heads * head_dim]
    normed = norm(columns.reshape(-1, head_dim))  # reshape copies: the columns are a strided view
    columns.copy_(normed.view(columns.shape))


class LlamaMLP(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        if lora is None:
            return layer_ops.linear(
                self.down_proj, layer_ops.silu_mul(layer_ops.linear(self.gate_up_proj, x))
            )
        gate_up = lora.add_("gate_up_proj", x, layer_ops.linear(self.gate_up_proj, x))
        h = layer_ops.silu_mul(gate_up)
        return lora.add_("down_proj", h, layer_ops.linear(self.down_proj, h))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch)
        self.mlp = LlamaMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self, delta, residual, positions, rope, k_cache, v_cache, meta, lora=None
    ) -> torch.Tensor:
        """Adds the previous layer's output `delta` (None on layer 0) into `residual` in place and
        returns this layer's output, to be added by the next layer (or the final norm). `lora`:
        this layer's view of the step's adapter groups (model_service/lora/grouping.py)."""
        x = self.input_layernorm(residual, delta)
        x = self.post_attention_layernorm(
            residual, self.self_attn(x, positions, rope, k_cache, v_cache, meta, lora)
        )
        return self.mlp(x, lora)


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


UNDECIDED = "undecided: no forward yet"  # LlamaForCausalLM.decoder_loop_reason before one


class LlamaForCausalLM(nn.Module):
    """Fused weights, our forward: packed tokens in, logits of the sampled rows out."""

    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.tie_weights()
        self._rope: torch.Tensor | None = None  # made on the first forward, on the model's device
        self._native_layers: NativeLayers | None = None
        self.decoder_loop_reason: str | None = UNDECIDED  # None: the native loop runs

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope_table(self, device: torch.device) -> torch.Tensor:
        """float32 cos/sin of every position (models/rope.py), made once per device."""
        if self._rope is None or self._rope.device != device:
            arch = self.arch
            self._rope = rope_table(
                arch.max_position_embeddings,
                arch.head_dim,
                arch.rope_theta,
                arch.rope_scaling,
                device,
            )
        return self._rope

    def native_layers(self, rope: torch.Tensor) -> NativeLayers | None:
        """The native decoder loop (model_service/models/decoder_loop.py) where it applies, else
        None (the Python loop below). The start-up decides it (decoder_loop.decide, after the
        loader packed the linears); a model run without one decides on its first forward."""
        if self.decoder_loop_reason == UNDECIDED:
            decoder_loop.decide(self, "native")
        if self.decoder_loop_reason is None and self._native_layers is None:
            self._native_layers = NativeLayers(self, rope)
        return self._native_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: torch.Tensor,
        lora=None,
    ) -> torch.Tensor:
        """input_ids/positions [T]; returns float32 logits [R, vocab] for packed rows
        logits_indices [R]. `lora`: the step's rows grouped by adapter (lora/grouping.py
        LoraStep), None when no row runs one; the native loop takes stacked adapters (a bf16 model
        on the CPU), the Python loop every other kind."""
        residual = self.model.embed_tokens(input_ids).contiguous()
        rope = self.rope_table(residual.device)
        native = self.native_layers(rope)
        stacked = None if lora is None else lora.stacked
        if native is not None and meta.native_step is not None and (lora is None or stacked):
            delta = native.run(residual, positions, meta, kv_cache, stacked)
        else:
            delta = None
            for index, layer in enumerate(self.model.layers):
                k_cache, v_cache = kv_cache.layer(index)
                layer_lora = None if lora is None else lora.layer(index)
                delta = layer(delta, residual, positions, rope, k_cache, v_cache, meta, layer_lora)
        # The last add, the norm and lm_head only for the rows that get sampled: a prefill chunk
        # needs none.
        x = self.model.norm(
            residual.index_select(0, logits_indices), delta.index_select(0, logits_indices)
        )
        return layer_ops.linear(self.lm_head, x, float32_out=True)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in Hugging Face naming: views into the fused matrices (int8 ones too, split
        by
        rows), lm_head.weight the embedding's when tied."""
        return split_fused_state_dict(
            self.state_dict(), self.model.layers[0].self_attn if len(self.model.layers) else None
        )


_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def split_fused_state_dict(
    state: dict[str, torch.Tensor], attention: LlamaAttention | None
) -> dict[str, torch.Tensor]:
    """Ours -> Hugging Face names, for every tensor of a fused module (weight, or int8 qweight and
    scale): rows split by the head counts of `attention` (this rank's) and halves for gate/up."""
    out = {}
    for name, tensor in state.items():
        fused = next((f for f in _FUSED if f".{f}." in name), None)
        if fused is None:
            out[name] = tensor
            continue
        head, _, tail = name.partition(f".{fused}.")
        if fused == "self_attn.qkv_proj":
            d = attention.head_dim
            sizes = [
                attention.num_heads * d,
                attention.num_kv_heads * d,
                attention.num_kv_heads * d,
            ]
        else:
            sizes = [tensor.shape[0] // 2] * 2
        # Tensors that are not row-indexed (int8's zero-size dtype carrier) go to every part as they
        # are.
        pieces = (
            tensor.split(sizes, dim=0)
            if tensor.dim() and tensor.shape[0] == sum(sizes)
            else [tensor] * len(sizes)
        )
        for part, piece in zip(_FUSED[fused], pieces):
            out[f"{head}.{part}.{tail}"] = piece
    return out
