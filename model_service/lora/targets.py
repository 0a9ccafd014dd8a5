"""The modules a LoRA adapter may target on a Llama-family model, in PEFT's names, and where each
one's output lies in the model's fused linears (models/llama.py fuses q/k/v into qkv_proj and
gate/up into gate_up_proj at load):

    target      fused module    output columns             input
    q_proj      qkv_proj        [0, H*D)                   hidden
    k_proj      qkv_proj        [H*D, (H+KVH)*D)           hidden
    v_proj      qkv_proj        [(H+KVH)*D, (H+2KVH)*D)    hidden
    o_proj      o_proj          all (hidden)               H*D
    gate_proj   gate_up_proj    [0, I)                     hidden
    up_proj     gate_up_proj    [I, 2I)                    hidden
    down_proj   down_proj       all (hidden)               I
"""

from __future__ import annotations

import dataclasses

from model_service.models.arch import LlamaArchConfig

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Modules PEFT can target that the served model keeps un-adapted (refused by name).
REFUSED_MODULES = ("embed_tokens", "lm_head")


@dataclasses.dataclass(frozen=True)
class TargetSlice:
    """One target's place in the model: its fused module, its output columns, its input width."""

    fused: str
    start: int
    end: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class ModelTargets:
    """What an adapter must fit: the layer count and each target's slice."""

    num_layers: int
    slices: dict[str, TargetSlice]


def model_targets(arch: LlamaArchConfig) -> ModelTargets:
    h, kvh, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q, kv = h * d, kvh * d
    slices = {
        "q_proj": TargetSlice("qkv_proj", 0, q, hidden),
        "k_proj": TargetSlice("qkv_proj", q, q + kv, hidden),
        "v_proj": TargetSlice("qkv_proj", q + kv, q + 2 * kv, hidden),
        "o_proj": TargetSlice("o_proj", 0, hidden, q),
        "gate_proj": TargetSlice("gate_up_proj", 0, inter, hidden),
        "up_proj": TargetSlice("gate_up_proj", inter, 2 * inter, hidden),
        "down_proj": TargetSlice("down_proj", 0, hidden, inter),
    }
    return ModelTargets(arch.num_hidden_layers, slices)
