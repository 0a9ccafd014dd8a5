"""Tensor parallelism on CPU with gloo: `python -m model_service --tensor-parallel-size N` (rank 0
spawns the other ranks) behind a real scheduler gives the greedy tokens of tensor parallel 1.

Three prompts run concurrently (the longest in several prefill chunks, one joining mid-decode), on
the tiny model at size 2 (4 query heads, 2 KV heads, 128 MLP columns) and on SmolLM2 at size 3
(9 query heads, 3 KV heads, 1536 MLP columns: 3 is the only size that splits all three). The
all_reduce sums partial products in another order than one matmul, so tokens are compared by the
near-tie rule: up to the first step whose reference top-2 logit gap is under 1e-4.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest

from api import complete, greedy_ids_request, stub_for
from model_service.config import ModelServiceConfig
from model_service.loading.loader import TINY_ARCH
from model_service.models.parallel import check_divisible
from model_service.tp_worker import threads_per_rank
from planserve.v1 import engine_pb2, engine_pb2_grpc
from reference import compare_up_to_near_tie, greedy_reference
from scheduler_service.config import SchedulerConfig
from scheduler_service.server import SchedulerServer

NEW_TOKENS = 40
MIN_COMPARED = 32


async def _concurrent_with_a_join(server, prompts):
    """prompts[0] and prompts[2] start together; prompts[1] joins once prompts[0] decodes."""
    stub = stub_for(server)
    first = stub.Generate(greedy_ids_request(prompts[0], NEW_TOKENS))
    longest = asyncio.ensure_future(complete(stub, greedy_ids_request(prompts[2], NEW_TOKENS)))
    chunks = [await first.read()]
    joiner = asyncio.ensure_future(complete(stub, greedy_ids_request(prompts[1], NEW_TOKENS)))
    while (chunk := await first.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    return [[t for c in chunks for t in c.token_ids], (await joiner).token_ids, (await longest).token_ids]


async def _tp_outputs(engine_args, prompts, launcher=(sys.executable,), compute=None):
    """Start `python -m model_service ...` (rank 0 spawns the others; or every rank started by
    the launcher, torchrun) and a scheduler on it. `compute`: a dict that receives Describe's
    compute map."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PLANSERVE_LOG_JSON="1")
    engine = subprocess.Popen([*launcher, "-m", "model_service", "--port", "0", *engine_args],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = next((line.split("=", 1)[1].strip() for line in engine.stdout if line.startswith("PLANSERVE_ENGINE_PORT=")), None)
        assert port is not None, f"model service exited with {engine.wait()}"
        server = SchedulerServer(SchedulerConfig(port=0, engine_address=f"127.0.0.1:{port}",
                                                 max_num_batched_tokens=64, max_num_seqs=16))
        await server.start()
        await server.connect_engine()
        try:
            if compute is not None:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    facts = await engine_pb2_grpc.EngineServiceStub(channel).Describe(
                        engine_pb2.DescribeRequest(), timeout=60)
                compute.update(facts.compute)
            return await _concurrent_with_a_join(server, prompts)
        finally:
            await server.stop(grace_s=1)
    finally:
        engine.terminate()  # rank 0 stops the other ranks on SIGTERM
        status = engine.wait(timeout=30)
        if launcher == (sys.executable,):  # (torchrun exits 1 on the SIGTERM it was sent itself)
            assert status == 0


def _check_equal_to_tp1(tp_outputs, tp1_outputs, references, label):
    compared = []
    for ours, tp1, (ref_ids, gaps) in zip(tp_outputs, tp1_outputs, references):
        compared.append(compare_up_to_near_tie(ours, tp1, gaps))
        compare_up_to_near_tie(ours, ref_ids, gaps)
    print(f"\n{label}: tokens compared per prompt {compared} of {NEW_TOKENS}")
    assert all(n >= MIN_COMPARED for n in compared), compared


def test_split_sizes_are_checked():
    check_divisible(TINY_ARCH, 2)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 3 does not divide num_attention_heads 4, "
                                         r"num_key_value_heads 2, intermediate_size 128$"):
        check_divisible(TINY_ARCH, 3)
    with pytest.raises(ValueError, match="^tensor_parallel_size:"):
        ModelServiceConfig(tensor_parallel_size=0).validate()


def test_each_rank_takes_the_gpu_after_the_one_device_names(monkeypatch):
    from model_service.tp_worker import rank_config

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert [rank_config(ModelServiceConfig(device="cuda:2"), r, 2).device for r in (0, 1)] == ["cuda:2", "cuda:3"]
    assert [rank_config(ModelServiceConfig(device="cuda"), r, 2).device for r in (0, 1)] == ["cuda:0", "cuda:1"]
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's index on this node
    assert rank_config(ModelServiceConfig(device="cuda:4"), 5, 8).device == "cuda:5"
    assert rank_config(ModelServiceConfig(device="cpu"), 1, 2).device == "cpu"


