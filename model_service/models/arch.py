"""The architecture facts of a Llama-family model, as every room reads them: the loaders fill
them in (from config.json, GGUF metadata or a named shape); the forward, the KV cache and the
tensor-parallel split read them."""

from __future__ import annotations

import dataclasses
from typing import Optional

from model_service.models.rope import RopeScaling


@dataclasses.dataclass(frozen=True)
class LlamaArchConfig:
    """The architecture facts the forward needs (Hugging Face LlamaConfig names). The other
    families are Llama with a few of the switches at the end turned on (models/families.py)."""

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
    head_dim: int = 0
    """Per attention head; 0 means hidden_size / num_attention_heads (Qwen3 sets its own)."""
    rope_scaling: RopeScaling = RopeScaling()
    """The rope type and its facts (models/rope.py); the default type scales nothing."""
    attention_bias: bool = False
    """q/k/v projections with a bias (Qwen2)."""
    qk_norm: bool = False
    """An RMSNorm over each head of q and of k before RoPE (Qwen3)."""
    sliding_window: Optional[int] = None
    """A query attends only the last sliding_window positions, itself included (Mistral)."""
    architecture: str = "LlamaForCausalLM"
    """config.json's architectures[0]: the family (models/registry.py), reported in logs."""

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
