"""KV capacity from a memory budget, host swap space, and swap out / swap in through the runner."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ms_driver import Recording, replay_ahead

from model_service.loading.loader import load_model
from model_service.batch import facts_to_pb, from_pb
from model_service.step.plan import PlanArrays, PlanError
from model_service.config import ModelServiceConfig, parse_bytes
from model_service.step.kv_budget import available_memory_bytes
from model_service.runner import ModelRunner
from model_service.start import build_runner
from planserve.v1 import engine_pb2

def tiny_config(**overrides) -> ModelServiceConfig:
    # As tests/model_service/conftest.py's (not imported: `conftest` may name another directory's).
    return ModelServiceConfig(**{"model": "tiny", "dtype": "float32", "num_kv_blocks": 512, "max_num_slots": 16, **overrides})


# The tiny Llama: 2 layers, 2 KV heads of 16 dims; K and V for 16 tokens per block.
TINY_BLOCK_BYTES_FP32 = 2 * 2 * 16 * 2 * 16 * 4


def _runner(tiny_loaded, **overrides) -> ModelRunner:
    return build_runner(tiny_loaded, tiny_config(**{"num_kv_blocks": None, **overrides}))


def test_blocks_derived_from_the_memory_budget(tiny_loaded):
    runner = _runner(tiny_loaded, kv_cache_memory_bytes=100 * TINY_BLOCK_BYTES_FP32 + 7)
    assert runner.kv_cache.block_bytes == TINY_BLOCK_BYTES_FP32
    assert runner.describe_facts().num_kv_blocks == 100
    assert runner.kv_cache.k.shape[1] == 100 and runner.limits.num_kv_blocks == 100
    assert facts_to_pb(runner.describe_facts()).num_kv_blocks == 100


def test_the_budget_holds_a_draft_models_cache_too(tiny_loaded):
    """A draft model keeps its own KV cache of the same block count (draft_model.py): the budget
    is for both caches, so each block costs the target's bytes and the draft's (the tiny model
    drafting for itself: twice one block)."""
    runner = _runner(tiny_loaded, kv_cache_memory_bytes=100 * TINY_BLOCK_BYTES_FP32,
                     speculative_method="draft", draft_model="tiny", num_speculative_tokens=2)
    assert runner.describe_facts().num_kv_blocks == 50
    draft_cache = runner.speculation.drafter.kv_cache
    assert draft_cache.k.shape[1] == 50 and draft_cache.block_bytes == TINY_BLOCK_BYTES_FP32
    cache_bytes = (runner.kv_cache.k.numel() + runner.kv_cache.v.numel() + draft_cache.k.numel()
                   + draft_cache.v.numel()) * 4
    assert cache_bytes <= 100 * TINY_BLOCK_BYTES_FP32
    # Without a draft the same budget holds the target's 100 blocks.
    assert _runner(tiny_loaded, kv_cache_memory_bytes=100 * TINY_BLOCK_BYTES_FP32).describe_facts().num_kv_blocks == 100


def test_a_draft_model_of_another_vocabulary_is_refused_by_name(tiny_loaded, monkeypatch):
    import dataclasses

    # A stand-in for a draft checkpoint of another vocabulary: the tiny model with one more token.
    arch = dataclasses.replace(tiny_loaded.arch, vocab_size=tiny_loaded.arch.vocab_size + 1)
    monkeypatch.setattr("model_service.loading.loader.load_model", lambda config: dataclasses.replace(tiny_loaded, arch=arch))
    with pytest.raises(ValueError, match=r"draft_model: vocabulary of \d+ tokens, the target's has \d+"):
        _runner(tiny_loaded, kv_cache_memory_bytes=100 * TINY_BLOCK_BYTES_FP32,
                speculative_method="draft", draft_model="tiny", num_speculative_tokens=2)


def test_num_kv_blocks_wins_over_the_budget(tiny_loaded):
    runner = _runner(tiny_loaded, num_kv_blocks=40, kv_cache_memory_bytes=100 * TINY_BLOCK_BYTES_FP32)
    assert runner.describe_facts().num_kv_blocks == 40


def test_blocks_from_a_fraction_of_free_memory(tiny_loaded):
    fraction = 0.002
    runner = _runner(tiny_loaded, kv_cache_memory_fraction=fraction)
    expected = available_memory_bytes(torch.device("cpu")) * fraction / TINY_BLOCK_BYTES_FP32
    # Free memory moves a little between the two readings (other processes on the machine).
    assert abs(runner.describe_facts().num_kv_blocks - expected) <= 0.1 * expected
    assert runner.describe_facts().num_kv_blocks >= 2


def test_a_budget_below_two_blocks_is_refused_naming_the_field(tiny_loaded):
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes: a budget of 9000 bytes holds 1 blocks of 8192 bytes"):
        _runner(tiny_loaded, kv_cache_memory_bytes=9000)
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction: 1.5 must be in \(0, 1\]"):
        tiny_config(kv_cache_memory_fraction=1.5).validate()
    with pytest.raises(ValueError, match=r"swap_space_bytes: -1 must be >= 0"):
        tiny_config(swap_space_bytes=-1).validate()


def test_byte_counts_take_binary_units():
    assert parse_bytes("4096") == 4096
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5k") == 1536
    with pytest.raises(ValueError, match="not a byte count"):
        parse_bytes("12 parsecs")


def test_swap_space_is_reported_by_describe(tiny_loaded):
    runner = _runner(tiny_loaded, num_kv_blocks=64, swap_space_bytes=10 * TINY_BLOCK_BYTES_FP32 + 100)
    reply = facts_to_pb(runner.describe_facts())
    assert reply.num_swap_blocks == 10 and reply.features.swap
    assert runner.kv_cache.host_k.shape[0] == 10 and runner.kv_cache.host_k.device.type == "cpu"
    reply = facts_to_pb(_runner(tiny_loaded, num_kv_blocks=64).describe_facts())
    assert reply.num_swap_blocks == 0 and not reply.features.swap


# -- swap out / swap in through the runner --------------------------------------------------------

_E = np.zeros(0, dtype=np.int64)


def _a(values) -> np.ndarray:
    return np.asarray(list(values), dtype=np.int64)


def _plan(step_id, new=(), slots=(), counts=(), new_blocks=(), block_ids=(), **fields) -> PlanArrays:
    values = dict(
        step_id=step_id, new_sequences=list(new), slots=_a(slots), num_scheduled_tokens=_a(counts),
        num_new_blocks=_a(new_blocks), new_block_ids=_a(block_ids), finished_slots=_E, preempted_slots=_E,
        aborted_slots=_E, copy_src=_E, copy_dst=_E)
    values.update({k: _a(v) for k, v in fields.items()})
    return PlanArrays(**values)


def _new(slot, tokens, computed=0):
    from model_service.step.plan import SlotRegistration

    return SlotRegistration(slot, np.asarray(tokens, dtype=np.int32), computed, 0.0, 0, 1.0, 0)


def _greedy(runner, prompt, num_new, swap_after=None):
    """Prefill `prompt` in slot 0 (blocks 1..), decode num_new tokens. With swap_after=k: after k
    decode steps slot 0 is preempted by swap, a stranger's prefill overwrites its freed blocks in
    the same plan, and slot 0 resumes in a later plan on other blocks, filled by swap-in."""
    bs = 16
    tokens = list(prompt)
    blocks = list(range(1, 1 + -(-len(tokens) // bs)))
    out = runner.execute(_plan(0, [_new(0, tokens)], [0], [len(tokens)], [len(blocks)], blocks))
    tokens.append(int(out.sampled_token_ids[0]))
    step, next_block = 1, 40
    for i in range(num_new - 1):
        if i == swap_after:
            computed = len(tokens) - 1  # the last sampled token is not computed yet
            num_swap = -(-computed // bs)
            stranger = list(range(7000, 7000 + num_swap * bs))
            # One plan: preempt slot 0 by swap, give its blocks to slot 1, prefill slot 1 there.
            runner.execute(_plan(step, [_new(1, stranger)], [1], [len(stranger)], [num_swap], blocks[:num_swap],
                                 preempted_slots=[0], swap_out_src=blocks[:num_swap], swap_out_dst=range(num_swap)))
            step += 1
            # Resume on fresh blocks (host blocks paired in reverse order, to check the pairing):
            # the swapped-in prefix, plus a block for the pending token when it starts one.
            fresh = list(range(next_block, next_block + -(-(computed + 1) // bs)))
            next_block += len(fresh)
            blocks = fresh
            out = runner.execute(_plan(step, [_new(0, tokens, computed)], [0], [1], [len(fresh)], fresh,
                                       finished_slots=[1], swap_in_src=list(reversed(range(num_swap))),
                                       swap_in_dst=list(reversed(fresh[:num_swap]))))
        else:
            new_blocks = []
            if len(tokens) > len(blocks) * bs:
                new_blocks = [next_block]
                next_block += 1
                blocks.append(new_blocks[0])
            out = runner.execute(_plan(step, (), [0], [1], [len(new_blocks)], new_blocks))
        step += 1
        tokens.append(int(out.sampled_token_ids[0]))
    return tokens[len(prompt):]


def test_outputs_after_swap_out_and_in_match_a_run_without(tiny_loaded):
    prompt = np.random.default_rng(7).integers(3, 49152, size=37).tolist()
    plain = _greedy(_runner(tiny_loaded, num_kv_blocks=128), prompt, 24)
    swapped = _greedy(_runner(tiny_loaded, num_kv_blocks=128, swap_space_bytes=8 * TINY_BLOCK_BYTES_FP32),
                      prompt, 24, swap_after=5)
    assert len(plain) == 24
    assert swapped == plain


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_swaps_queued_behind_a_step_launched_ahead_give_the_lockstep_results(tiny_loaded, device):
    """The plan that swaps slot 0 out (while the step that computes its last position is still
    in flight) and the one that swaps it back in are queued behind the step before them like any
    other, and every step's tokens are lockstep's: on the CPU over the padded steps run eagerly
    (launch_ahead "on"); on CUDA over the graphs, the swaps' copies asynchronous (its default)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompt = np.random.default_rng(7).integers(3, 49152, size=37).tolist()
    config = {"num_kv_blocks": 128, "swap_space_bytes": 8 * TINY_BLOCK_BYTES_FP32, "device": device}
    loaded = tiny_loaded if device == "cpu" else load_model(tiny_config(device=device))
    config["cuda_graphs"], mode = ("eager", "on") if device == "cpu" else ("auto", "auto")
    recording = Recording(_runner(loaded, launch_ahead="off", **config))
    _greedy(recording, prompt, 12, swap_after=5)
    ahead = _runner(loaded, launch_ahead=mode, **config)
    results = replay_ahead(ahead, recording.steps)
    assert [(o.step_id, o.sampled_token_ids.tolist()) for o in results] == [
        (o.step_id, o.sampled_token_ids.tolist()) for _, o in recording.steps]
    swaps = [i for i, (plan, _) in enumerate(recording.steps) if plan.swap_out_src.size or plan.swap_in_src.size]
    assert len(swaps) == 2 and ahead.ahead.launched == len(recording.steps) - 1  # each behind another


