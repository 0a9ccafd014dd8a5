"""Every model family we serve, against transformers: a tiny random model of each family, built from
its transformers config class with the family's quirks switched on, saved as a Hugging Face folder,
loaded by our loader and run through the runner in a mixed batch (a prompt prefilled in chunks while
two others decode, a fourth joining mid-decode). The reference is transformers loading the same
folder by itself.

float32, because this is parity with transformers: bf16 rounds differently in every kernel, so token
parity is only defined in float32 (test_bf16_serves_each_family checks that bf16, the default
where the CPU has it natively, runs each family and agrees with float32 for the first tokens). Tokens are compared by the near-tie rule;
each sampled token's logprob within 1e-4 of transformers' over the compared tokens.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from hf_folders import family_config, write_family_folder
from model_service.config import ModelServiceConfig
from model_service.loading.loader import load_model
from model_service.start import build_runner
from ms_driver import Driver
from reference import compare_up_to_near_tie, greedy_reference, reference_logprobs
from test_ms_runner_tiny import NEW_TOKENS, _prompt

MIN_COMPARED = 24


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    def rope(kind, **values):
        return {"rope_parameters": {"rope_type": kind, "rope_theta": 10000.0, **values}}

    return {
        # Llama 3.1's scaling with a pretraining length the prompts pass, written as Llama 3.x files
        # write it (rope_scaling + a top-level rope_theta: see _legacy_rope_keys).
        "llama3": family_config(LlamaConfig, **rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_position_embeddings=64)),
        "linear": family_config(LlamaConfig, **rope("linear", factor=2.0)),
        # dynamic NTK equals the default up to max_position_embeddings, where we cap it.
        "dynamic": family_config(LlamaConfig, **rope("dynamic", factor=2.0)),
        "yarn": family_config(LlamaConfig, **rope("yarn", factor=4.0, original_max_position_embeddings=128)),
        "qwen2": family_config(Qwen2Config),  # q/k/v bias, untied head
        "qwen2-tied": family_config(Qwen2Config, tie_word_embeddings=True),
        "qwen3": family_config(Qwen3Config, head_dim=32),  # q/k norm; head_dim 32 != 64 / 4
        "mistral": family_config(MistralConfig, sliding_window=8),  # every prompt is longer than 8
    }


FAMILIES = ["llama3", "linear", "dynamic", "yarn", "qwen2", "qwen2-tied", "qwen3", "mistral"]


def _legacy_rope_keys(folder: str) -> None:
    """config.json as Llama 3.x checkpoints write it: rope_scaling and a top-level rope_theta."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    parameters = config.pop("rope_parameters")
    config["rope_theta"] = parameters.pop("rope_theta")
    config["rope_scaling"] = parameters
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    configs = _configs()
    folders = {}
    for name in FAMILIES:
        folder = write_family_folder(str(tmp_path_factory.mktemp("families") / name), configs[name])
        if name == "llama3":
            _legacy_rope_keys(folder)
        folders[name] = folder
    return folders


def _config(folder: str, **overrides) -> ModelServiceConfig:
    values = dict(model=folder, dtype="float32", num_kv_blocks=512, max_num_slots=16)
    values.update(overrides)
    return ModelServiceConfig(**values)


PROMPTS = {0: _prompt(70, 21), 1: _prompt(9, 22), 2: _prompt(12, 23), 3: _prompt(23, 24)}


def _run_mixed_batch(loaded, config, with_logprobs=False):
    driver = Driver(build_runner(loaded, config))
    for slot in (0, 1, 2):
        driver.add(slot, PROMPTS[slot], with_logprobs=with_logprobs)
    # Slot 0 is prefilled in 32-token chunks while 1 and 2 decode; slot 3 joins mid-decode.
    out = driver.run_to_completion(NEW_TOKENS, chunk=32, joins={5: [(3, PROMPTS[3])]}, with_logprobs=with_logprobs)
    return out, driver.logprobs


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers_in_a_mixed_batch(family_folders, family):
    import transformers

    folder = family_folders[family]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    loaded = load_model(_config(folder))
    assert loaded.arch.architecture == type(reference).__name__
    out, logprobs = _run_mixed_batch(loaded, _config(folder), with_logprobs=True)
    compared = []
    for slot, prompt in PROMPTS.items():
        ref, gaps = greedy_reference(reference, prompt, NEW_TOKENS)
        n = compare_up_to_near_tie(out[slot], ref, gaps)
        compared.append(n)
        expected = reference_logprobs(reference, prompt + ref[:n])
        for i in range(n):
            ours, theirs = logprobs[slot][i], float(expected[len(prompt) - 1 + i, ref[i]])
            assert abs(ours - theirs) < 1e-4, (slot, i, ours, theirs)
    assert all(n >= MIN_COMPARED for n in compared), compared


