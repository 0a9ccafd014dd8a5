"""LoRA adapters inside the native decoder loop (csrc/decoder.cpp, a bf16 model on the CPU: the
default dtype here). The loop runs each row against its own adapter's blocks only
(csrc/lora_rows.h) in the arithmetic of the packed GEMMs lora/stacked.py calls, so the claim is
exact equality: a mixed batch of sequences on three adapters (ranks 4, 16 and an odd 7;
all-linear and attention-only targets) and on the base model, chunked prefills and decodes, gives
bit for bit the Python loop's tokens and logprobs, on the tiny model and on SmolLM2; and a step
with adapter rows really runs in the native loop (the Python layers are never called)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import tiny_config
from lora_adapters import ALL_LINEAR, ATTENTION, save_adapter
from ms_driver import Driver

from model_service.config import ModelServiceConfig
from model_service.kernels import gemm
from model_service.loading.loader import load_model
from model_service.models.llama import LlamaDecoderLayer
from model_service.start import build_runner

pytestmark = pytest.mark.skipif(
    gemm.resolve_isa() == gemm.TORCH_PATH,
    reason="no packed GEMM path on this CPU: the Python loop is all there is",
)

ADAPTERS = [(4, ALL_LINEAR), (16, ATTENTION), (7, ALL_LINEAR)]  # lora_id 1, 2, 3
LORA_OF_SLOT = {0: 1, 1: 2, 2: 0, 3: 3, 4: 1}


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 1000, size=length).tolist()


PROMPTS = {
    0: _prompt(40, 1),
    1: _prompt(5, 2),
    2: _prompt(17, 3),
    3: _prompt(9, 4),
    4: _prompt(23, 5),
}


def _folders(reference, root) -> list[str]:
    folders = []
    for lora_id, (rank, targets) in enumerate(ADAPTERS, start=1):
        folder = str(root / f"a{lora_id}")
        save_adapter(reference, folder, rank, targets, seed=lora_id)
        folders.append(folder)
    return folders


def _run(config: ModelServiceConfig, folders: list[str], loop: str):
    config = dataclasses.replace(config, decoder_loop=loop, enable_lora=True, max_loras=3)
    loaded = load_model(config)
    runner = build_runner(loaded, config)
    for lora_id, folder in enumerate(folders, start=1):
        runner.load_adapter(lora_id, f"a{lora_id}", folder)
    driver = Driver(runner)
    for slot in (0, 1, 2, 3):
        driver.add(slot, PROMPTS[slot], with_logprobs=True, lora_id=LORA_OF_SLOT[slot])
    tokens = driver.run_to_completion(
        8, chunk=16, joins={3: [(4, PROMPTS[4])]}, with_logprobs=True, lora_ids=LORA_OF_SLOT
    )
    return tokens, driver.logprobs, runner


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_native_loop_with_adapters_gives_the_python_loops_bits(
    model, tiny_hf, tmp_path, monkeypatch
):
    if model == "smollm2":
        from reference import hf_llama_from_loaded

        config = ModelServiceConfig(
            model="smollm2", dtype="bfloat16", num_kv_blocks=128, max_num_slots=8
        )
        reference = hf_llama_from_loaded(load_model(dataclasses.replace(config, dtype="float32")))
        folders = _folders(reference, tmp_path)
        del reference
    else:
        config = tiny_config(dtype="bfloat16")
        folders = _folders(tiny_hf, tmp_path)
    python_tokens, python_logprobs, _ = _run(config, folders, "python")

    def refuse(*args, **kwargs):
        raise AssertionError("the Python layers ran a step the native loop should have")

    monkeypatch.setattr(LlamaDecoderLayer, "forward", refuse)
    native_tokens, native_logprobs, runner = _run(config, folders, "native")
    assert runner.model.decoder_loop_reason is None
    assert runner.compute["lora"].startswith("native decoder loop")
    assert native_tokens == python_tokens
    for slot in PROMPTS:
        assert np.array_equal(
            np.float32(native_logprobs[slot]), np.float32(python_logprobs[slot])
        ), slot
    # the adapters changed the outputs: a sequence on an adapter differs from the base model's
    assert len({tuple(t) for t in native_tokens.values()}) == len(PROMPTS)