def test_threads_per_rank_share_the_cores():
    import os

    cores = len(os.sched_getaffinity(0))
    assert threads_per_rank(1) == cores
    assert threads_per_rank(cores * 4) == 1
    assert threads_per_rank(2) == max(1, cores // 2)


async def test_tiny_tp2_greedy_equals_tp1(tiny_server, tiny_hf):
    prompts = [list(range(300, 307)), list(range(1000, 1030)), list(range(2000, 2150))]
    tp1 = await _concurrent_with_a_join(tiny_server, prompts)
    tp2 = await _tp_outputs(["--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64",
                             "--tensor-parallel-size", "2"], prompts)
    references = [greedy_reference(tiny_hf, p, NEW_TOKENS) for p in prompts]
    _check_equal_to_tp1(tp2, tp1, references, "tiny tp=2")


async def test_tiny_tp2_padded_steps_equal_tp1(tiny_server, tiny_hf):
    """The graphs' bookkeeping under tensor parallelism (cuda_graphs "eager": every rank pads
    each step to the same bucket, its collectives over the padding rows too), which CUDA replays
    from graphs with --cuda-graphs on: the greedy tokens of tensor parallel 1. float32: the
    comparison with transformers' tokens (the other test of this pair covers the unpadded path)."""
    prompts = [list(range(320, 329)), list(range(1200, 1231)), list(range(2400, 2537))]
    tp1 = await _concurrent_with_a_join(tiny_server, prompts)
    compute: dict[str, str] = {}
    tp2 = await _tp_outputs(["--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64",
                             "--tensor-parallel-size", "2", "--cuda-graphs", "eager"], prompts,
                            compute=compute)
    assert compute["cuda_graphs"].startswith("eager padded steps, "), compute["cuda_graphs"]
    references = [greedy_reference(tiny_hf, p, NEW_TOKENS) for p in prompts]
    _check_equal_to_tp1(tp2, tp1, references, "tiny tp=2, padded steps")


async def test_tiny_under_torchrun_equals_tp1(tiny_server, tiny_hf):
    """torchrun starts both ranks (RANK / WORLD_SIZE / MASTER_ADDR in the environment, env://
    rendezvous): rank 0 serves, rank 1 follows, and the greedy tokens are tensor parallel 1's."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to this Python")
    from model_service.tp_worker import free_tcp_port

    prompts = [list(range(310, 317)), list(range(1100, 1130)), list(range(2200, 2300))]
    tp1 = await _concurrent_with_a_join(tiny_server, prompts)
    launched = await _tp_outputs(["--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64"], prompts,
                                 launcher=(torchrun, "--nproc-per-node", "2", "--master-port", str(free_tcp_port())))
    references = [greedy_reference(tiny_hf, p, NEW_TOKENS) for p in prompts]
    _check_equal_to_tp1(launched, tp1, references, "tiny torchrun x2")


async def test_qwen2_tp2_greedy_equals_tp1(tmp_path):
    """A Qwen2-family tiny model (q/k/v bias split with its heads, untied lm_head split by vocab
    rows), each rank reading only its slices of the safetensors: size 2's greedy tokens are size
    1's and transformers', in float32."""
    import torch
    import transformers
    from transformers import Qwen2Config

    from hf_folders import family_config, write_family_folder

    folder = write_family_folder(str(tmp_path / "qwen2"), family_config(Qwen2Config))
    prompts = [list(range(500, 507)), list(range(1300, 1330)), list(range(2500, 2600))]
    args = ["--model", folder, "--dtype", "float32", "--num-kv-blocks", "64"]
    tp1 = await _tp_outputs(args, prompts)
    tp2 = await _tp_outputs(args + ["--tensor-parallel-size", "2"], prompts)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    references = [greedy_reference(reference, p, NEW_TOKENS) for p in prompts]
    _check_equal_to_tp1(tp2, tp1, references, "qwen2 tp=2")


async def test_tiny_tp2_int8_equals_tp1_int8():
    """--quantization int8 keeps the embedding / lm_head replicated (one Int8Weight for the tied
    matrix) and quantizes each rank's share in blocks of 32 input columns, which never straddle
    two ranks: the tokens equal tensor parallel 1's exactly."""
    prompts = [list(range(400, 407)), list(range(1200, 1230)), list(range(2400, 2480))]
    args = ["--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64", "--quantization", "int8"]
    tp1 = await _tp_outputs(args, prompts)
    tp2 = await _tp_outputs(args + ["--tensor-parallel-size", "2"], prompts)
    assert tp2 == tp1


@pytest.mark.slow(reason="three SmolLM2 ranks started as processes, plus transformers' float32 "
                  "greedy reference of three prompts, on a 2-core CPU")
async def test_smollm2_tp3_greedy_equals_tp1(smollm2_server):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_folders import smollm2_hf_folder

    # Transformers' own float32 weights of the GGUF, saved once as a folder (hf_folders.py): the
    # reference loads plain weights instead of converting the GGUF again.
    folder = smollm2_hf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = []
    for text in ("What is the capital of France?", "Write a haiku about the sea.",
                 "Summarise in two sentences: " + "The printing press changed how knowledge spread. " * 8):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    assert len(prompts[2]) > 64  # prefilled in several chunks
    tp1 = await _concurrent_with_a_join(smollm2_server, prompts)
    tp3 = await _tp_outputs(["--model", "smollm2", "--dtype", "float32", "--tensor-parallel-size", "3"], prompts)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    references = [greedy_reference(model, p, NEW_TOKENS) for p in prompts]
    _check_equal_to_tp1(tp3, tp1, references, "SmolLM2 tp=3")