def test_swap_out_then_in_restores_every_layer(tiny_loaded):
    """Blocks to swap ids in runs and alone, out of order (each run moves in one copy), back to
    other device blocks in another order."""
    runner = _runner(tiny_loaded, num_kv_blocks=16, swap_space_bytes=4 * TINY_BLOCK_BYTES_FP32)
    kv = runner.kv_cache
    blocks, swap_ids = [3, 5, 6, 7], [3, 0, 1, 2]
    kv.k[:, blocks] = torch.randn_like(kv.k[:, blocks])
    kv.v[:, blocks] = torch.randn_like(kv.v[:, blocks])
    before_k, before_v = kv.k.clone(), kv.v.clone()
    kv.swap_out(torch.tensor(blocks), torch.tensor(swap_ids))
    kv.k[:, blocks] = 0
    back = [9, 12, 10, 11]  # swap ids 2, 3, 0, 1: runs (2, 3) and (0, 1)
    kv.swap_in(torch.tensor([2, 3, 0, 1]), torch.tensor(back))
    for swap_id, device_block in zip([2, 3, 0, 1], back):
        source = blocks[swap_ids.index(swap_id)]
        assert torch.equal(kv.k[:, device_block], before_k[:, source]), (swap_id, device_block)
        assert torch.equal(kv.v[:, device_block], before_v[:, source]), (swap_id, device_block)


