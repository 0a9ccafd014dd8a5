"""LoRA adapters' loading and refusals (issue 35, the model service's side): the flags, Describe's
capacity, LoadAdapter / EvictAdapter on the runner with real PEFT folders saved by peft for the
tiny model, every bad input refused naming its key or tensor with nothing half-loaded, and a plan
naming an adapter that is not loaded failing like any bad plan."""
from __future__ import annotations

import argparse
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from config_fields import add_flags, from_args
from conftest import tiny_config
from lora_adapters import ALL_LINEAR, ATTENTION, edit_config, save_adapter
from model_service.batch import facts_to_pb, from_pb
from model_service.config import ModelServiceConfig
from model_service.loading.loader import load_model
from model_service.lora.peft_folder import AdapterError
from model_service.lora.targets import TARGET_MODULES
from model_service.start import build_runner
from model_service.step.plan import PlanError
from planserve.v1 import common_pb2, engine_pb2

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def adapter_dir(tiny_hf, tmp_path_factory):
    """One good rank-4 adapter (all linear targets) and one rank-16 attention-only adapter."""
    root = tmp_path_factory.mktemp("adapters")
    save_adapter(tiny_hf, str(root / "all4"), 4, ALL_LINEAR, seed=1)
    save_adapter(tiny_hf, str(root / "attn16"), 16, ATTENTION, seed=2, use_rslora=True)
    return root


def _runner(loaded, **overrides):
    return build_runner(loaded, tiny_config(enable_lora=True, **overrides))


def _copy(adapter_dir, tmp_path, name="all4"):
    folder = tmp_path / name
    shutil.copytree(adapter_dir / name, folder)
    return folder


def test_flags_and_validation():
    parser = argparse.ArgumentParser()
    add_flags(parser, ModelServiceConfig)
    config = from_args(ModelServiceConfig, parser.parse_args(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "8"]))
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (True, 4, 8, None)
    assert from_args(ModelServiceConfig, parser.parse_args(["--enable-lora", "false"])).enable_lora is False
    assert from_args(ModelServiceConfig, parser.parse_args([])).enable_lora is False
    # `planserve serve` passes the flags on as given: a boolean one spelled out, parsed back.
    from tools import cli

    serve = cli.build_parser().parse_args(["serve", "--model", "tiny", "--enable-lora", "--max-loras", "2"])
    argv = cli._model_service_argv(serve, "127.0.0.1", 0)
    assert argv[argv.index("--enable-lora") + 1] == "True"
    passed_on = from_args(ModelServiceConfig, parser.parse_args(argv[3:]))
    assert (passed_on.enable_lora, passed_on.max_loras) == (True, 2)
    unset = cli._model_service_argv(cli.build_parser().parse_args(["serve", "--model", "tiny"]), "127.0.0.1", 0)
    assert "--enable-lora" not in unset
    with pytest.raises(ValueError, match="enable_lora: .*--tensor-parallel-size 2"):
        ModelServiceConfig(model="tiny", enable_lora=True, tensor_parallel_size=2).validate()
    with pytest.raises(ValueError, match="max_cpu_loras: 2 must be >= max_loras 4"):
        ModelServiceConfig(model="tiny", enable_lora=True, max_loras=4, max_cpu_loras=2).validate()
    with pytest.raises(ValueError, match="max_lora_rank: 0 must be"):
        ModelServiceConfig(model="tiny", max_lora_rank=0).validate()
    with pytest.raises(ValueError, match="max_loras: 0 must be"):
        ModelServiceConfig(model="tiny", max_loras=0).validate()


def test_describe_reports_capacity_only_when_enabled(tiny_loaded):
    off = facts_to_pb(build_runner(tiny_loaded, tiny_config()).describe_facts())
    assert not off.HasField("lora") and "lora" not in off.compute
    on = facts_to_pb(_runner(tiny_loaded, max_loras=2, max_lora_rank=8).describe_facts())
    assert (on.lora.max_loras, on.lora.max_lora_rank, on.lora.max_cpu_loras) == (2, 8, 2)
    assert list(on.lora.target_modules) == list(TARGET_MODULES)
    assert on.compute["lora"].startswith("python layers for steps with adapter rows")


