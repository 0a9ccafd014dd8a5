"""`--load-format dummy`: a model of a named shape or a config.json with seeded random weights,
made where it will run. No checkpoint is read and nothing is written; for timing only.

The module tree is made on the meta device, then every parameter is allocated at its final,
fused shape (qkv_proj, gate_up_proj) on the target device in the serving dtype and filled in
place, in the module tree's order, from one generator on that device: an 8B shape is 16 GB of
bfloat16 that a GPU fills in well under a second, where drawing it on the host in Hugging Face's
names and fusing (loading/build.py's path) would take minutes.

    parameter                         filled with
    RMSNorm weights (every norm)      1
    biases (Qwen2's q/k/v)            0
    everything else                   normal(0, STD)

STD is transformers' initializer_range default: with unit norm weights each layer's sublayer
outputs stay O(1) whatever the width (0.02 x sqrt(4,096) ~ 1.3 for the 8B shape's projections),
so the residual grows by a few units per layer and stays finite in bfloat16 through 32 layers.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from torch import nn

from model_service.config import ModelServiceConfig, config_json_path
from model_service.kernels import gemm
from model_service.loading.gguf_file import GGUFTokenizer, load_gguf_tokenizer
from model_service.loading.hf_folder import arch_from_config, load_hf_tokenizer
from model_service.loading.shapes import dummy_config
from model_service.models.arch import LlamaArchConfig
from model_service.models.llama import LlamaForCausalLM, RMSNorm

STD = 0.02


def describe_weights(seed: int) -> str:
    """What Describe's compute map says of the weights."""
    return f"dummy (seed {seed}, normal std {STD})"


def dummy_source(
    config: ModelServiceConfig, default_tokenizer: Callable[[], str]
) -> tuple[LlamaArchConfig, str, GGUFTokenizer]:
    """(arch, the name served, tokenizer) of a dummy model. `default_tokenizer`: finds the GGUF
    whose tokenizer serves when neither --tokenizer nor the model's folder gives one."""
    config_json, name = dummy_config(config.model)
    return arch_from_config(config_json), name, dummy_tokenizer(config, default_tokenizer)


def dummy_tokenizer(
    config: ModelServiceConfig, default_tokenizer: Callable[[], str]
) -> GGUFTokenizer:
    """--tokenizer (a .gguf or a folder with tokenizer.json), else the model folder's
    tokenizer.json, else the default GGUF's."""
    path = config.tokenizer
    if path is None:
        config_path = config_json_path(config.model)
        folder = os.path.dirname(config_path) if config_path else None
        if folder is not None and os.path.isfile(os.path.join(folder, "tokenizer.json")):
            path = folder
    if path is None:
        path = default_tokenizer()
    if path.endswith(".gguf"):
        return load_gguf_tokenizer(path)
    return load_hf_tokenizer(path)


def build_dummy_model(
    arch: LlamaArchConfig,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    gemm_isa: str = "auto",
) -> LlamaForCausalLM:
    """The model with seeded random weights, allocated at their final shapes on `device`."""
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for name, meta in list(module.named_parameters(recurse=False)):
            if module is model.lm_head and arch.tie_word_embeddings:
                continue  # the embedding's, tied below
            weight = torch.empty(meta.shape, dtype=dtype, device=device)
            _fill_(weight, module, name, generator)
            setattr(module, name, nn.Parameter(weight, requires_grad=False))
    model.tie_weights()
    left = [name for name, t in model.named_parameters() if t.is_meta]
    if left:
        raise ValueError(f"model: no dummy weight filled {left}")
    model = model.eval().requires_grad_(False)
    gemm.pack_linears_(model, dtype, gemm.resolve_isa(gemm_isa))  # as a checkpoint's load does
    return model


def _fill_(
    weight: torch.Tensor, module: nn.Module, name: str, generator: Optional[torch.Generator]
) -> None:
    if isinstance(module, RMSNorm):
        weight.fill_(1.0)
    elif name == "bias":
        weight.zero_()
    else:
        weight.normal_(0.0, STD, generator=generator)