def test_family_switches_are_read_from_config(family_folders):
    arch = {name: load_model(_config(folder)).arch for name, folder in family_folders.items()}
    assert arch["llama3"].rope_scaling.rope_type == "llama3"
    assert arch["llama3"].rope_scaling.original_max_position_embeddings == 64
    assert arch["yarn"].rope_scaling.factor == 4.0
    assert arch["qwen2"].attention_bias and not arch["qwen2"].tie_word_embeddings
    assert arch["qwen2-tied"].tie_word_embeddings
    assert arch["qwen3"].qk_norm and arch["qwen3"].head_dim == 32
    assert arch["mistral"].sliding_window == 8
    assert not any(a.sliding_window for name, a in arch.items() if name != "mistral")


def test_window_no_longer_than_the_model_is_dropped(family_folders):
    """max_model_len within the window: full attention is the same, so the native kernel runs."""
    loaded = load_model(_config(family_folders["mistral"], max_model_len=8))
    assert loaded.arch.sliding_window is None


def test_sliding_window_changes_tokens(family_folders):
    """The window is applied: the same weights with full attention give other tokens (so the parity
    test above could not pass by ignoring the window)."""
    folder = family_folders["mistral"]
    windowed = load_model(_config(folder))
    full = load_model(_config(folder))
    for layer in full.model.model.layers:
        layer.self_attn.sliding_window = None
    assert _run_mixed_batch(windowed, _config(folder))[0] != _run_mixed_batch(full, _config(folder))[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_serves_each_family(family_folders, family):
    """bf16, the default dtype where the CPU multiplies it natively; these models are tiny, so it
    runs on every CPU class (tests/dtypes.py). They have large random weights, so bf16 moves their
    logits by tenths (transformers' own bf16 forward as much) and greedy tokens part from
    float32's within a few steps. What must hold: each family's bf16 path is as close to the float32
    reference as transformers' own bf16 forward is. Over the tokens ours samples in the mixed
    batch, the mean logprob distance from float32 is at most 1.5x transformers' bf16 distance over
    the same tokens (plus 0.02; measured 0.07-0.10 for both, and single tokens up to ~1 for both);
    a family quirk left out moves them by whole units."""
    import transformers

    folder = family_folders[family]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference_bf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    out, logprobs = _run_mixed_batch(load_model(_config(folder, dtype="bfloat16")), _config(folder, dtype="bfloat16"),
                                     with_logprobs=True)
    ours, theirs = [], []
    for slot, prompt in PROMPTS.items():
        tokens = out[slot][:16]
        expected, transformers_bf16 = (reference_logprobs(m, prompt + tokens) for m in (reference, reference_bf16))
        for i, token in enumerate(tokens):
            row = len(prompt) - 1 + i
            ours.append(abs(logprobs[slot][i] - float(expected[row, token])))
            theirs.append(abs(float(transformers_bf16[row, token]) - float(expected[row, token])))
    ours_mean, theirs_mean = sum(ours) / len(ours), sum(theirs) / len(theirs)
    print(f"\n{family} bf16: mean logprob distance from float32: ours {ours_mean:.3f}, transformers' {theirs_mean:.3f}")
    assert ours_mean <= 1.5 * theirs_mean + 0.02, (ours_mean, theirs_mean)


def test_sharded_checkpoint_loads_the_same_weights(family_folders, tmp_path):
    from transformers import Qwen2Config

    sharded = write_family_folder(str(tmp_path / "qwen2-sharded"), family_config(Qwen2Config), max_shard_size="4MB")
    files = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    assert len(files) >= 2 and os.path.isfile(os.path.join(sharded, "model.safetensors.index.json")), files
    ours, whole = load_model(_config(sharded)).state_dict(), load_model(_config(family_folders["qwen2"])).state_dict()
    assert ours.keys() == whole.keys()
    for name in whole:
        assert torch.equal(ours[name], whole[name]), name


def test_index_naming_a_missing_shard_is_refused(family_folders, tmp_path):
    import shutil

    folder = str(tmp_path / "broken")
    shutil.copytree(family_folders["qwen2"], folder)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}, f)
    with pytest.raises(ValueError, match=r"names shard\(s\) \['model-00002-of-00002.safetensors'\] that are not in"):
        load_model(_config(folder))


