"""The built-in model families, each a small difference from Llama (models/registry.py).

    family               switches on                         refuses (by config key)
    LlamaForCausalLM     rope scaling (llama3, linear,       attention_bias, mlp_bias
                         dynamic, yarn), explicit head_dim
    MistralForCausalLM   sliding_window                      attention_bias
    Qwen2ForCausalLM     q/k/v bias (always: the model type  use_sliding_window, sliding layers
                         says so, not a config key)
    Qwen3ForCausalLM     per-head q/k RMSNorm, head_dim      attention_bias, use_sliding_window
                         (default 128)

Every family also refuses a hidden_act other than silu, partial rotary embeddings and rope types
outside models/rope.py's, each naming the key and its value.
"""

from __future__ import annotations

from typing import Any, Optional

from model_service.models.arch import LlamaArchConfig
from model_service.models.registry import Family, family_for_config, register

__all__ = ["LLAMA", "MISTRAL", "QWEN2", "QWEN3", "family_for_config", "llama_arch"]
from model_service.models.rope import rope_from_config


def _refuse_true(config: dict[str, Any], *keys: str) -> None:
    for key in keys:
        if config.get(key):
            raise ValueError(f"model: config.json {key}={config[key]!r} is not supported")


def _refuse_sliding_layers(config: dict[str, Any]) -> None:
    _refuse_true(config, "use_sliding_window")
    sliding = [t for t in config.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        raise ValueError(
            f"model: config.json layer_types {sorted(set(sliding))} is not supported (only "
            "'full_attention')"
        )


def llama_arch(
    config: dict[str, Any],
    *,
    attention_bias: bool = False,
    qk_norm: bool = False,
    sliding_window: Optional[int] = None,
) -> LlamaArchConfig:
    """The facts every family shares, read from config.json, plus the family's switches."""
    family = config.get("architectures", [None])[0] or config.get("model_type")
    _refuse_true(config, "mlp_bias")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"model: config.json hidden_act {config['hidden_act']!r} is not supported (only 'silu')"
        )
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    max_positions = int(config.get("max_position_embeddings", 2048))
    theta, scaling = rope_from_config(config, max_positions)
    return LlamaArchConfig(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        rope_theta=theta,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(
            config.get("tie_word_embeddings", False)
        ),  # every family's own default: untied
        head_dim=int(config.get("head_dim") or hidden // heads),
        rope_scaling=scaling,
        attention_bias=attention_bias,
        qk_norm=qk_norm,
        sliding_window=sliding_window,
        architecture=str(family),
    )


def _checked_type(config: dict[str, Any], model_type: str) -> None:
    if config.get("model_type", model_type) != model_type:
        raise ValueError(
            f"model: config.json model_type {config['model_type']!r} does not match architectures "
            f"{config.get('architectures')} (model_type {model_type!r})"
        )


def _llama(config: dict[str, Any]) -> LlamaArchConfig:
    _checked_type(config, "llama")
    # Llama's attention_bias puts a bias on o_proj too, unlike Qwen2's: not built.
    _refuse_true(config, "attention_bias")
    return llama_arch(config)


def _mistral(config: dict[str, Any]) -> LlamaArchConfig:
    _checked_type(config, "mistral")
    _refuse_true(config, "attention_bias")
    window = config.get("sliding_window")
    return llama_arch(config, sliding_window=None if window is None else int(window))


def _qwen2(config: dict[str, Any]) -> LlamaArchConfig:
    _checked_type(config, "qwen2")
    _refuse_sliding_layers(config)
    return llama_arch(config, attention_bias=True)


def _qwen3(config: dict[str, Any]) -> LlamaArchConfig:
    _checked_type(config, "qwen3")
    _refuse_sliding_layers(config)
    _refuse_true(config, "attention_bias")  # Qwen3's bias would sit on o_proj too: not built
    return llama_arch(config, qk_norm=True)


LLAMA = register(Family("LlamaForCausalLM", "llama", _llama))
# transformers' MistralConfig assumes a 4096-token window when the file does not say.
MISTRAL = register(
    Family("MistralForCausalLM", "mistral", _mistral, defaults={"sliding_window": 4096})
)
QWEN2 = register(Family("Qwen2ForCausalLM", "qwen2", _qwen2))
QWEN3 = register(Family("Qwen3ForCausalLM", "qwen3", _qwen3, defaults={"head_dim": 128}))
