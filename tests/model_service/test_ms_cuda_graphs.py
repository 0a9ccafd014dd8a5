"""CUDA graphs of every step (model_service/step/cuda_graphs.py, padded_step.py).

The `gpu` tests run the tiny model on CUDA with graphs and without (PLANSERVE_CUDA_GRAPHS=0) through
the same plans: sequences of several lengths prefilled in chunks beside decodes, joined and
finished mid-run, so that mixed and decode-only steps replay graphs of several padded sizes.
Greedy tokens must be equal and logprobs close in float32 and in the default dtype (bf16): a padded
size may run cuBLAS at another row count, so bits may differ (cuda_graphs.py), tokens must not.

On the CPU nothing is captured; cuda_graphs "eager" runs the graphs' bookkeeping (bucket choice,
padding, static buffers, the tile map) eagerly, and its greedy tokens and logprobs must equal the
plain path's in every dtype this CPU serves: the CPU's kernels are batch invariant, so padding may
not move a bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import tiny_config
from dtypes import served_dtypes
from ms_driver import Driver

from model_service.attention import cuda_attention
from model_service.attention.kv_cache import KVCache
from model_service.step.padded_step import token_buckets

from model_service.step import cuda_graphs
from model_service.loading.loader import load_model
from model_service.start import build_runner, start_runner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_cpu_runner_captures_nothing(tiny_runner):
    assert tiny_runner.graphs is None
    assert tiny_runner.compute["cuda_graphs"] == "none (device cpu)"


def test_token_buckets_pad_at_most_an_eighth_past_the_decode_sizes():
    sizes = token_buckets(8192)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 8192 and sizes == sorted(set(sizes))
    assert 256 in sizes and all(b % 16 == 0 for b in sizes if b >= 16)
    for small, big in zip(sizes, sizes[1:]):
        assert big - small <= max(16, small // 8)
    assert token_buckets(300)[-2:] == [288, 300] and token_buckets(16) == [1, 2, 4, 8, 16]


def test_the_tile_map_covers_each_sequences_rows_once_and_pads_with_empty_tiles():
    n = np.array([1, 9, 0, 4, 1], dtype=np.int64)
    count, tiles = cuda_attention.attention_tiles(n, 4)
    assert count == 1 + 3 + 0 + 1 + 1
    assert tiles[0].tolist() == [0, 1, 1, 1, 3, 4] and tiles[1].tolist() == [0, 0, 4, 8, 0, 0]
    capacity = cuda_attention.max_tiles(int(n.sum()), n.size, 4)
    out = np.full((2, capacity), -1, dtype=np.int64)
    assert cuda_attention.attention_tiles(n, 4, out)[0] == count
    assert (out[:, :count] == tiles).all()
    assert (out[1, count:] == cuda_attention.PAD_ROW).all() and (out[0, count:] == 0).all()
    rng = np.random.default_rng(0)
    for _ in range(200):  # the capacity bound holds for any split of the rows
        rows = int(rng.integers(1, 9))
        n = rng.integers(0, 40, size=int(rng.integers(1, 30)))
        count, _ = cuda_attention.attention_tiles(n, rows)
        assert count <= cuda_attention.max_tiles(int(n.sum()), n.size, rows)


def _run(runner) -> tuple[dict[int, list[int]], dict[int, list[float]]]:
    driver = Driver(runner)
    prompts = {0: list(range(3, 40)), 1: list(range(50, 61)), 2: list(range(100, 103))}
    for slot, tokens in prompts.items():
        driver.add(slot, tokens, with_logprobs=True)
    done = driver.run_to_completion(
        14, chunk=16, joins={5: [(3, list(range(200, 230)))], 9: [(4, [7, 8, 9, 10, 11])]},
        with_logprobs=True)  # fmt: skip
    return done, driver.logprobs


@pytest.mark.parametrize("dtype", served_dtypes("tiny"))
def test_padded_steps_on_the_cpu_give_the_plain_paths_tokens_and_bits(dtype):
    config = tiny_config(dtype=dtype, cuda_graphs="eager", profile_step_tokens=48)
    loaded = load_model(config)
    padded = build_runner(loaded, config)
    assert padded.graphs is not None and not padded.graphs.captured
    assert padded.graphs.sizes == [1, 2, 4, 8, 16, 32, 48]
    assert padded.compute["cuda_graphs"] == "eager padded steps, 7 buckets up to 48 tokens"
    tokens, logprobs = _run(padded)
    assert padded.graphs.replays >= 14  # mixed and decode-only steps; a step past 48 runs plain
    plain = build_runner(loaded, dataclasses.replace(config, cuda_graphs="auto"))
    assert plain.graphs is None
    assert (tokens, logprobs) == _run(plain)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_replayed_steps_give_the_eager_steps_tokens(dtype, monkeypatch):
    config = tiny_config(device="cuda", dtype=dtype, profile_step_tokens=64)
    loaded = load_model(config)
    graphed = build_runner(loaded, config)
    assert graphed.graphs is not None and graphed.graphs.sizes == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graphed.compute["cuda_graphs"] == "every step, 8 buckets up to 64 tokens"
    assert graphed.compute["attention"] == "triton"
    tokens, logprobs = _run(graphed)
    assert graphed.graphs.replays >= 14  # decode-only and mixed steps (chunks of 16)
    assert graphed.graphs.logits.shape == (16, loaded.arch.vocab_size)  # one output for all sizes

    eager = build_runner(loaded, dataclasses.replace(config, cuda_graphs="off"))
    assert eager.graphs is None and eager.compute["cuda_graphs"] == "none (cuda_graphs=off)"
    eager_tokens, eager_logprobs = _run(eager)
    assert tokens == eager_tokens
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    for slot, values in logprobs.items():
        assert max(abs(a - b) for a, b in zip(values, eager_logprobs[slot])) <= tolerance


def test_tensor_parallel_steps_are_captured_only_when_asked(monkeypatch):
    """Under tensor parallelism "auto" runs steps eagerly and says how to capture them; "on"
    captures (the decision alone: the capture itself needs GPUs). The attention path is the
    Triton kernel's here, so that the rule under test is the one that decides."""
    monkeypatch.setattr(cuda_graphs, "cuda_path", lambda k: "triton")
    cache = KVCache(1, 2, 16, 1, 8, torch.float32, torch.device("cpu"))
    cuda = torch.device("cuda")
    reason = cuda_graphs.unsupported_reason("auto", cuda, cache, 2)
    assert reason == "tensor parallel: not yet run on several GPUs; --cuda-graphs on captures them"
    assert not cuda_graphs.records("auto", cuda, cache, 2)
    assert cuda_graphs.unsupported_reason("on", cuda, cache, 2) is None
    assert cuda_graphs.records("on", cuda, cache, 2)  # so the KV budget leaves the pool free
    assert cuda_graphs.unsupported_reason("auto", cuda, cache, 1) is None
    assert cuda_graphs.unsupported_reason("on", torch.device("cpu"), cache, 2) == "device cpu"
    assert cuda_graphs.unsupported_reason("off", cuda, cache, 2) == "cuda_graphs=off"


