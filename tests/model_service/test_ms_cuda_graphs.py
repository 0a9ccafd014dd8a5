"""CUDA graphs of the decode step (model_service/step/cuda_graphs.py).

The `gpu` tests run the tiny model on CUDA with graphs and without (PLANSERVE_CUDA_GRAPHS=0) through
the same plans: sequences of several lengths prefilled in chunks, joined and finished mid-run, so
that the decode steps replay graphs of several padded sizes. Greedy tokens must be equal and
logprobs close in float32 and in the default dtype (bf16): a padded size may run cuBLAS at another
row count, so bits may differ (cuda_graphs.py), tokens must not. On the CPU nothing is captured.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_config
from ms_driver import Driver

from model_service.step import cuda_graphs
from model_service.loading.loader import load_model
from model_service.start import build_runner, start_runner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_cpu_runner_captures_nothing(tiny_runner):
    assert tiny_runner.graphs is None
    assert tiny_runner.compute["cuda_graphs"] == "none (device cpu)"


def _run(runner) -> tuple[dict[int, list[int]], dict[int, list[float]]]:
    driver = Driver(runner)
    prompts = {0: list(range(3, 40)), 1: list(range(50, 61)), 2: list(range(100, 103))}
    for slot, tokens in prompts.items():
        driver.add(slot, tokens, with_logprobs=True)
    done = driver.run_to_completion(
        14, chunk=16, joins={5: [(3, list(range(200, 230)))], 9: [(4, [7, 8, 9, 10, 11])]},
        with_logprobs=True)  # fmt: skip
    return done, driver.logprobs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_replayed_decode_steps_give_the_eager_steps_tokens(dtype, monkeypatch):
    config = tiny_config(device="cuda", dtype=dtype)
    loaded = load_model(config)
    graphed = build_runner(loaded, config)
    assert graphed.graphs is not None and graphed.graphs.sizes == [1, 2, 4, 8, 16]
    assert graphed.compute["cuda_graphs"] == "decode, batch sizes 1,2,4,8,16"
    assert graphed.compute["attention"] == "triton"
    tokens, logprobs = _run(graphed)
    assert graphed.graphs.replays >= 10  # the decode steps (prefill steps run eagerly)
    assert graphed.graphs.logits.shape == (16, loaded.arch.vocab_size)  # one output for all sizes

    eager = build_runner(loaded, dataclasses.replace(config, cuda_graphs="off"))
    assert eager.graphs is None and eager.compute["cuda_graphs"] == "none (cuda_graphs=off)"
    eager_tokens, eager_logprobs = _run(eager)
    assert tokens == eager_tokens
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    for slot, values in logprobs.items():
        assert max(abs(a - b) for a, b in zip(values, eager_logprobs[slot])) <= tolerance


@pytest.mark.gpu
@needs_cuda
def test_float16_on_cuda_gives_float32s_first_16_greedy_tokens():
    """--dtype float16, for GPUs without bf16: the Triton kernel and the graphs in float16."""
    tokens = {}
    for dtype in ("float32", "float16"):
        config = tiny_config(device="cuda", dtype=dtype)
        runner = start_runner(config)
        assert runner.compute["attention"] == "triton" and runner.graphs is not None
        driver = Driver(runner)
        driver.add(0, list(range(3, 40)))
        driver.add(1, list(range(50, 61)))
        tokens[dtype] = driver.run_to_completion(16, chunk=16)
    assert tokens["float16"] == tokens["float32"]
