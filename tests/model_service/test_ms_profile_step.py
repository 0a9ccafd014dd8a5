"""The profiling forward that sizes the KV cache on CUDA (model_service/step/profile_step.py,
kv_budget.py).

On the CPU the profiled steps themselves run through a real runner (the tiny model in the
default dtype, bf16 on these machines, and float32), and the budget arithmetic is checked with the
device's free memory pinned to a known figure: the CPU has no allocator statistics to profile, so
that one number is what the real device cannot show here. The `gpu` tests run the whole start-up
on CUDA and are skipped without one.
"""

from __future__ import annotations

import pytest
import torch
from ms_driver import Driver

from model_service.step import kv_budget
from model_service.step import profile_step
from model_service.config import ModelServiceConfig
from model_service.loading.loader import load_model
from model_service.runner import ModelRunner
from model_service import start
from model_service.start import build_runner, start_runner


def _config(**overrides) -> ModelServiceConfig:
    return ModelServiceConfig(**{"model": "tiny", "num_kv_blocks": 512, "max_num_slots": 16,
                                 **overrides})


@pytest.fixture(scope="module", params=["auto", "float32"])
def dtype(request) -> str:
    return request.param  # "auto": the default, bf16 on a CPU with native bf16


@pytest.fixture(scope="module")
def loaded(dtype):
    return load_model(_config(dtype=dtype))


@pytest.mark.parametrize(
    "tokens, slots, max_len, expected",
    [
        (2048, 256, 8192, [[2048], [8] * 256]),
        (2048, 256, 512, [[512] * 4, [8] * 256]),
        (100, 16, 40, [[40, 40, 20], [7] * 4 + [6] * 12]),
        (10, 16, 512, [[10], [1] * 10]),
        (5000, 4, 1000, [[1000] * 4]),  # the slots hold 4,000 tokens: both shapes are the same
    ],
)
def test_profiled_lengths_fill_the_token_count_within_the_bounds(tokens, slots, max_len, expected):
    lengths = profile_step.sequence_lengths(tokens, slots, max_len)
    assert lengths == expected
    for step in lengths:
        assert sum(step) == min(tokens, slots * max_len)
        assert len(step) <= slots and max(step) <= max_len


def test_scratch_blocks_cover_the_larger_step_and_the_reserved_block():
    assert profile_step.blocks_needed([[40, 40, 20], [7] * 16], 16) == 1 + 16
    assert profile_step.blocks_needed([[512]], 16) == 1 + 32


def _greedy_tokens(runner: ModelRunner) -> dict[int, list[int]]:
    driver = Driver(runner)
    driver.add(0, list(range(3, 40)))
    driver.add(1, list(range(50, 61)), temperature=0.8, top_p=0.9, seed=7)
    driver.step({0: 37, 1: 11})
    for _ in range(6):
        driver.step({0: 1, 1: 1})
    return {slot: seq.generated for slot, seq in driver.seqs.items()}


def test_profiled_steps_run_sample_every_sequence_and_leave_no_trace(loaded, dtype):
    runner = build_runner(loaded, _config(dtype=dtype))
    lengths = profile_step.sequence_lengths(600, 16, loaded.max_model_len)
    steps = profile_step.run_profile_steps(runner, lengths, 16, loaded.arch.vocab_size)

    for step, computed in zip(lengths, steps):
        assert computed.num_sampled_tokens.tolist() == [1] * len(step)
        assert computed.sampled_token_ids.size == len(step)
        assert computed.logprob_token_ids.size > 0  # the logprob gather ran
    assert not runner.slot_table.active.any()
    # A profiled runner serves the same tokens as a fresh one (sampling is keyed by seed and
    # position, and the profiled blocks are overwritten before they are read).
    fresh = build_runner(loaded, _config(dtype=dtype))
    assert _greedy_tokens(runner) == _greedy_tokens(fresh)


def _pinned_free_memory(monkeypatch, free: int) -> None:
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda device: free)


