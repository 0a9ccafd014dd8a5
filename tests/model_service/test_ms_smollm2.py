"""SmolLM2-135M from the GGUF: tokenizer and greedy parity against transformers reading the same file."""
from __future__ import annotations

import dataclasses
import os

import jinja2
import pytest
import torch
from tokenizers import Tokenizer

from ms_driver import Driver
from model_service.config import ModelServiceConfig
from model_service.kernels import gemm
from model_service.loading.loader import SMOLLM2_FILE, load_model, smollm2_path
from model_service.start import build_runner
from reference import compare_up_to_near_tie, greedy_reference

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Digits: 0 7 42 1234567890 3.14159 -12,000",
    "unicode: héllo wörld — naïve café 你好 🚀 ñ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\ttabs\n\nnewlines  ",
    "<|endoftext|><repo_name>x<file_sep>",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a haiku about gRPC streams."}],
]
NEW_TOKENS = 40
COMPARED: dict[str, int] = {}  # prompt name -> compared tokens (reported by the last test)


@pytest.fixture(scope="module")
def smollm2():
    config = ModelServiceConfig(model="smollm2", dtype="float32", num_kv_blocks=256, max_num_slots=8)
    loaded = load_model(config)
    return loaded, config


@pytest.fixture(scope="module")
def hf_gguf_model():
    import transformers

    path = smollm2_path()
    return transformers.LlamaForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=SMOLLM2_FILE, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path()), gguf_file=SMOLLM2_FILE)


def _render(template: str, messages) -> str:
    env = jinja2.Environment()
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def test_tokenizer_matches_transformers(smollm2, hf_tokenizer):
    loaded, _ = smollm2
    ours = Tokenizer.from_str(loaded.tokenizer_json)
    for text in TEXTS + [_render(loaded.chat_template, m) for m in MESSAGES]:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>user\nHi<|im_end|>").ids[0] == 1
    assert ours.token_to_id("<|im_end|>") == loaded.eos_token_ids[0] == 2


def test_chat_template_and_special_tokens(smollm2):
    loaded, _ = smollm2
    text = _render(loaded.chat_template, MESSAGES[0])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert loaded.special_tokens == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"
    }
    assert loaded.max_model_len == 8192 and loaded.arch.tie_word_embeddings


def test_weights_match_transformers_gguf_loading(smollm2, hf_gguf_model):
    loaded, _ = smollm2
    theirs = hf_gguf_model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, theirs[name].to(tensor.dtype)), name


def test_greedy_parity_mixed_batch(smollm2, hf_gguf_model):
    loaded, config = smollm2
    tok = Tokenizer.from_str(loaded.tokenizer_json)
    prompts = {
        "chat_capital": tok.encode(_render(loaded.chat_template, MESSAGES[0])).ids,
        "chat_haiku": tok.encode(_render(loaded.chat_template, MESSAGES[1])).ids,
        "text_fox": tok.encode(TEXTS[0]).ids,
    }
    driver = Driver(build_runner(loaded, config))
    slots = dict(zip(prompts, range(len(prompts))))
    driver.add(slots["chat_capital"], prompts["chat_capital"])
    driver.add(slots["text_fox"], prompts["text_fox"])
    # Chunks of 16 prefill the chat prompts over several steps; the haiku prompt joins later.
    out = driver.run_to_completion(NEW_TOKENS, chunk=16, joins={3: [(slots["chat_haiku"], prompts["chat_haiku"])]})
    for name, prompt in prompts.items():
        ref, gaps = greedy_reference(hf_gguf_model, prompt, NEW_TOKENS)
        COMPARED[name] = compare_up_to_near_tie(out[slots[name]], ref, gaps)
        print(f"smollm2 parity {name}: prompt {len(prompt)} tokens, compared {COMPARED[name]}/{NEW_TOKENS}")
        assert COMPARED[name] >= 32, name


def _greedy_on_each_path(smollm2, field: str, paths, messages, texts):
    """Greedy tokens of a chat prompt and a text prompt prefilled in chunks of 16, a second text
    prompt joining at step 3, with the config's `field` set to each of `paths` in turn."""
    loaded, config = smollm2
    tok = Tokenizer.from_str(loaded.tokenizer_json)
    prompts = [tok.encode(_render(loaded.chat_template, messages)).ids, tok.encode(texts[0]).ids, tok.encode(texts[1]).ids]
    outputs = []
    for path in paths:
        driver = Driver(build_runner(loaded, dataclasses.replace(config, **{field: path})))
        driver.add(0, prompts[0])
        driver.add(1, prompts[1])
        outputs.append(driver.run_to_completion(NEW_TOKENS, chunk=16, joins={2: [(2, prompts[2])]}))
        assert all(len(outputs[-1][slot]) == NEW_TOKENS for slot in range(3))
    return outputs


