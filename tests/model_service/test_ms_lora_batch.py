"""LoRA and batch invariance (issue 35): sequences on two adapters and on the base model, in one
batch, each give bit for bit the tokens and logprobs they give alone, in float32 and in bfloat16
(the default dtype here, where every step runs the native decoder loop, the adapters' products
stacked inside it); speculation on adapter rows emits the plain greedy tokens;
a step without adapter rows takes the base path untouched."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_config
from lora_adapters import ALL_LINEAR, ATTENTION, save_adapter
from ms_driver import Driver
from model_service.loading.loader import load_model
from model_service.start import build_runner
from test_ms_speculative import ScriptedDrafter, _generate


@pytest.fixture(scope="module")
def adapters(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    save_adapter(tiny_hf, str(root / "a"), 4, ALL_LINEAR, seed=1)
    save_adapter(tiny_hf, str(root / "b"), 16, ATTENTION, seed=2)
    return str(root / "a"), str(root / "b")


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 49152, size=length).tolist()


PROMPTS = {0: _prompt(40, 1), 1: _prompt(5, 2), 2: _prompt(17, 3), 3: _prompt(9, 4)}
LORA_OF_SLOT = {0: 1, 1: 2, 2: 0, 3: 1}


def _runner(loaded, dtype, adapters):
    runner = build_runner(loaded, tiny_config(dtype=dtype, enable_lora=True, max_loras=2))
    for lora_id, folder in enumerate(adapters, start=1):
        runner.load_adapter(lora_id, f"adapter{lora_id}", folder)
    return runner


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_each_sequence_equals_itself_alone_bitwise(adapters, dtype):
    loaded = load_model(tiny_config(dtype=dtype))

    def run(slots):
        driver = Driver(_runner(loaded, dtype, adapters))
        for slot in slots:
            driver.add(slot, PROMPTS[slot], with_logprobs=True, lora_id=LORA_OF_SLOT[slot])
        return driver.run_to_completion(12, chunk=16), driver.logprobs

    together, logprobs = run(list(PROMPTS))
    for slot in PROMPTS:
        alone, alone_logprobs = run([slot])
        assert together[slot] == alone[slot], slot
        assert np.array_equal(np.float32(logprobs[slot]), np.float32(alone_logprobs[slot])), slot
    assert together[0] != together[3] or PROMPTS[0] == PROMPTS[3]  # distinct prompts, distinct outputs


def test_speculation_on_adapter_rows_emits_the_plain_greedy_tokens(tiny_loaded, adapters):
    """Adapter rows speculate like base rows: the target, adapter applied to the drafted rows
    too, verifies each draft, so the output is the plain greedy output."""
    prompts = [list(range(300, 320)), list(range(1000, 1037)), [7] * 9]
    lora_of_slot = {0: 1, 1: 0, 2: 2}

    def with_adapters(runner):
        execute = runner.execute

        def run(plan):
            for seq in plan.new_sequences:
                seq.lora_id = lora_of_slot[seq.slot]
            return execute(plan)

        runner.execute = run
        return runner

    plain = _generate(with_adapters(_runner(tiny_loaded, "float32", adapters)), prompts, 16, lookahead=0)
    config = tiny_config(enable_lora=True, max_loras=2, speculative_method="ngram", num_speculative_tokens=3)
    runner = build_runner(tiny_loaded, config)
    for lora_id, folder in enumerate(adapters, start=1):
        runner.load_adapter(lora_id, f"adapter{lora_id}", folder)
    runner.speculation.drafter = ScriptedDrafter({tuple(p): p + out for p, out in zip(prompts, plain)}, wrong_every=3)
    assert _generate(with_adapters(runner), prompts, 16, lookahead=3) == plain
    assert runner.speculation.drafter.calls > 0
    base = _generate(build_runner(tiny_loaded, tiny_config()), prompts, 16, lookahead=0)
    assert base[1] == plain[1] and base[0] != plain[0]  # the adapters apply where named only


def test_a_step_without_adapter_rows_builds_no_grouping(tiny_loaded, adapters, monkeypatch):
    from model_service.lora import grouping

    built = []
    original = grouping.group_rows
    monkeypatch.setattr(grouping, "group_rows", lambda *a: built.append(original(*a)) or built[-1])
    driver = Driver(_runner(tiny_loaded, "float32", adapters))
    driver.add(0, PROMPTS[0])
    driver.step({0: 40})
    driver.add(1, PROMPTS[1], lora_id=2)
    driver.step({0: 1, 1: 5})
    assert built[0] is None
    assert [int(g.adapter.lora_id) for g in built[1].groups] == [2]
    assert built[1].groups[0].rows.tolist() == [1, 2, 3, 4, 5]  # slot 1's rows, after slot 0's one