def test_a_fraction_leaves_the_largest_step_and_the_reserve_free(loaded, monkeypatch):
    free = 1 << 30
    _pinned_free_memory(monkeypatch, free)
    config = _config(num_kv_blocks=None, kv_cache_memory_fraction=0.5)
    per_block = kv_budget.kv_block_bytes(2, 16, 2, 16, next(loaded.model.parameters()).dtype)
    device = torch.device("cpu")
    dtype = next(loaded.model.parameters()).dtype
    peak = 100 << 20

    unprofiled = kv_budget.size_kv_cache(config, loaded, dtype, device).num_blocks
    profiled = kv_budget.size_kv_cache(config, loaded, dtype, device, step_peak_bytes=peak).num_blocks
    assert unprofiled == (free // 2) // per_block
    assert profiled == (free // 2 - peak - kv_budget.CUDA_RESERVE_BYTES) // per_block


def test_a_step_larger_than_the_fraction_refuses_to_start_naming_the_fixes(loaded, monkeypatch):
    _pinned_free_memory(monkeypatch, 1 << 30)
    config = _config(num_kv_blocks=None, kv_cache_memory_fraction=0.5)
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction: a budget of 0 bytes \(after the "
                       r"largest step's 1073741824 bytes.*lower profile_step_tokens or max_num_slots"):
        kv_budget.size_kv_cache(config, loaded, torch.float32, torch.device("cpu"),
                                step_peak_bytes=1 << 30)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"num_kv_blocks": 4000}, "num_kv_blocks"),
        ({"num_kv_blocks": None, "kv_cache_memory_bytes": 64 << 20}, "kv_cache_memory_bytes"),
    ],
)
def test_a_fixed_cache_that_leaves_too_little_refuses_to_start(loaded, monkeypatch, overrides, field):
    _pinned_free_memory(monkeypatch, 1 << 30)
    config = _config(**overrides)
    # 4,000 blocks of the tiny model in float32 (32 MiB), or 64 MiB, a 900 MiB step and the reserve:
    # over 1 GiB.
    with pytest.raises(ValueError, match=rf"{field}: a KV cache of \d+ bytes, the largest step's and the "
                       rf"graphs' 943718400 bytes .* 1073741824 are free \(lower {field} or profile_step_tokens\)"):
        kv_budget.size_kv_cache(config, loaded, torch.float32, torch.device("cpu"),
                                step_peak_bytes=900 << 20)
    # The same cache beside a small step starts.
    assert kv_budget.size_kv_cache(config, loaded, torch.float32, torch.device("cpu"),
                                   step_peak_bytes=1 << 20).num_blocks >= 2


def test_gpu_memory_utilization_is_a_share_of_the_total_less_what_the_service_holds(
        loaded, monkeypatch):
    """vLLM's meaning: the whole service within share x the GPU's total memory. The device's
    memory is pinned (no GPU here): 8 GiB in all, 1 GiB held by this service's weights, 5 GiB free
    (another process holds 2)."""
    _pinned_free_memory(monkeypatch, 5 << 30)
    monkeypatch.setattr(kv_budget, "device_usage", lambda device: (8 << 30, 1 << 30))
    config = _config(num_kv_blocks=None, gpu_memory_utilization=0.5)
    dtype = next(loaded.model.parameters()).dtype
    per_block = kv_budget.kv_block_bytes(2, 16, 2, 16, dtype)
    peak, graphs = 100 << 20, 200 << 20
    sizing = kv_budget.size_kv_cache(config, loaded, dtype, torch.device("cuda"),
                                     step_peak_bytes=peak, graphs_bytes=graphs)
    expected = (4 << 30) - (1 << 30) - peak - graphs - kv_budget.CUDA_RESERVE_BYTES
    assert sizing.num_blocks == expected // per_block
    assert sizing.basis() == (
        f"share 0.5 of {8 << 30} total, less {1 << 30} in use, step peak {peak}, graphs {graphs}, "
        f"reserve {kv_budget.CUDA_RESERVE_BYTES}: {expected} (gpu_memory_utilization)")
    # 0.9 of the total would take more than is free: refused, naming the flag to lower.
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: 0.9 of the GPU's 8589934592 bytes "
                       r"leaves \d+ for the KV cache .* but 5368709120 are free .*lower "
                       r"gpu_memory_utilization$"):
        kv_budget.size_kv_cache(_config(num_kv_blocks=None, gpu_memory_utilization=0.9), loaded,
                                dtype, torch.device("cuda"), step_peak_bytes=peak)
    # A block count still wins.
    fixed = _config(num_kv_blocks=64, gpu_memory_utilization=0.5)
    assert kv_budget.size_kv_cache(fixed, loaded, dtype, torch.device("cuda")).num_blocks == 64


def test_gpu_memory_utilization_is_refused_off_a_gpu_and_beside_another_budget(loaded):
    config = _config(num_kv_blocks=None, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: a share of a GPU's memory, and "
                       r"this model service runs on the cpu: size its KV cache with --kv-cache-memory"):
        build_runner(loaded, config)
    for other in ({"kv_cache_memory_bytes": 1 << 30}, {"kv_cache_memory_fraction": 0.5}):
        with pytest.raises(ValueError, match=r"^gpu_memory_utilization: sizes the KV cache by "
                           rf"itself; drop {next(iter(other))}$"):
            _config(gpu_memory_utilization=0.5, **other).validate()
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: 1.5 must be in \(0, 1\]"):
        _config(gpu_memory_utilization=1.5).validate()
    from model_service.__main__ import parse_args

    assert parse_args(["--gpu-memory-utilization", "0.85"]).gpu_memory_utilization == 0.85