def _steps_with_collectives(device: str, backend: str, graphs: str):
    """The tiny model in a process group of one rank, its o_proj and down_proj wrapped with their
    all_reduces (models/parallel.py), through the padded steps (`graphs`) and the plain path:
    (tokens of each, the padded runner). float32: the tokens must be equal."""
    import torch.distributed as dist

    from model_service.models.parallel import RankShare, wrap_parallel_
    from model_service.tp_worker import free_tcp_port

    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    dist.init_process_group(backend, init_method=address, rank=0, world_size=1)
    try:
        assert cuda_graphs.capture_mode() == "thread_local"
        config = tiny_config(device=device, dtype="float32", profile_step_tokens=64,
                             cuda_graphs=graphs)  # fmt: skip
        loaded = load_model(config)
        wrap_parallel_(loaded.model, RankShare(0, 1, dist.group.WORLD))
        calls = []
        reduce = dist.all_reduce
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(1) or reduce(*a, **k))
            padded = build_runner(loaded, config)
            tokens = _run(padded)[0]
            plain = build_runner(loaded, dataclasses.replace(config, cuda_graphs="off"))
            plain_tokens = _run(plain)[0]
        assert calls  # the collectives ran (on CUDA, in the warm-ups before the capture)
        return tokens, plain_tokens, padded
    finally:
        dist.destroy_process_group()


def test_padded_steps_with_collectives_give_the_plain_tokens_on_the_cpu():
    """The GPU test below, on the CPU with gloo and the padded steps run eagerly: the wrapping,
    the group and the padding rows through the collectives."""
    tokens, plain_tokens, padded = _steps_with_collectives("cpu", "gloo", "eager")
    assert padded.graphs.replays >= 14 and tokens == plain_tokens
    assert cuda_graphs.capture_mode() == "global"  # the group is gone


@pytest.mark.gpu
@needs_cuda
def test_collectives_replay_from_graphs_in_a_group_of_one():
    """Graphs under tensor parallelism on the one GPU a test machine has: NCCL's all_reduces
    captured in every step's graph (cuda_graphs "on", a thread-local capture beside NCCL's
    watchdog thread) give the tokens of the same steps eager."""
    tokens, plain_tokens, graphed = _steps_with_collectives("cuda", "nccl", "on")
    assert graphed.graphs.captured and graphed.graphs.replays >= 14
    assert graphed.compute["cuda_graphs"] == "every step, 8 buckets up to 64 tokens"
    assert tokens == plain_tokens


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
