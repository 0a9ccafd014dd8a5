"""Config validation, bfloat16 smoke, and the `python -m model_service` port line."""
from __future__ import annotations

import os
import subprocess
import sys

import grpc
import torch
import pytest

from conftest import tiny_config
from model_service import cpu_bf16
from model_service.config import ModelServiceConfig
from model_service.loading.loader import load_model
from model_service.start import build_runner, start_runner
from ms_driver import Driver
from planserve.v1 import engine_pb2, engine_pb2_grpc


@pytest.mark.parametrize(
    "field,value",
    [("model", "llama"), ("dtype", "float64"), ("quantization", "int4"), ("device", "tpu"), ("port", 70000), ("block_size", 0),
     ("num_kv_blocks", 1), ("max_num_slots", 0), ("max_model_len", 0)],
)
def test_validate_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ModelServiceConfig(**{field: value}).validate()


def test_kv_blocks_derived_from_memory(tiny_loaded):
    runner = build_runner(tiny_loaded, tiny_config(num_kv_blocks=None, kv_cache_memory_bytes=8 << 20))
    # tiny: 2 layers * 16 tokens * 2 kv heads * 16 dims * 4 bytes * (K and V) = 8 KiB per block
    assert runner.limits.num_kv_blocks == (8 << 20) // 8192


def test_bfloat16_runs():
    config = tiny_config(dtype="bfloat16")
    driver = Driver(start_runner(config))
    driver.add(0, list(range(100, 140)))
    out = driver.run_to_completion(5, chunk=16)
    assert len(out[0]) == 5 and all(0 <= t < 49152 for t in out[0])


def test_float16_greedy_equals_float32():
    """--dtype float16 (for GPUs without bf16) serves the tiny model on the CPU through torch's
    kernels: the first 16 greedy tokens of each prompt equal float32's (float16 keeps 3 more
    mantissa bits than bf16), in a batch of three with chunked prefill."""
    prompts = {0: list(range(100, 170)), 1: list(range(3000, 3009)), 2: list(range(7000, 7023))}
    outputs = {}
    for dtype in ("float32", "float16"):
        config = tiny_config(dtype=dtype)
        loaded = load_model(config)
        assert next(loaded.model.parameters()).dtype == getattr(torch, dtype)
        driver = Driver(build_runner(loaded, config))
        for slot, prompt in prompts.items():
            driver.add(slot, prompt)
        outputs[dtype] = driver.run_to_completion(16, chunk=32)
    assert outputs["float16"] == outputs["float32"]