def test_the_cpu_runner_does_not_profile(loaded, monkeypatch):
    def fail(*args):
        raise AssertionError("profiled on the CPU")

    monkeypatch.setattr(profile_step, "peak_step_bytes", fail)
    runner = build_runner(loaded, _config(num_kv_blocks=None, kv_cache_memory_fraction=0.001))
    assert runner.limits.num_kv_blocks >= 2


@pytest.mark.gpu
def test_cuda_start_up_profiles_the_largest_step_and_then_runs_it():
    config = ModelServiceConfig(model="tiny", device="cuda", num_kv_blocks=None,
                                kv_cache_memory_fraction=0.5, profile_step_tokens=1024)
    runner = start_runner(config)
    free, _total = torch.cuda.mem_get_info()
    assert runner.kv_cache.k.numel() * runner.kv_cache.k.element_size() * 2 <= 0.5 * (
        free + runner.kv_cache.k.numel() * runner.kv_cache.k.element_size() * 2)
    lengths = profile_step.sequence_lengths(1024, config.max_num_slots, runner.loaded.max_model_len)
    steps = profile_step.run_profile_steps(runner, lengths, config.block_size,
                                           runner.loaded.arch.vocab_size)
    assert [int(s.num_sampled_tokens.sum()) for s in steps] == [len(step) for step in lengths]
    assert not runner.slot_table.active.any()


@pytest.mark.gpu
def test_cuda_start_up_within_a_share_of_the_gpu():
    """--gpu-memory-utilization 0.3: once the cache is allocated and the steps captured, this
    service's tensors (weights, cache, graphs' pool) hold at most that share of the GPU."""
    share = 0.3
    held_before = torch.cuda.memory_allocated()  # other tests' models in this process
    config = ModelServiceConfig(model="tiny", device="cuda", num_kv_blocks=None,
                                gpu_memory_utilization=share, profile_step_tokens=1024)
    runner = start_runner(config)
    _free, total = torch.cuda.mem_get_info()
    cache_bytes = runner.kv_cache.k.numel() * runner.kv_cache.k.element_size() * 2
    assert torch.cuda.memory_allocated() <= share * total
    assert cache_bytes >= 0.5 * (share * total - held_before)  # the share went to the cache
    assert runner.compute["kv_budget"].startswith(f"share {share:g} of {total} total")


@pytest.mark.gpu
def test_cuda_start_up_refuses_a_block_count_the_device_cannot_hold():
    config = ModelServiceConfig(model="tiny", device="cuda", num_kv_blocks=10**9)
    with pytest.raises(ValueError, match="num_kv_blocks: a KV cache of"):
        start_runner(config)


def test_the_runner_profiles_on_a_scratch_cache_then_sizes_and_serves(loaded, dtype, monkeypatch):
    """The CUDA start-up's sequence, on the CPU: only the allocator's peak (which the CPU does not
    keep) is a stand-in; the profiled steps run for real on the scratch cache."""
    ran, peak, free = [], 16 << 20, 600 << 20
    _pinned_free_memory(monkeypatch, free)

    def peak_of_real_steps(runner, lengths, block_size, vocab_size, device):
        ran.append((runner.limits.num_kv_blocks, lengths))
        profile_step.run_profile_steps(runner, lengths, block_size, vocab_size)
        return peak

    monkeypatch.setattr(profile_step, "peak_step_bytes", peak_of_real_steps)
    monkeypatch.setattr(start, "profiles", lambda device, loaded: True)
    config = _config(dtype=dtype, num_kv_blocks=None, kv_cache_memory_fraction=0.5,
                     profile_step_tokens=300)
    runner = build_runner(loaded, config)

    lengths = profile_step.sequence_lengths(300, 16, loaded.max_model_len)
    assert ran == [(profile_step.blocks_needed(lengths, 16), lengths)]  # on the scratch cache
    per_block = runner.kv_cache.block_bytes
    expected = (free // 2 - peak - kv_budget.CUDA_RESERVE_BYTES) // per_block
    assert runner.limits.num_kv_blocks == runner.kv_cache.k.shape[1] == expected
    fresh = build_runner(loaded, _config(dtype=dtype))
    assert _greedy_tokens(runner) == _greedy_tokens(fresh)
