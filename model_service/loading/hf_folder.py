"""A Hugging Face model folder: config.json, *.safetensors, tokenizer.json.

Read here (all optional unless marked):
    config.json              (required) architecture (models/registry.py: Llama, Mistral, Qwen2,
                             Qwen3); eos/bos ids as a fallback
    *.safetensors            (required) weights: one file, or the shards
                             model.safetensors.index.json
                             lists (else every file in the folder); read tensor by tensor by the
                             loader (model_service/loading/weights.py), never here
    tokenizer.json           (required) the tokenizer, sent to the scheduler as it is
    tokenizer_config.json    chat_template, special token strings
    chat_template.jinja      chat template written by newer transformers (wins over the above)
    generation_config.json   eos_token_id (int or list): the ids that end a sequence

Our modules use Hugging Face's parameter names, so tensors load unchanged: unlike a GGUF, HF
checkpoints keep Q/K rows in rotate-half order, so no reverse permute. Architecture options our
forward does not implement are refused at load with the config key named (models/families.py),
rather than computed wrongly.

Sampling defaults in generation_config.json (temperature, top_p, top_k) are read and logged but
not applied: the contract has no Describe field to carry them to the scheduler, which owns the
sampling parameters of a request.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import structlog

from model_service.loading.gguf_file import GGUFTokenizer
from model_service.loading.weights import SafetensorsWeights
from model_service.models.arch import LlamaArchConfig
from model_service.models.families import family_for_config  # the built-ins registered

log = structlog.get_logger(__name__)

_TOKENIZER_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclasses.dataclass
class HFFolderContents:
    arch: LlamaArchConfig
    weights: SafetensorsWeights
    name: str
    tokenizer: GGUFTokenizer
    """Tokenizer facts in the shape the GGUF reader gives them (the loader takes either)."""
    sampling_defaults: dict[str, float]
    """generation_config.json's temperature / top_p / top_k, when given (informational)."""


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _read_json(folder: str, name: str) -> dict[str, Any]:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def arch_from_config(config: dict[str, Any]) -> LlamaArchConfig:
    """config.json -> LlamaArchConfig through its family; ValueError naming the config key our
    forward cannot honour."""
    return family_for_config(config).arch_from_config(config)


def _token_string(value) -> Optional[str]:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: str, tokenizer_config: dict[str, Any]) -> str:
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = tokenizer_config.get("chat_template") or ""
    if isinstance(template, list):  # named templates: take "default"
        template = next((t.get("template", "") for t in template if t.get("name") == "default"), "")
    return template


def load_hf_folder(folder: str) -> HFFolderContents:
    config = _read_json(folder, "config.json")
    arch = arch_from_config(config)
    tokenizer = load_hf_tokenizer(folder, config)
    generation = _read_json(folder, "generation_config.json")
    sampling_defaults: dict[str, float] = {
        k: float(generation[k]) for k in ("temperature", "top_p", "top_k") if k in generation
    }
    if sampling_defaults:
        log.info("generation_config_sampling_not_applied", **sampling_defaults)

    weights = _checked_weights(folder, arch)
    return HFFolderContents(
        arch=arch,
        weights=weights,
        name=os.path.basename(os.path.normpath(folder)),
        tokenizer=tokenizer,
        sampling_defaults=sampling_defaults,
    )


def load_hf_tokenizer(folder: str, config: Optional[dict[str, Any]] = None) -> GGUFTokenizer:
    """The folder's tokenizer.json with its chat template, special tokens and EOS/BOS ids
    (config.json's as a fallback: `config`, else the folder's when it has one)."""
    from tokenizers import Tokenizer

    if config is None:
        config = _read_json(folder, "config.json")
    tokenizer_path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        raise ValueError(f"model: {folder!r} has no tokenizer.json")
    with open(tokenizer_path, encoding="utf-8") as f:
        tokenizer_json = f.read()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer_config = _read_json(folder, "tokenizer_config.json")
    generation = _read_json(folder, "generation_config.json")
    special = {}
    for key in _TOKENIZER_SPECIAL_KEYS:
        token = _token_string(tokenizer_config.get(key))
        if token is not None:
            special[key] = token
    eos, bos = _eos_and_bos(tokenizer, config, generation, special)
    return GGUFTokenizer(
        tokenizer_json=tokenizer_json,
        chat_template=_chat_template(folder, tokenizer_config),
        eos_token_ids=tuple(eos),
        bos_token_id=bos,
        special_tokens=special,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
    )


def _eos_and_bos(
    tokenizer, config: dict, generation: dict, special: dict
) -> tuple[list[int], Optional[int]]:
    """(EOS ids, the BOS id prepended to text prompts or None)."""
    # generation_config.json decides what ends generation; config.json, then the tokenizer's
    # eos_token, are fallbacks.
    eos = _ids(generation.get("eos_token_id")) or _ids(config.get("eos_token_id"))
    if (
        not eos
        and "eos_token" in special
        and tokenizer.token_to_id(special["eos_token"]) is not None
    ):
        eos = [tokenizer.token_to_id(special["eos_token"])]
    bos_ids = _ids(generation.get("bos_token_id")) or _ids(config.get("bos_token_id"))
    # Describe's bos_token_id means "prepended to text prompts": true only when the tokenizer's
    # post-processor adds it, which encoding a letter shows.
    bos = None
    if bos_ids:
        encoded = tokenizer.encode("a", add_special_tokens=True).ids
        bos = bos_ids[0] if encoded and encoded[0] == bos_ids[0] else None
    return eos, bos


def _checked_weights(folder: str, arch: LlamaArchConfig) -> SafetensorsWeights:
    """The folder's safetensors, checked against config.json's vocabulary and tying."""
    weights = SafetensorsWeights(folder)
    if "model.embed_tokens.weight" in weights.names():
        rows = weights.shape("model.embed_tokens.weight")[0]
        if rows != arch.vocab_size:
            raise ValueError(
                f"model: embed_tokens has {rows} rows, config.json vocab_size is {arch.vocab_size}"
            )
    if arch.tie_word_embeddings is False and "lm_head.weight" not in weights.names():
        raise ValueError(
            "model: config.json says tie_word_embeddings=false but there is no lm_head.weight"
        )
    return weights