def test_load_keeps_weights_in_the_compute_dtype_and_evicts(tiny_loaded, adapter_dir):
    runner = _runner(tiny_loaded, max_cpu_loras=2)
    adapter = runner.load_adapter(1, "all4", str(adapter_dir / "all4"))
    assert adapter.rank == 4 and adapter.target_modules == tuple(TARGET_MODULES)
    assert adapter.scale == 16.0 / 4
    arch = tiny_loaded.arch
    # q, k and v fused as qkv_proj is: A stacked, B block-diagonal over their columns.
    [qkv] = adapter.layers[0]["qkv_proj"]
    assert (qkv.target, qkv.start, qkv.end) == ("q_proj+k_proj+v_proj", 0, 128)
    assert qkv.a.weight.shape == (12, 64) and qkv.b.weight.shape == (128, 12)
    assert qkv.a.weight.dtype == torch.float32
    file = load_file(str(adapter_dir / "all4" / WEIGHTS))
    k_b = file["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert torch.equal(qkv.b.weight[64:96, 4:8], k_b) and not qkv.b.weight[64:96, :4].any()
    assert torch.equal(qkv.a.weight[8:12], file["base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"])
    assert adapter.layers[1]["down_proj"][0].a.weight.shape == (4, arch.intermediate_size)
    stored = [p for layer in adapter.layers for pairs in layer.values() for p in pairs]
    assert adapter.num_bytes == sum(p.a.weight.nbytes + p.b.weight.nbytes for p in stored)
    rslora = runner.load_adapter(2, "attn16", str(adapter_dir / "attn16"))
    assert rslora.scale == pytest.approx(16.0 / 4.0)  # alpha / sqrt(16)
    assert rslora.target_modules == tuple(ATTENTION) and rslora.layers[0]["gate_up_proj"] == []
    runner.evict_adapter(1)
    assert set(runner.adapters.snapshot()) == {2}
    with pytest.raises(AdapterError) as error:
        runner.evict_adapter(1)
    assert error.value.code == "NOT_FOUND" and "lora_id: 1" in error.value.message


def test_bfloat16_model_keeps_bfloat16_weights(adapter_dir):
    loaded = load_model(tiny_config(dtype="bfloat16"))
    runner = build_runner(loaded, tiny_config(dtype="bfloat16", enable_lora=True))
    adapter = runner.load_adapter(3, "all4", str(adapter_dir / "all4"))
    assert {p.b.weight.dtype for layer in adapter.layers for pairs in layer.values() for p in pairs} == {torch.bfloat16}


def _bad_config(key, value):
    return lambda folder: edit_config(folder, **{key: value})


def _bad_tensor(mutate):
    def apply(folder):
        tensors = load_file(str(folder / WEIGHTS))
        mutate(tensors)
        save_file(tensors, str(folder / WEIGHTS))
    return apply


def _pickled_only(folder):
    os.rename(folder / WEIGHTS, folder / "adapter_model.bin")


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
BAD_FOLDERS = [
    ("rank", _bad_config("r", 32), "INVALID_ARGUMENT", "r: 32 exceeds --max-lora-rank 16"),
    ("dora", _bad_config("use_dora", True), "INVALID_ARGUMENT", "use_dora:"),
    ("modules_to_save", _bad_config("modules_to_save", ["lm_head"]), "INVALID_ARGUMENT", "modules_to_save:"),
    ("rank_pattern", _bad_config("rank_pattern", {"q_proj": 8}), "INVALID_ARGUMENT", "rank_pattern:"),
    ("alpha_pattern", _bad_config("alpha_pattern", {"q_proj": 8}), "INVALID_ARGUMENT", "alpha_pattern:"),
    ("bias", _bad_config("bias", "all"), "INVALID_ARGUMENT", "bias: 'all'"),
    ("lm_head target", _bad_config("target_modules", ["q_proj", "lm_head"]), "INVALID_ARGUMENT", "target_modules: 'lm_head'"),
    ("unknown target", _bad_config("target_modules", ["q_proj", "w1"]), "INVALID_ARGUMENT", "target_modules: 'w1'"),
    ("peft type", _bad_config("peft_type", "IA3"), "INVALID_ARGUMENT", "peft_type:"),
    ("pickled", _pickled_only, "INVALID_ARGUMENT", "adapter_model.bin: pickled weights are not read"),
    ("no weights", lambda f: os.remove(f / WEIGHTS), "NOT_FOUND", "holds no adapter_model.safetensors"),
    ("no config", lambda f: os.remove(f / "adapter_config.json"), "NOT_FOUND", "holds no adapter_config.json"),
    ("bad json", lambda f: (f / "adapter_config.json").write_text("{"), "INVALID_ARGUMENT", "adapter_config.json: unreadable"),
    ("truncated file", lambda f: (f / WEIGHTS).write_bytes((f / WEIGHTS).read_bytes()[:100]), "INVALID_ARGUMENT",
     "adapter_model.safetensors: unreadable"),
    ("shape", _bad_tensor(lambda t: t.update({Q_A: torch.zeros(4, 32)})), "INVALID_ARGUMENT",
     f"{Q_A}: shape [4, 32] does not match the model's [4, 64]"),
    ("missing B", _bad_tensor(lambda t: t.pop(Q_A.replace("lora_A", "lora_B"))), "INVALID_ARGUMENT",
     f"{Q_A}: its lora_B weight is missing"),
    ("embed target", _bad_tensor(lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 10)})),
     "INVALID_ARGUMENT", "base_model.model.model.embed_tokens.lora_embedding_A: targets embed_tokens"),
    ("layer beyond", _bad_tensor(lambda t: t.update({Q_A.replace("layers.0", "layers.7"): torch.zeros(4, 64),
                                                       Q_A.replace("layers.0", "layers.7").replace("lora_A", "lora_B"): torch.zeros(64, 4)})),
     "INVALID_ARGUMENT", "layer 7 is beyond the model's 2"),
    ("dora magnitude", _bad_tensor(lambda t: t.update({"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.zeros(64)})),
     "INVALID_ARGUMENT", "lora_magnitude_vector: not a LoRA A/B weight"),
]


@pytest.mark.parametrize("name,spoil,code,message", BAD_FOLDERS, ids=[b[0] for b in BAD_FOLDERS])
def test_bad_folder_is_refused_naming_the_key_and_nothing_is_kept(tiny_loaded, adapter_dir, tmp_path, name, spoil, code,
                                                                   message):
    runner = _runner(tiny_loaded)
    folder = _copy(adapter_dir, tmp_path)
    spoil(folder)
    with pytest.raises(AdapterError) as error:
        runner.load_adapter(1, "spoiled", str(folder))
    assert error.value.code == code and message in error.value.message, error.value.message
    assert runner.adapters.snapshot() == {}
    # The id and the capacity are free again: the good adapter loads under it.
    assert runner.load_adapter(1, "good", str(adapter_dir / "all4")).rank == 4


def test_ids_capacity_and_disabled(tiny_loaded, adapter_dir):
    runner = _runner(tiny_loaded, max_loras=1, max_cpu_loras=2)
    good = str(adapter_dir / "all4")
    with pytest.raises(AdapterError) as error:
        runner.load_adapter(1, "x", "/nonexistent/adapter")
    assert error.value.code == "NOT_FOUND" and "lora_path:" in error.value.message
    with pytest.raises(AdapterError) as error:
        runner.load_adapter(0, "x", good)
    assert error.value.code == "INVALID_ARGUMENT" and error.value.message.startswith("lora_id: 0")
    runner.load_adapter(1, "a", good)
    with pytest.raises(AdapterError) as error:
        runner.load_adapter(1, "a", good)
    assert error.value.code == "ALREADY_EXISTS"
    runner.load_adapter(2, "b", good)
    with pytest.raises(AdapterError) as error:
        runner.load_adapter(3, "c", good)
    assert error.value.code == "RESOURCE_EXHAUSTED" and "--max-cpu-loras 2" in error.value.message
    assert set(runner.adapters.snapshot()) == {1, 2}
    off = build_runner(tiny_loaded, tiny_config())
    for call in (lambda: off.load_adapter(1, "a", good), lambda: off.evict_adapter(1)):
        with pytest.raises(AdapterError) as error:
            call()
        assert error.value.code == "FAILED_PRECONDITION" and "--enable-lora" in error.value.message


def _new(slot, lora_id=0, tokens=(5, 6, 7)):
    return engine_pb2.NewSequence(slot=slot, token_ids=list(tokens), lora_id=lora_id,
                                  sampling=common_pb2.SamplingParams(seed=1, temperature=0.0))


def _plan(step_id=0, **fields):
    return engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(step_id=step_id, **fields))


def _state(runner):
    t = runner.slot_table
    return t.active.copy(), t.lora_id.copy(), t.num_computed.copy()


@pytest.mark.parametrize("case,field,message", [
    ("unknown", "new_sequences[0].lora_id", "adapter 9 is not loaded"),
    ("disabled", "new_sequences[0].lora_id", "LoRA is not enabled"),
    ("too many", "slots", "2 distinct adapters exceed max_loras 1"),
    ("evicted", "slots", "slot 0 runs adapter 1, which is not loaded"),
])
def test_plans_naming_bad_adapters_fail_and_change_nothing(tiny_loaded, adapter_dir, case, field, message):
    runner = _runner(tiny_loaded, max_loras=1, max_cpu_loras=2) if case != "disabled" else build_runner(tiny_loaded, tiny_config())
    if case != "disabled":
        runner.load_adapter(1, "a", str(adapter_dir / "all4"))
        runner.load_adapter(2, "b", str(adapter_dir / "all4"))
    first = _plan(0, new_sequences=[_new(0, lora_id=1 if case in ("too many", "evicted") else 0)], slots=[0],
                  num_scheduled_tokens=[3], num_new_blocks=[1], new_block_ids=[1])
    runner.execute(from_pb(first, runner.limits))
    if case == "evicted":
        runner.evict_adapter(1)
    bad = {
        "unknown": _plan(1, new_sequences=[_new(1, lora_id=9)]),
        "disabled": _plan(1, new_sequences=[_new(1, lora_id=1)]),
        "too many": _plan(1, new_sequences=[_new(1, lora_id=2)], slots=[0, 1], num_scheduled_tokens=[1, 3],
                          num_new_blocks=[0, 1], new_block_ids=[2]),
        "evicted": _plan(1, slots=[0], num_scheduled_tokens=[1], num_new_blocks=[0]),
    }[case]
    before = _state(runner)
    with pytest.raises(PlanError) as error:
        runner.execute(from_pb(bad, runner.limits))
    assert error.value.field == field and message in error.value.message, str(error.value)
    assert all(np.array_equal(a, b) for a, b in zip(before, _state(runner)))


def test_null_model_checks_folders_and_accepts_lora_ids(adapter_dir, tmp_path):
    config = ModelServiceConfig(model="null", enable_lora=True, max_loras=2, max_num_slots=8)
    runner = build_runner(load_model(config), config)
    adapter = runner.load_adapter(1, "all4", str(adapter_dir / "all4"))
    assert adapter.rank == 4 and adapter.num_bytes == 0 and adapter.layers == []  # no weights held
    assert adapter.target_modules == tuple(TARGET_MODULES)
    spoiled = _copy(adapter_dir, tmp_path)
    edit_config(spoiled, use_dora=True)
    with pytest.raises(AdapterError, match="use_dora"):
        runner.load_adapter(2, "dora", str(spoiled))
    plan = _plan(0, new_sequences=[_new(0, lora_id=1), _new(1)], slots=[0, 1], num_scheduled_tokens=[3, 3],
                 num_new_blocks=[1, 1], new_block_ids=[1, 2])
    out = runner.execute(from_pb(plan, runner.limits))
    assert list(out.num_sampled_tokens) == [1, 1]
    assert out.sampled_token_ids[0] == out.sampled_token_ids[1]  # the null model ignores adapters
    assert facts_to_pb(runner.describe_facts()).lora.max_loras == 2
    runner.evict_adapter(1)
    assert runner.adapters.snapshot() == {}