def test_int8_quantizes_biased_layers(family_folders):
    """int8 keeps Qwen2's q/k/v bias (added after the integer GEMM) and stays near float32."""
    folder = family_folders["qwen2"]
    int8, _ = _run_mixed_batch(load_model(_config(folder, quantization="int8")), _config(folder, quantization="int8"))
    dense, _ = _run_mixed_batch(load_model(_config(folder)), _config(folder))
    assert sum(a == b for slot in PROMPTS for a, b in zip(int8[slot][:4], dense[slot][:4])) >= 12


def _llama_cpp_permute(weight, num_heads: int):
    """llama.cpp's converter's Q/K row order (rotate-half halves -> interleaved pairs)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _write_llama3_gguf(folder: str, path: str) -> None:
    """The llama3 folder's model as llama.cpp's converter writes a Llama 3.1 GGUF: its rope scaling
    as a rope_freqs tensor (default frequency / scaled frequency, per frequency), Q/K rows permuted,
    SmolLM2's tokenizer fields copied over."""
    import gguf
    import numpy as np
    import transformers

    from model_service.loading.loader import smollm2_path
    from model_service.models.rope import RopeScaling, inverse_frequencies

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = model.config
    params = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    scaled, _ = inverse_frequencies(head_dim, params["rope_theta"], RopeScaling(
        rope_type="llama3", factor=params["factor"], low_freq_factor=params["low_freq_factor"],
        high_freq_factor=params["high_freq_factor"],
        original_max_position_embeddings=params["original_max_position_embeddings"]))
    default, _ = inverse_frequencies(head_dim, params["rope_theta"], RopeScaling())
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(params["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    source = gguf.GGUFReader(smollm2_path())
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.chat_template"):
        field = source.fields[key]
        value = field.contents()
        kind = field.types[0]
        writer.add_key_value(key, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        if name in names:
            writer.add_tensor(names[name], array)
            continue
        _, _, layer, rest = name.split(".", 3)
        module = rest.removesuffix(".weight")
        if module == "self_attn.q_proj":
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif module == "self_attn.k_proj":
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{layer_names[module]}.weight", np.ascontiguousarray(array))
    writer.add_tensor("rope_freqs.weight", (default / scaled).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_llama3_gguf_with_rope_freqs_matches_transformers(family_folders, tmp_path):
    import transformers

    folder = family_folders["llama3"]
    path = str(tmp_path / "tiny-llama3.gguf")
    _write_llama3_gguf(folder, path)
    loaded = load_model(_config(path))
    assert loaded.arch.rope_scaling.freq_factors is not None
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out, _ = _run_mixed_batch(loaded, _config(path))
    compared = []
    for slot, prompt in PROMPTS.items():
        ref, gaps = greedy_reference(reference, prompt, NEW_TOKENS)
        compared.append(compare_up_to_near_tie(out[slot], ref, gaps))
    assert all(n >= MIN_COMPARED for n in compared), compared


def test_gguf_rope_scaling_we_do_not_compute_is_refused():
    from model_service.loading.gguf_file import arch_from_metadata

    meta = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
            "llama.feed_forward_length": 128, "llama.block_count": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.context_length": 512}
    assert arch_from_metadata(meta).rope_scaling.rope_type == "default"
    with pytest.raises(ValueError, match=r"GGUF llama.rope.scaling.type 'yarn' is not supported"):
        arch_from_metadata({**meta, "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    linear = arch_from_metadata({**meta, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    assert (linear.rope_scaling.rope_type, linear.rope_scaling.factor) == ("linear", 4.0)
    with pytest.raises(ValueError, match=r"GGUF general.architecture 'qwen2' is not supported"):
        arch_from_metadata({**meta, "general.architecture": "qwen2"})
    with pytest.raises(ValueError, match=r"llama.rope.dimension_count 8 != head dim 16"):
        arch_from_metadata({**meta, "llama.rope.dimension_count": 8})