def test_swap_ids_move_in_runs():
    from model_service.attention.kv_cache import _runs

    assert _runs(torch.tensor([3, 0, 1, 2, 7, 5])) == [(3, 0, 1), (0, 1, 3), (7, 4, 1), (5, 5, 1)]
    assert _runs(torch.tensor([], dtype=torch.int64)) == []


def _req(**fields) -> engine_pb2.ExecuteRequest:
    return engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(step_id=1, **fields))


@pytest.mark.parametrize("field, plan, message", [
    ("swap_out_dst", dict(swap_out_src=[1, 2], swap_out_dst=[0]), "length 1 != len(swap_out_src) 2"),
    ("swap_in_dst", dict(swap_in_src=[0], swap_in_dst=[]), "length 0 != len(swap_in_src) 1"),
    ("swap_out_src", dict(swap_out_src=[0], swap_out_dst=[0]), "0 is outside [1, 64)"),
    ("swap_out_dst", dict(swap_out_src=[1], swap_out_dst=[4]), "4 is outside [0, 4)"),
    ("swap_in_src", dict(swap_in_src=[7], swap_in_dst=[3]), "7 is outside [0, 4)"),
    ("swap_in_dst", dict(swap_in_src=[0], swap_in_dst=[64]), "64 is outside [1, 64)"),
    ("swap_out_dst", dict(swap_out_src=[1, 2], swap_out_dst=[3, 3]), "a block is written twice"),
])
def test_bad_swap_ids_name_the_field(tiny_loaded, field, plan, message):
    runner = _runner(tiny_loaded, num_kv_blocks=64, swap_space_bytes=4 * TINY_BLOCK_BYTES_FP32)
    with pytest.raises(PlanError) as error:
        from_pb(_req(**plan), runner.limits)
    assert error.value.field == field and message in error.value.message