def test_cli_prints_port_and_serves():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    process = subprocess.Popen(
        [sys.executable, "-m", "model_service", "--model", "tiny", "--port", "0", "--num-kv-blocks", "32", "--max-num-slots", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("PLANSERVE_ENGINE_PORT="), line
        port = int(line.strip().split("=")[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            facts = engine_pb2_grpc.EngineServiceStub(channel).Describe(engine_pb2.DescribeRequest(), timeout=10)
        assert (facts.num_kv_blocks, facts.max_num_slots) == (32, 4)
    finally:
        process.terminate()
        assert process.wait(timeout=15) == 0


def test_auto_dtype_resolves_and_describe_reports_it(monkeypatch):
    """auto is bfloat16 where bf16 is native or the packed GEMM takes bf16 linears on a vector
    path (AVX2 and AVX-512F widen the weights to float32 in registers), float32 where bf16 would
    run torch's GEMM without native bf16 (issue 33)."""
    from model_service import config as config_module
    from model_service.kernels import gemm

    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: False)
    for gemm_isa in ("torch", "portable"):  # bf16 would run torch's GEMM, or the scalar one
        assert ModelServiceConfig(dtype="auto", device="cpu", gemm_isa=gemm_isa).resolved_dtype() == "float32"
    assert ModelServiceConfig(dtype="auto", device="cpu", tensor_parallel_size=2).resolved_dtype() == "float32"
    for gemm_isa in ("avx2", "avx512", "avx512_bf16"):  # the packed GEMM's vector paths
        if gemm.native.isa_supported(gemm_isa):
            assert ModelServiceConfig(dtype="auto", device="cpu", gemm_isa=gemm_isa).resolved_dtype() == "bfloat16"
    if gemm.native.isa_supported("avx2"):  # an AVX2 CPU's default: bf16 on the native decoder loop
        avx2 = {field: "avx2" for field in ("gemm_isa", "attention_isa", "layer_ops_isa")}
        facts = start_runner(tiny_config(dtype="auto", device="cpu", **avx2)).describe_facts()
        assert (facts.dtype, facts.compute["gemm"], facts.compute["decoder_loop"]) == ("bfloat16", "avx2", "native")
    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: True)
    assert ModelServiceConfig(dtype="auto", device="cpu", gemm_isa="torch").resolved_dtype() == "bfloat16"
    assert ModelServiceConfig(dtype="auto", device="cpu").resolved_dtype() == "bfloat16"
    assert ModelServiceConfig(dtype="auto", device="cuda").resolved_dtype() == "bfloat16"
    assert ModelServiceConfig(dtype="float32", device="cuda").resolved_dtype() == "float32"
    config = tiny_config(dtype="auto", device="cpu")
    runner = start_runner(config)
    assert runner.describe_facts().dtype == "bfloat16" and runner.dtype == torch.bfloat16


def test_a_onednn_cap_under_bf16_makes_auto_float32(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes torch's bf16 matmul oneDNN's emulation on any CPU, so "auto"
    picks float32 there where bf16 would run torch's GEMM (gemm_isa torch), as on an AVX2-only CPU
    without the packed GEMM (how the suite caps torch: docs/benchmarks.md)."""
    from model_service import config as config_module

    assert cpu_bf16.onednn_capped_below_bf16({"ONEDNN_MAX_CPU_ISA": "avx2"})
    assert cpu_bf16.onednn_capped_below_bf16({"DNNL_MAX_CPU_ISA": "AVX512_CORE"})
    for uncapped in ({}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, {"ONEDNN_MAX_CPU_ISA": "ALL"}):
        assert not cpu_bf16.onednn_capped_below_bf16(uncapped)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not config_module.cpu_has_native_bf16()
    assert ModelServiceConfig(dtype="auto", device="cpu", gemm_isa="torch").resolved_dtype() == "float32"


def test_compute_fields_are_what_describe_reports_and_their_aliases_default_the_flags(monkeypatch):
    """The compute group: each field selects its path at start (the paths this CPU has), Describe's
    compute echoes what each resolved to, and the PLANSERVE_* aliases are the flags' defaults (a
    flag given wins)."""
    from model_service.__main__ import parse_args
    from model_service.attention import paged
    from model_service.kernels import layer_ops

    config = tiny_config(dtype="bfloat16", attention_isa="portable", layer_ops_isa="torch",
                         gemm_isa="portable", decoder_loop="native")
    compute = start_runner(config).describe_facts().compute
    assert (compute["attention"], compute["layer_ops"], compute["gemm"]) == ("portable", "torch", "portable")
    assert compute["decoder_loop"] == "python (torch layer-ops path)"  # the native loop needs native ops
    assert compute["cuda_graphs"] == "none (device cpu)"
    auto = start_runner(tiny_config(dtype="bfloat16")).describe_facts().compute
    assert (auto["attention"], auto["layer_ops"]) == (paged.resolve_isa(), layer_ops.resolve_isa())
    with pytest.raises(ValueError, match=r"attention_isa \(PLANSERVE_ATTENTION_ISA\): 'sse9' is not one of"):
        start_runner(tiny_config(attention_isa="sse9"))

    monkeypatch.setenv("PLANSERVE_ATTENTION_ISA", "portable")
    monkeypatch.delenv("PLANSERVE_LAYER_OPS_ISA", raising=False)  # set where a CPU class is forced
    monkeypatch.setenv("PLANSERVE_CUDA_GRAPHS", "0")
    parsed = parse_args(["--model", "tiny"])
    assert (parsed.attention_isa, parsed.cuda_graphs, parsed.layer_ops_isa) == ("portable", "off", "auto")
    assert parse_args(["--model", "tiny", "--attention-isa", "torch"]).attention_isa == "torch"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_tiny_runs_and_rows_match_dequantized(dtype):
    from model_service.kernels.quant import Int8Linear, Int8Weight

    config = tiny_config(dtype=dtype, quantization="int8")
    driver = Driver(start_runner(config))
    driver.add(0, list(range(100, 140)))
    out = driver.run_to_completion(5, chunk=16)
    assert len(out[0]) == 5 and all(0 <= t < 49152 for t in out[0])
    weight = torch.randn(96, 64)
    layer = Int8Linear(Int8Weight(weight)).to(getattr(torch, dtype))
    # Each block of 32 columns errs by at most half its own step, max|block| / 127, plus the float16
    # rounding of the scale (relative 2**-11, times |q| <= 127: ~0.06 step).
    step = weight.view(96, 2, 32).abs().amax(2, keepdim=True).expand(96, 2, 32).reshape(96, 64) / 127
    assert ((layer.w.dequantize(torch.float32) - weight).abs() <= step * 0.57).all()
    for rows in (1, 4, 200):
        x = torch.randn(rows, 64).to(getattr(torch, dtype))
        expected = x.float() @ layer.w.dequantize(torch.float32).T
        torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())




def _options(parser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings if o.startswith("--")}


def test_every_model_flag_is_one_declaration_on_every_command():
    """ModelServiceConfig's fields make the flags of `python -m model_service`, `planserve
    model-service` (the same set) and `planserve serve` (all but where the model service listens:
    serve places it itself); a flag parses to the same value everywhere."""
    import dataclasses

    from config_fields import flag_of
    from model_service.__main__ import build_parser as model_parser
    from model_service.__main__ import parse_args
    from tools import cli

    subcommands = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    fields = {f.name: flag_of(ModelServiceConfig, f.name) for f in dataclasses.fields(ModelServiceConfig)}
    alone, planserve_alone = _options(model_parser()), _options(subcommands["model-service"])
    assert set(fields.values()) <= alone
    assert planserve_alone == alone
    served = {flag for name, flag in fields.items() if name not in cli._MODEL_LISTENER_FIELDS}
    assert served <= _options(subcommands["serve"])
    argv = ["--block-size", "32", "--max-num-slots", "8", "--ngram-max", "2", "--null-eos-at", "7",
            "--kv-cache-memory", "1MiB", "--model", "null"]
    args = cli.build_parser().parse_args(["serve", *argv])
    cli.check_model_flags(args)
    passed = cli._model_service_argv(args, "127.0.0.1", 0)[3:]
    for config in (parse_args(argv), parse_args(passed)):
        assert (config.block_size, config.max_num_slots, config.ngram_max, config.null_eos_at) == (32, 8, 2, 7)
        assert config.kv_cache_memory_bytes == 1 << 20


def test_serve_profiles_the_schedulers_token_budget_only_when_given():
    """On CUDA the model service sizes its KV cache after running the largest step: in `serve`
    that is the scheduler's --max-num-batched-tokens when given, passed on as
    --profile-step-tokens; without it nothing is passed and the model service chooses the step
    for its device (the scheduler adopts it from Describe)."""
    from model_service.__main__ import parse_args
    from scheduler_service.cli import scheduler_config
    from tools import cli

    for argv, expected in ((["--max-num-batched-tokens", "1024"], 1024),
                           (["--max-num-batched-tokens", "1024", "--profile-step-tokens", "4096"], 4096),
                           (["--profile-step-tokens", "300"], 300),
                           ([], None)):
        args = cli.build_parser().parse_args(["serve", "--model", "null", *argv])
        config = scheduler_config(args, "127.0.0.1:1")
        passed = cli._model_service_argv(cli.profiling_the_token_budget(args, config), "127.0.0.1", 0)
        assert parse_args(passed[3:]).profile_step_tokens == expected
