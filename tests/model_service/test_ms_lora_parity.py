"""LoRA parity with transformers + peft (issue 35): random adapters saved by peft for the tiny
model (attention-only and all linear targets, ranks 4 and 16, one with use_rslora) and one for
SmolLM2; planserve's float32 greedy tokens and logprobs equal peft's unmerged model's and its
merged model's (float32: parity's dtype; logprobs within 1e-4, the bound the family parity tests
use), in a mixed batch with a base-model sequence checked against transformers alone. bfloat16
(the default dtype on this CPU class) is checked as the families' bf16 test checks it: as close to
peft's float32 as peft's own bf16 forward is."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import tiny_config
from lora_adapters import ALL_LINEAR, ATTENTION, merged, save_adapter
from ms_driver import Driver
from model_service.config import ModelServiceConfig
from model_service.loading.loader import load_model
from model_service.start import build_runner
from reference import compare_up_to_near_tie, greedy_reference, hf_llama_from_loaded, reference_logprobs

NEW_TOKENS = 24
MIN_COMPARED = 16


def _prompt(length: int, seed: int, vocab: int = 49152) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=length).tolist()


PROMPTS = {0: _prompt(37, 1), 1: _prompt(5, 2), 2: _prompt(20, 3)}
LORA_OF_SLOT = {0: 1, 1: 1, 2: 0}  # slot 2 runs the base model in the same steps
GRID = [
    pytest.param(4, ATTENTION, False, id="attention-r4"),
    pytest.param(16, ATTENTION, True, id="attention-r16-rslora"),
    pytest.param(4, ALL_LINEAR, False, id="all-linear-r4"),
    pytest.param(16, ALL_LINEAR, False, id="all-linear-r16"),
]


def _run(loaded, config, folder, prompts=PROMPTS, lora_of_slot=LORA_OF_SLOT, new_tokens=NEW_TOKENS):
    runner = build_runner(loaded, config)
    runner.load_adapter(1, "adapter", folder)
    driver = Driver(runner)
    first, *later = sorted(prompts)
    driver.add(first, prompts[first], with_logprobs=True, lora_id=lora_of_slot[first])
    # The others join at step 1, packed with the first one's prefill chunks.
    joins = {1: [(slot, prompts[slot]) for slot in later]}
    out = driver.run_to_completion(new_tokens, chunk=16, joins=joins, with_logprobs=True, lora_ids=lora_of_slot)
    return out, driver.logprobs


def _assert_parity(out, logprobs, references: dict[int, list], prompts=PROMPTS, min_compared=MIN_COMPARED):
    """Each slot's tokens and logprobs against every reference model of its slot."""
    for slot, prompt in prompts.items():
        for reference in references[slot]:
            ref, gaps = greedy_reference(reference, prompt, len(out[slot]))
            n = compare_up_to_near_tie(out[slot], ref, gaps)
            assert n >= min_compared, (slot, n)
            expected = reference_logprobs(reference, prompt + ref[:n])
            for i in range(n):
                ours, theirs = logprobs[slot][i], float(expected[len(prompt) - 1 + i, ref[i]])
                assert abs(ours - theirs) < 1e-4, (slot, i, ours, theirs)


@pytest.mark.parametrize("rank,targets,rslora", GRID)
def test_float32_matches_peft_unmerged_and_merged(tiny_loaded, tiny_hf, tmp_path, rank, targets, rslora):
    folder = str(tmp_path / "adapter")
    unmerged = save_adapter(tiny_hf, folder, rank, targets, seed=rank + len(targets), use_rslora=rslora)
    out, logprobs = _run(tiny_loaded, tiny_config(enable_lora=True), folder)
    adapted = [unmerged, merged(unmerged)]
    _assert_parity(out, logprobs, {0: adapted, 1: adapted, 2: [tiny_hf]})
    base, _ = greedy_reference(tiny_hf, PROMPTS[0], NEW_TOKENS)
    assert out[0] != base  # the adapter moves the tokens (the parity above is not the base's)


def test_bfloat16_is_as_close_to_peft_as_peft_bf16(tiny_hf, tmp_path):
    """bf16 moves this random model's logits by tenths (peft's bf16 forward as much); over the
    tokens ours samples, the mean logprob distance from peft's float32 is at most 1.5x peft's own
    bf16 distance over the same tokens, plus 0.02 (the families' bf16 rule). An adapter left out
    or applied at the wrong columns moves it by whole units."""
    folder = str(tmp_path / "adapter")
    unmerged = save_adapter(tiny_hf, folder, 16, ALL_LINEAR, seed=7)
    # A bf16 copy (the session's reference model stays float32: .to() converts in place).
    unmerged_bf16 = save_adapter(copy.deepcopy(tiny_hf).to(torch.bfloat16), str(tmp_path / "bf16"), 16, ALL_LINEAR,
                                 seed=7)
    config = tiny_config(dtype="bfloat16", enable_lora=True)
    out, logprobs = _run(load_model(config), config, folder)
    ours, theirs = [], []
    for slot in (0, 1):
        prompt, tokens = PROMPTS[slot], out[slot][:16]
        expected, peft_bf16 = (reference_logprobs(m, prompt + tokens) for m in (unmerged, unmerged_bf16))
        for i, token in enumerate(tokens):
            row = len(prompt) - 1 + i
            ours.append(abs(logprobs[slot][i] - float(expected[row, token])))
            theirs.append(abs(float(peft_bf16[row, token]) - float(expected[row, token])))
    ours_mean, theirs_mean = sum(ours) / len(ours), sum(theirs) / len(theirs)
    print(f"\nLoRA bf16: mean logprob distance from peft float32: ours {ours_mean:.3f}, peft bf16 {theirs_mean:.3f}")
    assert ours_mean <= 1.5 * theirs_mean + 0.02, (ours_mean, theirs_mean)


def test_smollm2_float32_matches_peft(tmp_path):
    """SmolLM2-135M, all linear targets, rank 16 (16 s at load 1.5; minutes when the 2 cores are
    shared at load 4-9)."""
    config = ModelServiceConfig(model="smollm2", dtype="float32", num_kv_blocks=256, max_num_slots=8, enable_lora=True)
    loaded = load_model(config)
    reference = hf_llama_from_loaded(loaded)
    folder = str(tmp_path / "adapter")
    unmerged = save_adapter(reference, folder, 16, ALL_LINEAR, seed=11)
    prompts = {0: _prompt(24, 21, 49152), 1: _prompt(9, 22, 49152)}
    out, logprobs = _run(loaded, config, folder, prompts, {0: 1, 1: 0}, new_tokens=12)
    _assert_parity(out, logprobs, {0: [unmerged, merged(unmerged)], 1: [reference]}, prompts, min_compared=8)
    # The adapter moves the logprobs (the parity above is not the base model's).
    base = reference_logprobs(reference, prompts[0] + out[0])
    moved = [abs(logprobs[0][i] - float(base[len(prompts[0]) - 1 + i, t])) for i, t in enumerate(out[0])]
    assert max(moved) > 0.01, moved