def test_swap_without_swap_space_is_refused(tiny_loaded):
    runner = _runner(tiny_loaded, num_kv_blocks=64)
    with pytest.raises(PlanError, match=r"swap_out_dst: 0 is outside \[0, 0\)"):
        from_pb(_req(swap_out_src=[1], swap_out_dst=[0]), runner.limits)


def test_memory_flags_parse_into_the_config():
    from model_service.__main__ import parse_args

    config = parse_args(["--model", "tiny", "--kv-cache-memory", "800KiB", "--swap-space", "80KiB",
                         "--kv-cache-memory-fraction", "0.25", "--served-model-name", "x", "--max-model-len", "256"])
    assert (config.kv_cache_memory_bytes, config.swap_space_bytes) == (800 << 10, 80 << 10)
    assert (config.kv_cache_memory_fraction, config.served_model_name, config.max_model_len) == (0.25, "x", 256)
    assert parse_args(["--kv-cache-memory-bytes", "4096"]).kv_cache_memory_bytes == 4096


def _rank_num_blocks(rank, world_size, init_method, fraction, results):
    import torch.distributed as dist

    from model_service.tp_worker import setup_rank

    config = tiny_config(num_kv_blocks=None, kv_cache_memory_fraction=fraction, tensor_parallel_size=world_size)
    runner, _group = setup_rank(config, rank, world_size, init_method)
    results.put((rank, runner.describe_facts().num_kv_blocks, runner.kv_cache.k.shape[1]))
    dist.destroy_process_group()


def test_tensor_parallel_ranks_agree_on_the_block_count():
    """Each rank measures free memory at its own moment (the other rank is allocating): they must
    all take the same count, or rank 0 would hand out block ids another rank does not have. On
    the CPU the ranks share the host's memory, so each budgets 1/world_size of it."""
    import multiprocessing

    from model_service.tp_worker import free_tcp_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
    fraction = 0.002
    ranks = [context.Process(target=_rank_num_blocks, args=(rank, 2, init_method, fraction, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    counts = sorted(results.get(timeout=300) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    assert counts[0][1:] == counts[1][1:], counts
    per_rank_block = TINY_BLOCK_BYTES_FP32 // 2  # one of the two KV heads per rank
    expected = available_memory_bytes(torch.device("cpu")) / 2 * fraction / per_rank_block
    assert abs(counts[0][1] - expected) <= 0.2 * expected, (counts, expected)
