"""Hugging Face model folders for the `--model FOLDER` tests, written the way transformers writes them.

- tiny_hf_folder: the tiny random Llama (fast): transformers' LlamaForCausalLM with our weights,
  `save_pretrained` (config.json + model.safetensors), SmolLM2's tokenizer.json, a
  tokenizer_config.json with the chat template, a generation_config.json with two eos ids.
- smollm2_hf_folder: SmolLM2-135M-Instruct from the GGUF (slow, about a minute): transformers
  dequantizes the GGUF, but refuses to save a model loaded from one, so its weights go into a
  plain LlamaForCausalLM built from the same config, which is saved; the tokenizer comes from
  the GGUF through transformers too. Cached across test sessions under the temp dir (keyed by the
  GGUF's size and mtime), built in a scratch dir and renamed into place when complete.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

TINY_EOS_IDS = [2, 0]  # generation_config's list; config.json says 2 only


def write_tiny_hf_folder(folder: str) -> str:
    from model_service.config import ModelServiceConfig
    from model_service.loading.loader import load_model
    from reference import hf_llama_from_loaded

    os.makedirs(folder, exist_ok=True)
    model = hf_llama_from_loaded(load_model(ModelServiceConfig(model="tiny", dtype="float32")))
    model.config.eos_token_id = TINY_EOS_IDS[0]
    model.config.bos_token_id = 1
    model.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer_files(folder)
    return folder


def family_config(kind, **overrides):
    """A tiny transformers config of a family (SmolLM2's vocabulary, so its tokenizer fits)."""
    values = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, eos_token_id=TINY_EOS_IDS[0], bos_token_id=1)
    values.update(overrides)
    return kind(**values)


def write_family_folder(folder: str, config, max_shard_size=None) -> str:
    """A random model of `config`'s family, saved as transformers saves it. Weights are drawn from a
    seeded generator, large enough (as the tiny model's) that greedy logits are rarely near-ties."""
    import transformers

    os.makedirs(folder, exist_ok=True)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise * (0.4 * (64 / param.shape[1]) ** 0.5))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    _write_tokenizer_files(folder)
    return folder


def _write_tokenizer_files(folder: str) -> None:
    from model_service.loading.gguf_file import load_gguf_tokenizer
    from model_service.loading.loader import smollm2_path

    tokenizer = load_gguf_tokenizer(smollm2_path())
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer.tokenizer_json)
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"chat_template": tokenizer.chat_template, "eos_token": {"content": "<|im_end|>"},
                   "bos_token": "<|im_start|>", "add_bos_token": False}, f)
    # Sampling defaults are read, logged and not applied (model_service/loading/hf_folder.py).
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": TINY_EOS_IDS, "bos_token_id": 1, "temperature": 0.6, "top_p": 0.9}, f)


def _build_smollm2_folder(folder: str) -> None:
    import transformers

    from model_service.loading.loader import smollm2_path

    path = smollm2_path()
    source, name = os.path.dirname(path), os.path.basename(path)
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    plain = transformers.LlamaForCausalLM(gguf_model.config).to(torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    plain.tie_weights()
    plain.save_pretrained(folder, safe_serialization=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, gguf_file=name)
    tokenizer.save_pretrained(folder)
    plain.generation_config.save_pretrained(folder)


def smollm2_hf_folder() -> str:
    from model_service.loading.loader import smollm2_path

    stat = os.stat(smollm2_path())
    folder = os.path.join(tempfile.gettempdir(), f"planserve-hf-smollm2-{stat.st_size}-{int(stat.st_mtime)}")
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return folder
    scratch = tempfile.mkdtemp(prefix="planserve-hf-smollm2-build-")
    try:
        _build_smollm2_folder(scratch)
        try:
            os.rename(scratch, folder)
        except OSError:  # another session finished first
            shutil.rmtree(scratch, ignore_errors=True)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return folder
