"""The step shape the model service chooses for its device (model_service/step/step_shape.py), the
KV budget's defaults and which flag wins (model_service/step/kv_budget.py). Describe carrying them from a real model
service, and the scheduler adopting them: tests/e2e/test_step_defaults.py.

The shape and the budget are pure functions of the device's type and memory figures, so the CUDA
rows are checked here with the figures passed in: nothing touches a GPU.
"""

from __future__ import annotations

import pytest
import torch

from model_service.config import ModelServiceConfig
from model_service.step import kv_budget, step_shape
from model_service.step.kv_budget import (
    CPU_KV_CACHE_BYTES,
    CUDA_KV_CACHE_MEMORY_FRACTION,
    CUDA_RESERVE_BYTES,
)
from planserve.contract import CPU_STEP, StepShape

GiB = 1 << 30
H100 = 80 * GiB


def _config(**overrides) -> ModelServiceConfig:
    return ModelServiceConfig(**{"model": "tiny", "dtype": "float32", **overrides})


@pytest.mark.parametrize(
    "device, total, slots, tokens, expected",
    [
        ("cpu", 0, 256, None, StepShape(512, 64)),  # today's CPU defaults
        ("cpu", 0, 16, None, StepShape(512, 16)),  # never above the slots
        ("cpu", 0, 256, 96, StepShape(96, 64)),  # profile_step_tokens given: the budget
        ("cuda", H100, 256, None, StepShape(8192, 256)),
        ("cuda", H100, 512, None, StepShape(8192, 512)),  # every slot
        ("cuda", H100, 256, 2048, StepShape(2048, 256)),  # given wins on CUDA too
        ("cuda", 12 * GiB, 256, None, StepShape(2048, 256)),  # a small GPU
    ],
)
def test_the_step_shape_for_the_device(device, total, slots, tokens, expected):
    assert step_shape.choose(device, total, slots, tokens) == expected


def test_the_cpu_shape_is_the_contracts():
    assert step_shape.choose("cpu", 0, 256) == CPU_STEP == StepShape(512, 64)
    shape = step_shape.for_device(_config(), torch.device("cpu"))
    assert shape == CPU_STEP


def _free(figure: int):
    return lambda: figure


def test_cuda_takes_the_default_fraction_less_the_step_the_graphs_and_the_reserve():
    free, peak = 70 * GiB, 3 * GiB
    graphs = kv_budget.graphs_reserve_bytes(peak, graphs_captured=True)
    assert graphs == kv_budget.GRAPH_POOL_PEAKS * peak  # the graphs' shared pool, in step peaks
    budget = kv_budget.kv_budget(_config(), "cuda", _free(free), 1, peak, graphs)
    expected = int(free * CUDA_KV_CACHE_MEMORY_FRACTION) - peak - graphs - CUDA_RESERVE_BYTES
    assert budget.bytes == expected
    assert (budget.fraction, budget.field) == (0.9, "kv_cache_memory_fraction (default)")
    assert budget.basis() == (
        f"fraction 0.9 of {free} free after weights, step peak {peak}, graphs {graphs}, "
        f"reserve {CUDA_RESERVE_BYTES}: {expected} (kv_cache_memory_fraction (default))"
    )
    # Without graphs (cuda_graphs off, or unsupported) the pool's share stays in the cache.
    assert kv_budget.graphs_reserve_bytes(peak, graphs_captured=False) == 0
    eager = kv_budget.kv_budget(_config(), "cuda", _free(free), 1, peak, 0)
    assert eager.bytes == expected + graphs


def test_the_cpu_keeps_one_gib_and_reads_no_free_memory():
    def unread() -> int:
        raise AssertionError("free memory read for a byte budget")

    budget = kv_budget.kv_budget(_config(), "cpu", unread)
    assert (budget.bytes, budget.fraction) == (CPU_KV_CACHE_BYTES, None) and budget.bytes == GiB
    assert budget.basis() == f"{GiB} bytes (kv_cache_memory_bytes (default))"


