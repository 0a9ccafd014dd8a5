"""The LoRA path on CUDA (model_service/lora/triton_stack.py): the grouped Triton kernels called
from the forward, over a device stack of fixed slots, eagerly and inside the captured steps.

On the CPU (CI) the forward runs the kernels under Triton's interpreter, forced with
lora_kernel="triton", in a child process (Triton reads TRITON_INTERPRET at import, as in
test_ms_triton_ops.py): the tiny model in float32 (parity with the torch grouped path needs it)
with three peft adapters (ranks 4, 16 and 7; all linear, attention only, and q/v/down) and a
base-model row, chunked prefills and decodes:
- greedy tokens equal the torch grouped path's, logprobs within 5e-5 (the GEMMs sum in another
  order), and the adapters change the tokens they apply to;
- a sequence alone gives its bits among the others (batch invariance; an adapter's row and the
  base row, as the interpreter is slow);
- cuda_graphs "eager" (the captured steps' bookkeeping: buckets, padding, each row's slot in the
  static buffers, padding rows -1) gives the plain Triton path's bits;
- with launch_ahead "on" over those padded steps, each step with adapter rows queued behind the
  one in flight gives the lockstep runner's results.
Without the interpreter: the decider, and the stack's slots (addresses fixed across loads and
evicts, each adapter's factors in its slot). The `gpu` tests run graphs on and off with adapters,
and launch-ahead (CUDA's default) against lockstep.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from interpreted_tests import INTERPRETED, run_interpreted
from conftest import tiny_config
from lora_adapters import ALL_LINEAR, ATTENTION, save_adapter
from ms_driver import Driver, Recording, replay_ahead

from model_service.config import compute_env_defaults
from model_service.lora import triton_lora
from model_service.lora.store import AdapterStore
from model_service.lora.targets import model_targets
from model_service.lora.triton_stack import kernel_path
from model_service.start import build_runner
from model_service.step import launch_ahead
from model_service.step.padded_step import PaddedStep

interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the interpreter's child process (module docstring)"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SPECS = ((4, ALL_LINEAR, 1), (16, ATTENTION, 2), (7, ["q_proj", "v_proj", "down_proj"], 3))
PROMPTS = {0: list(range(3, 20)), 1: list(range(50, 57)), 2: list(range(100, 111)), 3: [5, 6, 7]}
LORA_OF_SLOT = {0: 1, 1: 2, 2: 0, 3: 3}  # slot 2: the base model


@pytest.fixture(scope="module")
def folders(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    made = []
    for index, (rank, targets, seed) in enumerate(SPECS):
        save_adapter(tiny_hf, str(root / str(index)), rank, targets, seed=seed)
        made.append(str(root / str(index)))
    return made


def _runner(loaded, folders, kernel, monkeypatch, **overrides):
    config = tiny_config(
        enable_lora=True, max_loras=3, profile_step_tokens=48, lora_kernel=kernel, **overrides
    )
    runner = build_runner(loaded, config)
    for lora_id, folder in enumerate(folders, start=1):
        runner.load_adapter(lora_id, f"adapter{lora_id}", folder)
    return runner


def _run(runner, slots=tuple(PROMPTS), lora_of_slot=LORA_OF_SLOT):
    driver = Driver(runner)
    for slot in slots:
        driver.add(slot, PROMPTS[slot], with_logprobs=True, lora_id=lora_of_slot[slot])
    return driver.run_to_completion(6, chunk=8), driver.logprobs


def test_the_decider_takes_triton_on_cuda_only_unless_forced(tiny_runner, monkeypatch):
    assert kernel_path(torch.device("cpu"), "auto") == ("torch", "device cpu")
    assert kernel_path(torch.device("cuda"), "torch") == ("torch", "lora_kernel=torch")
    if triton_lora.triton is not None:
        assert kernel_path(torch.device("cuda"), "auto") == ("triton", "CUDA")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match=r"lora_kernel \(PLANSERVE_LORA_KERNEL\): 'triton' on"):
            kernel_path(torch.device("cpu"), "triton")
    with pytest.raises(ValueError, match="lora_kernel"):
        tiny_config(lora_kernel="fast").validate()
    assert compute_env_defaults({"PLANSERVE_LORA_KERNEL": "torch"}) == {"lora_kernel": "torch"}


def test_the_stack_keeps_its_addresses_and_puts_each_adapter_in_its_slot(tiny_loaded, folders):
    from safetensors.torch import load_file

    targets = model_targets(tiny_loaded.arch)
    store = AdapterStore(3, 16, 3, targets, torch.float32, torch.device("cpu"), kernel="triton")
    stack = store.triton
    assert stack is not None and stack.slots == 3 and stack.rank == 16
    tensors = [m.a for layer in stack.layers for m in layer.values()] + [stack.scale]
    tensors += [b for layer in stack.layers for m in layer.values() for _, _, b, _ in m.parts]
    addresses = [t.data_ptr() for t in tensors]
    for lora_id, folder in enumerate(folders, start=1):
        store.load(lora_id, f"a{lora_id}", folder)
    assert store.step_view()[1].slot_of == {1: 0, 2: 1, 3: 2}
    store.evict(2)
    store.load(4, "again", folders[2])  # rank 7, q/v/down, into the rank-16 adapter's slot
    assert store.step_view()[1].slot_of == {1: 0, 3: 2, 4: 1}
    assert [t.data_ptr() for t in tensors] == addresses  # what a captured graph holds
    saved = load_file(os.path.join(folders[2], "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1"
    qkv, o = stack.layers[1]["qkv_proj"], stack.layers[1]["o_proj"]
    v_a = saved[f"{prefix}.self_attn.v_proj.lora_A.weight"]
    v_b = saved[f"{prefix}.self_attn.v_proj.lora_B.weight"]
    assert torch.equal(qkv.a[1, 32:39], v_a) and not qkv.a[1, 39:48].any()
    assert torch.equal(qkv.parts[2][2][1, :, :7], v_b) and not qkv.parts[2][2][1, :, 7:].any()
    assert not qkv.a[1, 16:32].any() and not o.a[1].any()  # the old adapter's k and o are gone
    assert stack.scale[1].item() == pytest.approx(16 / 7)
    adapter = store.snapshot()[4]  # the slots are the device copy; the adapter stays on the host
    assert next(iter(adapter.layers[0]["qkv_proj"])).a.weight.device.type == "cpu"


def test_the_padded_steps_lora_slots_are_the_rows_then_minus_one():
    """What a captured step with adapter rows reads: each row's slot, then -1 to the bucket's
    end (padding runs no adapter), and -1 everywhere for a step without adapter rows."""
    step = PaddedStep(48, 16, 8, 16, 2, torch.device("cpu"))
    step.clear()
    assert (step.lora_slots(48) == -1).all()
    x = SimpleNamespace(
        num_tokens=5, input_ids=np.arange(5), positions=np.arange(5), slot_mapping=np.arange(5),
        query_start=np.array([0, 3]), context_lens=np.array([3, 2]),
        block_tables=np.ones((2, 1), dtype=np.int64),
    )  # fmt: skip
    n, logits = np.array([3, 2]), np.array([2, 4])
    step.fill(x, n, logits, 8, np.array([2, 2, 2, -1, 0]))
    assert step.lora_slots(8).tolist() == [2, 2, 2, -1, 0, -1, -1, -1]
    step.fill(x, n, logits, 8)
    assert step.lora_slots(8).tolist() == [-1] * 8


@interpreted
def test_interpreted_triton_forward_equals_the_torch_grouped_path(
    tiny_loaded, folders, monkeypatch
):
    calls = []
    shrink = triton_lora.shrink
    monkeypatch.setattr(triton_lora, "shrink", lambda *a: calls.append(1) or shrink(*a))
    tokens, logprobs = _run(_runner(tiny_loaded, folders, "triton", monkeypatch))
    assert calls  # the kernels ran in the forward
    grouped_tokens, grouped_logprobs = _run(_runner(tiny_loaded, folders, "torch", monkeypatch))
    assert tokens == grouped_tokens
    for slot, values in logprobs.items():
        assert np.allclose(values, grouped_logprobs[slot], rtol=0, atol=5e-5), slot
    base = {slot: 0 for slot in PROMPTS}
    base_tokens, _ = _run(_runner(tiny_loaded, folders, "torch", monkeypatch), lora_of_slot=base)
    assert base_tokens[2] == tokens[2]  # the base row is the base model's
    assert all(base_tokens[s] != tokens[s] for s in (0, 1, 3))  # each adapter applies


@interpreted
def test_interpreted_rows_alone_and_padded_steps_give_the_same_bits(
    tiny_loaded, folders, monkeypatch
):
    together = _run(_runner(tiny_loaded, folders, "triton", monkeypatch))
    for slot in (1, 2):  # the rank-16 adapter's row and the base row (each run costs seconds)
        alone = _run(_runner(tiny_loaded, folders, "triton", monkeypatch), slots=(slot,))
        assert alone[0][slot] == together[0][slot], slot
        assert np.array_equal(np.float32(alone[1][slot]), np.float32(together[1][slot])), slot
    padded = _runner(tiny_loaded, folders, "triton", monkeypatch, cuda_graphs="eager")
    assert padded.compute["cuda_graphs"].endswith("adapter rows included")
    assert _run(padded) == together
    assert padded.graphs.replays >= 6  # mixed and decode-only steps with adapter rows, padded


@interpreted
def test_interpreted_steps_with_adapter_rows_launched_ahead_give_the_lockstep_results(
    tiny_loaded, folders, monkeypatch
):
    """launch_ahead "on" over the padded steps (cuda_graphs "eager"): each plan with adapter
    rows queued behind the step in flight, its rows' slots in the padded buffer, its input
    tokens from that step's ids, gives the lockstep runner's results bit for bit; a sequence
    joins mid-run with its own adapter, and the others finish and are dropped."""
    _launched_ahead_equal_lockstep(tiny_loaded, folders, "triton", "on", cuda_graphs="eager")


def _launched_ahead_equal_lockstep(loaded, folders, kernel, mode, **config):
    lockstep = _runner(loaded, folders, kernel, None, launch_ahead="off", **config)
    ahead = _runner(loaded, folders, kernel, None, launch_ahead=mode, **config)
    assert ahead.compute["launch_ahead"] == launch_ahead.DESCRIBED
    recording = Recording(lockstep, mark_plain=True)
    driver = Driver(recording)
    for slot in (0, 1, 2):
        driver.add(slot, PROMPTS[slot], with_logprobs=True, lora_id=LORA_OF_SLOT[slot])
    driver.run_to_completion(5, chunk=8, joins={3: [(3, PROMPTS[3])]}, lora_ids={3: 3})
    steps = recording.steps
    assert any(plan.plain for plan, _ in steps) and any(plan.new_sequences for plan, _ in steps)

    results = replay_ahead(ahead, steps)
    result = lambda o: (o.step_id, o.num_sampled_tokens.tolist(), o.sampled_token_ids.tolist(),
                        o.logprobs.tolist())  # fmt: skip
    assert [result(o) for o in results] == [result(o) for _, o in steps]
    # Every step has adapter rows (slots 0 and 1 run theirs to the end), every one ran padded,
    # and each launched behind the one before it but the first and the last (nothing after).
    assert ahead.graphs.replays == len(steps)
    assert ahead.ahead.launched >= len(steps) - 2


@pytest.mark.gpu
@needs_cuda
def test_steps_with_adapter_rows_launched_ahead_on_cuda_give_the_lockstep_results(folders):
    """float32 on CUDA: the graphs with the LoRA kernels replayed behind the step in flight
    (launch_ahead's default there), the pinned buffers and the device-side tokens."""
    from model_service.loading.loader import load_model

    config = {"device": "cuda", "profile_step_tokens": 48}
    loaded = load_model(tiny_config(**config))
    _launched_ahead_equal_lockstep(loaded, folders, "auto", "auto", **config)


@pytest.mark.slow(reason="Triton's interpreter runs the LoRA kernels in Python: ~45 s at load 5")
def test_the_lora_forward_under_tritons_interpreter():
    run_interpreted(__file__, "3 passed", 900)


@pytest.mark.gpu
@needs_cuda
def test_replayed_steps_with_adapter_rows_give_the_eager_steps_tokens(folders, monkeypatch):
    """float32 on CUDA: the Triton path with graphs (adapter rows replayed) against graphs off,
    before and after an evict and a load into the freed slot."""
    from model_service.loading.loader import load_model

    config = tiny_config(device="cuda", enable_lora=True, max_loras=3, profile_step_tokens=48)
    loaded = load_model(config)
    runs = {}
    for graphs in ("auto", "off"):
        runner = build_runner(loaded, dataclasses.replace(config, cuda_graphs=graphs))
        assert runner.compute["lora"].startswith("triton grouped kernels (CUDA)")
        if graphs == "auto":  # each bucket's base graph and its graph with the LoRA kernels
            assert runner.compute["cuda_graphs"].endswith("rows included (graphs of their own)")
            assert len(runner.graphs.graphs) == 2 * len(runner.graphs.sizes)
        for lora_id, folder in enumerate(folders, start=1):
            runner.load_adapter(lora_id, f"adapter{lora_id}", folder)
        first = _run(runner)[0]
        runner.reset()  # the last step's finished slots
        runner.evict_adapter(2)
        runner.load_adapter(4, "again", folders[0])
        second = _run(runner, lora_of_slot={**LORA_OF_SLOT, 1: 4})[0]
        runs[graphs] = (first, second, runner.graphs.replays if runner.graphs else 0)
    assert runs["auto"][:2] == runs["off"][:2]
    assert runs["auto"][2] >= 12 and runs["off"][2] == 0
    assert runs["auto"][0][1] != runs["auto"][1][1]  # slot 1's new adapter applies
