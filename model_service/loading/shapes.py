"""The named shapes `--load-format dummy` builds, and where a dummy model's config.json comes from
(model_service/config.py checks the name against DUMMY_SHAPE_NAMES: the keys of DUMMY_SHAPES, a
test says so).

    name            layers  hidden  heads q/kv  head_dim  ffn     vocab    tied
    tiny                 2      64        4/2         16    128   49,152   yes   (tests, dry runs)
    smollm2-135m        30     576        9/3         64  1,536   49,152   yes
    llama-1b            16   2,048       32/8         64  8,192   49,152   yes
    llama-8b            32   4,096       32/8        128 14,336  128,256   no

llama-1b keeps SmolLM2's vocabulary, as the GPU benchmark's 1B shape always has (issue 32's table),
so its figures compare across runs. llama-8b keeps Llama 3's 128,256 rows: its lm_head and
embedding are then the real model's (1 GiB each in bfloat16), and the served tokenizer (SmolLM2's,
49,152 tokens) is covered; ids it does not know decode to nothing, which timing runs never read.
Every shape serves 8,192 positions (a Llama 3 without its long-context rope scaling).
"""

from __future__ import annotations

import json
import os
from typing import Any

from model_service.config import check_dummy_model, config_json_path


def _llama(
    layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, tied: bool, **more
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        **more,
    }


DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": _llama(2, 64, 4, 2, 128, 49152, True, rope_theta=10000.0, max_position_embeddings=512),
    "smollm2-135m": _llama(30, 576, 9, 3, 1536, 49152, True, rope_theta=100000.0),
    "llama-1b": _llama(16, 2048, 32, 8, 8192, 49152, True, rope_theta=500000.0),
    "llama-8b": _llama(32, 4096, 32, 8, 14336, 128256, False, rope_theta=500000.0),
}


def dummy_config(model: str) -> tuple[dict[str, Any], str]:
    """(config.json's contents, the name served) of a named shape or a config.json."""
    check_dummy_model(model)
    if model in DUMMY_SHAPES:
        return dict(DUMMY_SHAPES[model]), f"dummy-{model}"
    path = config_json_path(model)
    assert path is not None  # check_dummy_model
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    folder = os.path.dirname(os.path.abspath(path))
    return config, f"dummy-{os.path.basename(folder)}"
