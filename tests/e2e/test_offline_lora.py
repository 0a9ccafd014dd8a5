"""LoRA adapters in the offline API (docs/lora.md, "Offline"): `LLM(enable_lora=True, ...)` and
`generate(..., lora_request=LoRARequest(name, id, path))` run the served path's registry, admission
and loader in one process, so an adapter's greedy tokens equal a real model service's behind a real
scheduler (--lora-modules) in the default dtype, bitwise, and float32's equal transformers + peft's
(parity's dtype). Adapters are random PEFT folders made with peft on the tiny model's shapes."""
from __future__ import annotations

import pytest

import dtypes
from api import complete, stub_for
from conftest import EngineProcess, start_scheduler
from lora_adapters import ALL_LINEAR, ATTENTION, save_adapter
from planserve.v1 import generate_pb2

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """a1 (attention, rank 4), a2 (all linear, rank 8), big (rank 32: over the default bound 16),
    and the unmerged peft model of a1 (float32)."""
    from model_service.config import ModelServiceConfig
    from model_service.loading.loader import load_model
    from reference import hf_llama_from_loaded

    reference = hf_llama_from_loaded(load_model(ModelServiceConfig(model="tiny", dtype="float32")))
    root = tmp_path_factory.mktemp("offline_lora")
    peft_a1 = save_adapter(reference, str(root / "a1"), 4, ATTENTION, seed=1)
    save_adapter(reference, str(root / "a2"), 8, ALL_LINEAR, seed=2)
    save_adapter(reference, str(root / "big"), 32, ATTENTION, seed=3)
    return root, peft_a1


@pytest.fixture(scope="module")
def llm():
    """The default dtype; one place per step for two adapters loaded, so that a mixed call parks
    the adapters in turn (and a third adapter evicts one)."""
    from planserve import LLM

    return LLM(model="tiny", dtype=dtypes.DEFAULT, num_kv_blocks=64, enable_lora=True,
               max_loras=1, max_cpu_loras=2, scheduler_options={"max_num_seqs": 8})


def _params():
    from planserve import SamplingParams

    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _lora(root, name: str, int_id: int):
    from planserve import LoRARequest

    return LoRARequest(name, int_id, str(root / name))


async def test_adapters_equal_the_served_paths_and_move_the_tokens(llm, folders):
    root, _ = folders
    engine = EngineProcess(
        "--model", "tiny", "--dtype", dtypes.DEFAULT, "--num-kv-blocks", "64",
        "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2",
    )  # fmt: skip
    server = await start_scheduler(
        engine.address, max_num_seqs=8, lora_modules=(f"a1={root / 'a1'}", f"a2={root / 'a2'}")
    )
    try:
        stub = stub_for(server)
        tokens = {}
        for name in ("", "a1", "a2"):
            lora = _lora(root, name, {"a1": 1, "a2": 2}[name]) if name else None
            results = llm.generate(PROMPTS, _params(), lora_request=lora)
            tokens[name] = [r.token_ids for r in results]
            for prompt, result in zip(PROMPTS, results):
                request = generate_pb2.GenerateRequest(text=prompt, lora_name=name)
                request.sampling.temperature = 0
                request.stopping.max_new_tokens = NEW_TOKENS
                request.stopping.ignore_eos = True
                assert result.token_ids == (await complete(stub, request)).token_ids, name
    finally:
        await server.stop(grace_s=1)
        engine.stop()
    # Each adapter moves every prompt's tokens away from the base model's and the other's.
    for i in range(len(PROMPTS)):
        assert len({tuple(tokens[name][i]) for name in tokens}) == 3, i


def test_mixed_lora_requests_each_equal_themselves_alone(llm, folders):
    root, _ = folders
    a1, a2 = _lora(root, "a1", 1), _lora(root, "a2", 2)
    loras = [a1, a2, None, a2, a1, None]
    prompts = PROMPTS + PROMPTS[::-1]
    parked = llm.scheduler.loras.turns.num_parked_total
    mixed = llm.generate(prompts, _params(), lora_request=loras)
    assert llm.scheduler.loras.turns.num_parked_total > parked  # adapters took turns
    for prompt, lora, result in zip(prompts, loras, mixed):
        [alone] = llm.generate(prompt, _params(), lora_request=lora)
        assert result.token_ids == alone.token_ids, (prompt, lora)
        assert result.finish_reason == "length"
    # chat() takes the same argument.
    messages = [{"role": "user", "content": "Name a colour."}]
    [chat] = llm.chat(messages, _params(), lora_request=a2)
    [chat_base] = llm.chat(messages, _params())
    assert chat.token_ids != chat_base.token_ids