def test_a_given_byte_count_or_fraction_wins_over_the_device_default():
    free, peak = 70 * GiB, 3 * GiB
    given = kv_budget.kv_budget(_config(kv_cache_memory_bytes=5 * GiB), "cuda", _free(free), 1, peak, peak)
    assert (given.bytes, given.field, given.fraction) == (5 * GiB, "kv_cache_memory_bytes", None)
    fraction = kv_budget.kv_budget(
        _config(kv_cache_memory_fraction=0.5, kv_cache_memory_bytes=5 * GiB), "cuda", _free(free), 1, peak, peak
    )
    assert fraction.bytes == free // 2 - 2 * peak - CUDA_RESERVE_BYTES
    assert fraction.field == "kv_cache_memory_fraction"
    on_cpu = kv_budget.kv_budget(_config(kv_cache_memory_fraction=0.5), "cpu", _free(free), 2)
    assert on_cpu.bytes == free // 2 // 2  # two ranks share the host


def _sized(loaded, config, free, peak, graphs):
    return kv_budget.size_kv_cache(
        config, loaded, torch.float32, torch.device("cuda"), peak, 0, graphs,
        free_bytes=lambda device: free,
    )


def test_sizing_for_cuda_by_each_rule(tiny_loaded):
    """The whole block count for a CUDA device, its free memory passed in."""
    per_block = kv_budget.kv_block_bytes(2, 16, 2, 16, torch.float32)
    free, peak = 2 * GiB, 100 << 20
    default = _sized(tiny_loaded, _config(), free, peak, peak)
    assert default.num_blocks == (int(free * 0.9) - 2 * peak - CUDA_RESERVE_BYTES) // per_block
    assert default.basis().startswith(f"fraction 0.9 of {free} free after weights")
    assert _sized(tiny_loaded, _config(num_kv_blocks=40), free, peak, peak).num_blocks == 40
    assert _sized(tiny_loaded, _config(num_kv_blocks=40), free, peak, peak).basis() == "40 blocks (fixed)"
    by_bytes = _sized(tiny_loaded, _config(kv_cache_memory_bytes=100 * per_block), free, peak, peak)
    assert by_bytes.num_blocks == 100
    # A byte count must leave the step and the graphs free: the graphs' share is counted.
    too_big = _config(kv_cache_memory_bytes=free - peak - CUDA_RESERVE_BYTES)
    assert _sized(tiny_loaded, too_big, free, peak, 0).num_blocks >= 2
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes: .* the largest step's and the graphs' "
                       rf"{2 * peak} bytes"):
        _sized(tiny_loaded, too_big, free, peak, peak)


@pytest.mark.gpu
def test_cuda_start_up_takes_the_devices_step_and_most_of_its_memory():
    """No flag: the step for the device, profiled, and 0.9 of the free memory less the step,
    the graphs' pool (GRAPH_POOL_PEAKS step peaks when graphs are captured) and the reserve."""
    import re

    from model_service.start import start_runner

    runner = start_runner(ModelServiceConfig(model="tiny", device="cuda"))
    facts = runner.describe_facts()
    total = torch.cuda.get_device_properties(runner.device).total_memory
    assert (facts.step_token_budget, facts.step_max_seqs) == (
        step_shape.choose("cuda", total, 256).token_budget, 256)
    basis = facts.compute["kv_budget"]
    figures = re.fullmatch(r"fraction 0.9 of (\d+) free after weights, step peak (\d+), graphs (\d+), "
                           r"reserve (\d+): (\d+) \(kv_cache_memory_fraction \(default\)\)", basis)
    assert figures is not None, basis
    free, peak, graphs, reserve, budget = map(int, figures.groups())
    assert peak > 0 and reserve == CUDA_RESERVE_BYTES
    captured = not facts.compute["cuda_graphs"].startswith("none")
    assert graphs == (kv_budget.GRAPH_POOL_PEAKS * peak if captured else 0)
    assert budget == int(free * 0.9) - peak - graphs - reserve
    cache_bytes = facts.num_kv_blocks * runner.kv_cache.block_bytes
    assert budget - runner.kv_cache.block_bytes < cache_bytes <= budget
