"""`--model FOLDER`: a Llama-family Hugging Face folder (config.json, safetensors, tokenizer.json).

The tiny random Llama is written as transformers writes a model (save_pretrained), loaded back by
our loader, and run through the runner in a mixed batch; the reference is transformers loading
the same folder by itself (from_pretrained), not a copy of our weights.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from hf_folders import TINY_EOS_IDS, write_tiny_hf_folder
from model_service.config import ModelServiceConfig
from model_service.loading.loader import load_model
from model_service.start import build_runner
from ms_driver import Driver
from reference import compare_up_to_near_tie, greedy_reference
from test_ms_runner_tiny import NEW_TOKENS, _prompt


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    return write_tiny_hf_folder(str(tmp_path_factory.mktemp("hf") / "tiny-hf-llama"))


def _config(folder: str, **overrides) -> ModelServiceConfig:
    values = dict(model=folder, dtype="float32", num_kv_blocks=512, max_num_slots=16)
    values.update(overrides)
    return ModelServiceConfig(**values)


@pytest.fixture(scope="session")
def folder_loaded(tiny_folder):
    return load_model(_config(tiny_folder))


def test_folder_holds_the_tiny_weights_and_its_facts(folder_loaded, tiny_loaded):
    ours, tiny = folder_loaded.state_dict(), tiny_loaded.state_dict()
    assert ours.keys() == tiny.keys()
    for name in tiny:
        assert torch.equal(ours[name], tiny[name]), name
    assert folder_loaded.arch == tiny_loaded.arch
    assert folder_loaded.name == "tiny-hf-llama"  # the folder's name
    # generation_config.json's list, not config.json's single id.
    assert folder_loaded.eos_token_ids == TINY_EOS_IDS
    # generation_config names a bos id, but the tokenizer does not prepend it to text.
    assert folder_loaded.bos_token_id is None
    assert folder_loaded.special_tokens["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in folder_loaded.chat_template
    assert folder_loaded.tokenizer_json == tiny_loaded.tokenizer_json


def test_mixed_batch_parity_with_transformers_loading_the_folder(tiny_folder, folder_loaded):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    runner = build_runner(folder_loaded, _config(tiny_folder))
    prompts = {0: _prompt(70, 11), 1: _prompt(5, 12), 2: _prompt(1, 13), 3: _prompt(23, 14)}
    driver = Driver(runner)
    for slot in (0, 1, 2):
        driver.add(slot, prompts[slot])
    # Slot 0 is prefilled in 32-token chunks while 1 and 2 decode; slot 3 joins mid-decode.
    out = driver.run_to_completion(NEW_TOKENS, chunk=32, joins={5: [(3, prompts[3])]})
    for slot, prompt in prompts.items():
        ref, gaps = greedy_reference(reference, prompt, NEW_TOKENS)
        assert compare_up_to_near_tie(out[slot], ref, gaps) >= 32


def test_served_model_name_and_max_model_len(tiny_folder):
    loaded = load_model(_config(tiny_folder, served_model_name="my-llama", max_model_len=128))
    assert loaded.name == "my-llama"
    assert loaded.max_model_len == 128
    runner = build_runner(loaded, _config(tiny_folder, served_model_name="my-llama", max_model_len=128))
    facts = runner.describe_facts()
    assert (facts.model_name, facts.max_model_len, facts.eos_token_ids) == ("my-llama", 128, TINY_EOS_IDS)
    with pytest.raises(ValueError, match=r"max_model_len: 4096 exceeds the model's 512"):
        load_model(_config(tiny_folder, max_model_len=4096))
    with pytest.raises(ValueError, match=r"served_model_name: must not be empty"):
        _config(tiny_folder, served_model_name=" ").validate()


def _edited_copy(tiny_folder, tmp_path, edit) -> str:
    folder = str(tmp_path / "edited")
    shutil.copytree(tiny_folder, folder)
    edit(folder)
    return folder


def _edit_config(**changes):
    """Set config.json keys (a value of None deletes the key)."""
    def edit(folder):
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        with open(path, "w") as f:
            json.dump(config, f)
    return edit


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters=None, rope_theta=1e4, rope_scaling={"rope_type": "longrope", "factor": 8.0}),
     r"rope_scaling rope_type 'longrope' is not supported"),
    (dict(rope_parameters={"rope_type": "su", "rope_theta": 1e4}), r"rope_parameters rope_type 'su' is not supported"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), r"rope_type 'linear' needs a factor"),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor 0.5 is not supported"),
    (dict(model_type="mistral"), r"model_type 'mistral' does not match architectures \['LlamaForCausalLM'\]"),
    (dict(architectures=["GemmaForCausalLM"]), r"architectures 'GemmaForCausalLM' is not supported \(one of "
                                               r"\['LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM'"),
    (dict(architectures=None, model_type="gemma"), r"no architectures and model_type 'gemma' is not supported"),
    (dict(attention_bias=True), r"attention_bias=True is not supported"),
    (dict(mlp_bias=True), r"mlp_bias=True is not supported"),
    (dict(hidden_act="gelu"), r"hidden_act 'gelu' is not supported"),
    (dict(head_dim=32), r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \[32, 64\], the architecture's "
                        r"is \[64, 64\]"),
    (dict(intermediate_size=96), r"tensor 'model.layers.0.mlp.down_proj.weight' has shape \[64, 128\]"),
    (dict(vocab_size=1000), r"embed_tokens has 49152 rows, config.json vocab_size is 1000"),
])
def test_unsupported_config_is_refused_naming_the_key(tiny_folder, tmp_path, changes, message):
    folder = _edited_copy(tiny_folder, tmp_path, _edit_config(**changes))
    with pytest.raises(ValueError, match=message):
        load_model(_config(folder))


def test_missing_files_are_refused(tiny_folder, tmp_path):
    no_tokenizer = _edited_copy(tiny_folder, tmp_path, lambda f: os.remove(os.path.join(f, "tokenizer.json")))
    with pytest.raises(ValueError, match=r"has no tokenizer.json"):
        load_model(_config(no_tokenizer))
    os.rename(no_tokenizer, str(tmp_path / "no-tok"))
    no_weights = _edited_copy(tiny_folder, tmp_path, lambda f: os.remove(os.path.join(f, "model.safetensors")))
    with pytest.raises(ValueError, match=r"no \*.safetensors file"):
        load_model(_config(no_weights))
    with pytest.raises(ValueError, match=r"model: .* nor a Hugging Face folder"):
        _config(str(tmp_path / "does-not-exist")).validate()