def test_native_attention_gives_the_gather_paths_greedy_tokens(smollm2, monkeypatch):
    """float32: the in-place attention kernel and the previous gather + SDPA path (still the
    path of other devices, selectable as "torch") give the same greedy tokens on a mixed batch
    with chunked prefill and a join. float32 because the two paths round differently in bf16;
    bf16 is checked against the float64 reference and for invariance in test_ms_attention.py."""
    from model_service.attention import paged as attention

    gather, native = _greedy_on_each_path(smollm2, "attention_isa",
                                          (attention.TORCH_PATH, attention.resolve_isa("auto")), MESSAGES[1], TEXTS)
    assert native == gather


def test_native_layer_ops_give_the_eager_paths_greedy_tokens(smollm2, monkeypatch):
    """float32: the native norm / RoPE / SiLU kernels and the same operations as eager torch ops
    (the path of other devices, PLANSERVE_LAYER_OPS_ISA=torch; transformers' formulas) give the
    same greedy tokens. float32 because the two round differently in bf16; bf16 is checked against
    float64 in test_ms_layer_ops.py."""
    from model_service.kernels import layer_ops

    eager, native = _greedy_on_each_path(smollm2, "layer_ops_isa",
                                         (layer_ops.TORCH_PATH, layer_ops.resolve_isa("auto")), MESSAGES[0], TEXTS[::-1])
    assert native == eager


@pytest.fixture(scope="module")
def float32_quality_tokens(smollm2):
    """float32's tokens on the int8 quality prompts: the bar of every int8 test below."""
    loaded, config = smollm2
    return _quality_tokens(loaded, ((loaded, config),))[0]


def test_int8_greedy_matches_float32_and_weights_shrink(smollm2, float32_quality_tokens):
    from model_service.kernels.quant import weight_bytes

    loaded, config = smollm2
    int8_config = dataclasses.replace(config, quantization="int8")
    int8 = load_model(int8_config)
    ratio = weight_bytes(loaded.model) / weight_bytes(int8.model)
    print(f"smollm2 weight bytes float32 {weight_bytes(loaded.model)} int8 {weight_bytes(int8.model)} ({ratio:.2f}x)")
    assert ratio >= 3.5
    (quantized,) = _quality_tokens(loaded, ((int8, int8_config),))
    assert quantized == float32_quality_tokens


# The GEMM paths int8 in bf16 runs: this CPU's own ("auto") and torch's, once each (the same one
# where the CPU has no packed GEMM). bf16 is the point here, so it runs on every CPU class.
GEMM_PATHS = sorted({gemm.resolve_isa(), gemm.TORCH_PATH})


@pytest.mark.slow(reason="SmolLM2 loaded and run in bf16 per path; torch's path widens each int8 "
                  "weight to float32 for two matmuls a call (a minute and more on 2 cores)")
@pytest.mark.parametrize("gemm_isa", GEMM_PATHS)
def test_int8_in_bf16_greedy_matches_float32(smollm2, float32_quality_tokens, gemm_isa):
    """What users run: int8 with bf16 compute (the default dtype where bf16 is native), where the
    CPU's native GEMM runs it (x quantized to int16 per block of 32, integer block dot products:
    model_service/kernels/gemm.py), and where it does not ("torch": CPUs without AVX512-BF16,
    forced here on every CPU), the same arithmetic in torch (kernels/quant.py int8_block_linear).
    The quality bar of the float32 int8 test above: float32's 16 greedy tokens on every prompt
    (bf16 weights themselves miss it on the first prompt; int8 x, at 8 bits, missed it on the
    second)."""
    loaded, config = smollm2
    int8_config = dataclasses.replace(config, dtype="bfloat16", quantization="int8", gemm_isa=gemm_isa)
    int8 = load_model(int8_config)
    packed = [m for m in int8.model.modules() if isinstance(m, gemm.PackedLinear)]
    print(f"\nint8 in bf16: gemm path {gemm_isa} (this CPU's own: {gemm.resolve_isa()})")
    assert len(packed) == (0 if gemm_isa == gemm.TORCH_PATH else 4 * int8.arch.num_hidden_layers + 1)
    (quantized,) = _quality_tokens(loaded, ((int8, int8_config),))
    assert quantized == float32_quality_tokens


def _quality_tokens(loaded, models_and_configs):
    """For each (model, config): the 16 greedy tokens of the int8 quality prompts (the chat
    messages and the first text), one list per prompt."""
    tok = Tokenizer.from_str(loaded.tokenizer_json)
    prompts = [tok.encode(_render(loaded.chat_template, m)).ids for m in MESSAGES] + [tok.encode(TEXTS[0]).ids]
    outputs = []
    for model, cfg in models_and_configs:
        driver = Driver(build_runner(model, cfg))
        for slot, prompt in enumerate(prompts):
            driver.add(slot, prompt)
        tokens = driver.run_to_completion(16, chunk=64)
        outputs.append([tokens[slot][:16] for slot in range(len(prompts))])
    return outputs