def test_float32_adapter_tokens_equal_peft(folders):
    from planserve import LLM
    from reference import compare_up_to_near_tie, greedy_reference

    root, peft_a1 = folders
    llm = LLM(model="tiny", dtype="float32", num_kv_blocks=64, enable_lora=True)
    results = llm.generate(PROMPTS, _params(), lora_request=_lora(root, "a1", 7))
    for result in results:
        expected, gaps = greedy_reference(peft_a1, result.prompt_token_ids, NEW_TOKENS)
        assert compare_up_to_near_tie(result.token_ids, expected, gaps) >= NEW_TOKENS // 2


def test_bad_lora_requests_are_refused_naming_the_field(llm, folders):
    from planserve import LLM, LoRARequest

    root, _ = folders
    a1, a2 = _lora(root, "a1", 1), _lora(root, "a2", 2)
    [before] = llm.generate(PROMPTS[0], _params(), lora_request=a2)
    llm.generate(PROMPTS[0], _params(), lora_request=a1)  # a2 is now the idle one to evict
    free, names = llm.scheduler.kv.num_free_blocks, dict(llm.adapters.registry.adapters)
    refused = [
        (_lora(root, "big", 3), "lora_request.lora_path: .*r: 32 exceeds --max-lora-rank 16"),
        (LoRARequest("nope", 4, str(root / "nope")), "lora_request.lora_path: .*not a folder"),
        (LoRARequest("x", 4, ""), "lora_request.lora_path: must not be empty"),
        (LoRARequest("a/b", 4, str(root / "a2")), "lora_request.lora_name: .*outside"),
        (LoRARequest("x" * 65, 4, str(root / "a2")), "lora_request.lora_name: at most 64"),
        (LoRARequest(llm.facts.model_name, 4, str(root / "a2")), "lora_request.lora_name: .*base"),
        (LoRARequest("a1", 1, str(root / "a2")), "lora_request.lora_path: .*is loaded from"),
        (LoRARequest("a1", 5, str(root / "a1")), "lora_request.lora_int_id: adapter 'a1' has id 1"),
        (LoRARequest("other", 1, str(root / "a2")), "lora_request.lora_int_id: 1 already names"),
        ([a1, None], "lora_request: 2 for 3 prompts"),
        (["a1", None, None], "lora_request: a LoRARequest or None"),
        ([None, {"lora_name": "a1"}, None], "lora_request: a LoRARequest or None, got dict"),
    ]
    for lora, message in refused:
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS, _params(), lora_request=lora)
        # Nothing half-loaded: no registry entry, no load in flight, nothing queued or held.
        assert llm.adapters.registry.adapters == names and not llm.scheduler.loras.loading
        assert not llm.scheduler.has_work() and llm.scheduler.kv.num_free_blocks == free
    with pytest.raises(ValueError, match="lora_int_id: must be an int > 0"):
        LoRARequest("a1", 0, str(root / "a1"))
    # Loading `big` evicted a2 (max_cpu_loras 2) before its refusal: a2 loads again at first use.
    assert "a2" not in llm.scheduler.loras.resident
    [again] = llm.generate(PROMPTS[0], _params(), lora_request=a2)
    assert again.token_ids == before.token_ids and "a2" in llm.scheduler.loras.resident

    base = LLM(model="tiny", dtype=dtypes.DEFAULT, num_kv_blocks=16)
    with pytest.raises(ValueError, match="lora_request: .*LoRA is not enabled .*enable_lora=True"):
        base.generate(PROMPTS, _params(), lora_request=a1)
    with pytest.raises(ValueError, match="max_loras"):
        LLM(model="tiny", enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras: 1 must be >= max_loras 2"):
        LLM(model="tiny", enable_lora=True, max_loras=2, max_cpu_loras=1)
