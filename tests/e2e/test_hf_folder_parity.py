"""`--model FOLDER` end to end: greedy token parity with transformers loading the same Hugging Face
folder, through real gRPC servers on 127.0.0.1, in the mixed batch of test_parity (two prompts
start together, a third joins mid-decode, the longest is prefilled in chunks of the 64-token
budget), by the near-tie rule. Plus the name and length the engine was told to serve under.

The tiny folder is written per session (fast); the SmolLM2 folder is converted from the GGUF once
and cached across sessions (tests/hf_folders.py; slow).
"""
import asyncio
import json
import urllib.request

import pytest
import pytest_asyncio

from api import stub_for
from conftest import EngineProcess, start_scheduler
from hf_folders import smollm2_hf_folder, write_tiny_hf_folder
from planserve.v1 import generate_pb2
from reference import greedy_reference
from test_parity import NEW_TOKENS, SMOLLM2_PROMPTS, _check, _concurrent_with_a_join


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_hf_folder(str(tmp_path_factory.mktemp("hf") / "tiny-hf-llama"))


@pytest_asyncio.fixture(scope="module")
async def folder_server(tiny_folder):
    engine = EngineProcess("--model", tiny_folder, "--dtype", "float32", "--num-kv-blocks", "64",
                           "--served-model-name", "tiny-folder", "--max-model-len", "384")
    server = await start_scheduler(engine.address, max_num_batched_tokens=64, max_num_seqs=16,
                                   http_port=0)
    yield server
    await server.stop(grace_s=1)
    engine.stop()


async def test_tiny_folder_greedy_parity_with_transformers(folder_server, tiny_folder):
    import torch
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    prompts = [list(range(300, 307)), list(range(1000, 1030)), list(range(2000, 2150))]
    outputs = await _concurrent_with_a_join(folder_server, prompts)
    _check(outputs, [greedy_reference(reference, p, NEW_TOKENS) for p in prompts], "tiny HF folder")


async def test_served_model_name_and_max_model_len_reach_the_apis(folder_server):
    info = await stub_for(folder_server).GetModelInfo(generate_pb2.GetModelInfoRequest())
    assert (info.model_name, info.max_model_len) == ("tiny-folder", 384)
    url = f"http://127.0.0.1:{folder_server.http_port}/v1/models"

    def fetch():  # in a thread: the HTTP server runs on this test's event loop
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.load(response)["data"]

    models = await asyncio.to_thread(fetch)
    assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny-folder", 384)]


def test_serve_passes_the_model_flags_to_the_model_service(tiny_folder):
    from tools.cli import _model_service_argv, build_parser

    args = build_parser().parse_args([
        "serve", "--model", tiny_folder, "--max-model-len", "2048", "--served-model-name", "llama",
        "--kv-cache-memory", "2GiB", "--kv-cache-memory-fraction", "0.5", "--swap-space", "4GiB",
        "--preemption-mode", "swap"])
    argv = _model_service_argv(args, "127.0.0.1", 0)
    pairs = dict(zip(argv[3::2], argv[4::2]))
    assert pairs["--model"] == tiny_folder
    assert (pairs["--max-model-len"], pairs["--served-model-name"]) == ("2048", "llama")
    assert (pairs["--kv-cache-memory"], pairs["--kv-cache-memory-fraction"], pairs["--swap-space"]) == ("2GiB", "0.5", "4GiB")
    assert args.preemption_mode == "swap"
    # And the model service parses what it is given.
    from model_service.__main__ import parse_args

    config = parse_args(argv[3:])
    assert (config.max_model_len, config.served_model_name) == (2048, "llama")
    assert (config.kv_cache_memory_bytes, config.kv_cache_memory_fraction, config.swap_space_bytes) == (2 << 30, 0.5, 4 << 30)


@pytest.mark.slow(reason="writes SmolLM2's Hugging Face folder from the GGUF (once per machine), "
                  "then transformers' float32 greedy reference of three prompts")
async def test_smollm2_folder_greedy_parity_with_transformers():
    import torch
    import transformers

    folder = smollm2_hf_folder()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True) for p in SMOLLM2_PROMPTS]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    assert len(prompts[2]) > 64  # prefilled in several chunks

    engine = EngineProcess("--model", folder, "--dtype", "float32")
    try:
        server = await start_scheduler(engine.address, max_num_batched_tokens=64)
        try:
            facts = server.loop.scheduler.facts
            assert facts.chat_template and facts.eos_token_ids
            outputs = await _concurrent_with_a_join(server, prompts)
        finally:
            await server.stop(grace_s=1)
    finally:
        engine.stop()
    _check(outputs, [greedy_reference(reference, p, NEW_TOKENS) for p in prompts], "SmolLM2 HF folder")
