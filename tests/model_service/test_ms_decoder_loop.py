"""The native decoder loop (model_service/models/decoder_loop.py) gives the Python loop's bits.

It makes the same kernel calls in the same order, so the claim is exact equality: tokens and
logprobs of a mixed batch (chunked prefills of different lengths, decodes, a sequence joining
mid-run) with the native loop equal the Python loop's bit for bit, in bf16 (the default dtype) and
int8 on the tiny model and on SmolLM2. Both loops run the same kernels, so this also carries the
Python loop's batch-invariance and parity tests over to the native one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_config
from ms_driver import Driver

from model_service.models import decoder_loop
from model_service.attention.paged import build_attention_metadata
from model_service.config import ModelServiceConfig
from model_service.kernels import gemm
from model_service.attention.kv_cache import KVCache
from model_service.loading.loader import load_model
from model_service.start import build_runner, start_runner

pytestmark = pytest.mark.skipif(
    gemm.resolve_isa() == gemm.TORCH_PATH,
    reason="no packed GEMM path on this CPU: the Python loop is all there is",
)


def _run(config: ModelServiceConfig, loop: str, monkeypatch) -> tuple[dict, dict, str | None]:
    """Tokens and logprobs of a mixed batch, and the loop's reason for not being native."""
    config = dataclasses.replace(config, decoder_loop=loop)
    loaded = load_model(config)
    driver = Driver(build_runner(loaded, config))
    prompts = {0: list(range(5, 60)), 1: list(range(100, 103)), 2: list(range(7, 40))}
    for slot, prompt in prompts.items():
        driver.add(slot, prompt, with_logprobs=True)
    tokens = driver.run_to_completion(
        10, chunk=16, joins={3: [(3, list(range(200, 230)))]}, with_logprobs=True
    )
    return tokens, driver.logprobs, loaded.model.decoder_loop_reason


@pytest.fixture(scope="module")
def qwen_folders(tmp_path_factory):
    """Tiny random Qwen2 (q/k/v bias) and Qwen3 (per-head q/k norm) Hugging Face folders."""
    from hf_folders import family_config, write_family_folder
    from transformers import Qwen2Config, Qwen3Config

    root = tmp_path_factory.mktemp("decoder-loop")
    return {
        name: write_family_folder(str(root / name), family_config(config_class))
        for name, config_class in (("qwen2", Qwen2Config), ("qwen3", Qwen3Config))
    }


@pytest.mark.parametrize(
    "model,quantization",
    [
        ("tiny", "none"),
        ("tiny", "int8"),
        ("smollm2", "none"),
        ("smollm2", "int8"),
        ("qwen2", "none"),
    ],
)
def test_native_loop_gives_the_python_loops_tokens_and_logprobs_bit_for_bit(
    model, quantization, monkeypatch, qwen_folders
):
    """qwen2 adds the q/k/v bias the native loop passes to the GEMM."""
    config = ModelServiceConfig(
        model=qwen_folders.get(model, model),
        dtype="bfloat16",
        quantization=quantization,
        num_kv_blocks=128,
        max_num_slots=8,
    )
    native_tokens, native_logprobs, native_reason = _run(config, "native", monkeypatch)
    python_tokens, python_logprobs, python_reason = _run(config, "python", monkeypatch)
    assert native_reason is None  # the native loop ran
    assert python_reason == "decoder_loop=python"
    assert native_tokens == python_tokens
    assert native_logprobs == python_logprobs  # floats compared exactly
    assert all(len(t) == 10 for t in native_tokens.values())


@pytest.mark.parametrize("gemm_isa", ["avx2", "avx512", "portable"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_every_gemm_path_forced_gives_the_python_loops_bits(gemm_isa, quantization, monkeypatch):
    """The native loop on each packed-GEMM path this CPU runs, forced (an AVX512-BF16 CPU checks
    the AVX2 path too), against the Python loop on the same path."""
    from cython_ext import gemm as native_gemm

    if not native_gemm.isa_supported(gemm_isa):
        pytest.skip(f"gemm_isa {gemm_isa} not run by this CPU")
    config = tiny_config(dtype="bfloat16", quantization=quantization, gemm_isa=gemm_isa)
    native_tokens, native_logprobs, native_reason = _run(config, "native", monkeypatch)
    python_tokens, python_logprobs, _ = _run(config, "python", monkeypatch)
    assert native_reason is None
    assert (native_tokens, native_logprobs) == (python_tokens, python_logprobs)


def test_models_it_does_not_take_run_the_python_loop_and_say_why(monkeypatch, qwen_folders):
    float32 = load_model(tiny_config(dtype="float32"))
    assert decoder_loop.unsupported_reason(float32.model).startswith("linears not packed")
    runner = build_runner(float32, tiny_config(dtype="float32"))
    assert runner.compute["decoder_loop"].startswith("python (linears not packed")
    bf16 = tiny_config(dtype="bfloat16")
    assert start_runner(bf16).compute["decoder_loop"] == "native"
    qwen3 = ModelServiceConfig(model=qwen_folders["qwen3"], dtype="bfloat16", num_kv_blocks=64)
    assert decoder_loop.unsupported_reason(load_model(qwen3).model) == "per-head q/k norm"
    with pytest.raises(ValueError, match=r"decoder_loop: 'fastest' is not one of \('native', 'python'\)"):
        tiny_config(decoder_loop="fastest").validate()
    # The environment alias is read at start and validated as the flag's value would be.
    monkeypatch.setenv("PLANSERVE_DECODER_LOOP", "python")
    from model_service.__main__ import parse_args

    assert parse_args(["--model", "tiny"]).decoder_loop == "python"
    assert parse_args(["--model", "tiny", "--decoder-loop", "native"]).decoder_loop == "native"


def _one_step(model, slot: int):
    """A 3-token prompt of one sequence in block 1 at `slot` (a slot outside the cache when
    slot >= blocks * block_size)."""
    arch = model.arch
    cache = KVCache(
        arch.num_hidden_layers,
        4,
        16,
        arch.num_key_value_heads,
        arch.head_dim,
        torch.bfloat16,
        "cpu",
    )
    i64 = torch.int64
    meta = build_attention_metadata(
        torch.tensor([slot, slot + 1, slot + 2], dtype=i64),
        torch.tensor([0], dtype=i64),
        torch.tensor([3], dtype=i64),
        torch.tensor([3], dtype=i64),
        torch.tensor([[1]], dtype=i64),
        16,
        3,
        3,
    )
    return torch.tensor([5, 6, 7]), torch.arange(3), meta, cache


def test_bad_indices_and_inputs_are_refused_naming_what(monkeypatch):
    """An index outside the cache is refused before any layer writes (the kernels' own check,
    once per step), and inputs of the wrong kind name the input."""
    model = load_model(tiny_config(dtype="bfloat16")).model
    ids, positions, meta, cache = _one_step(model, 16)
    with torch.inference_mode():
        model(ids, positions, meta, cache, torch.tensor([2]))
        assert model.decoder_loop_reason is None
        native = model.native_layers(model.rope_table(torch.device("cpu")))
        residual = model.model.embed_tokens(ids).contiguous()
        ids, positions, meta, cache = _one_step(model, 4 * 16)
        with pytest.raises(
            ValueError, match="decoder loop, check_indices: slot_mapping entry outside the cache"
        ):
            native.run(residual, positions, meta, cache)
        with pytest.raises(ValueError, match=r"positions must be contiguous int64 \[3\]"):
            native.run(residual, positions.to(torch.int32), meta, cache)
        with pytest.raises(ValueError, match="residual must be contiguous bfloat16"):
            native.run(residual.float(), positions, meta, cache)
