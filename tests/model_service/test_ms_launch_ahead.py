"""Launch-ahead (model_service/step/launch_ahead.py) on the CPU: cuda_graphs "eager" runs the padded
steps a CUDA graph replays, and launch_ahead "on" queues each plan behind the step in flight (plain
plans, and plans that drop and register slots, of greedy or seeded sampled slots), its input tokens
from that step's ids on the device, the slot table holding stand-ins until the step finishes. A run
of plans recorded from a lockstep runner (sequences joining, finishing, a slot reused in the plan
that drops it, chunked prefills, a seeded sampled sequence beside greedy ones, one asking for
logprobs and its top alternatives, two under a grammar's mask, one greedy and one seeded, two
with penalties, bias and min tokens, and one asking for its prompt's logprobs, whose prompt step
waits and whose decodes launch)
replayed this way must give every step's result exactly,
in the CPU's default dtype and in float32: the padded path is batch invariant on the CPU
(test_ms_cuda_graphs.py), and launching ahead moves no arithmetic."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import tiny_config
from dtypes import served_dtypes
from ms_driver import Driver, replay_ahead

from model_service.loading.loader import load_model
from model_service.start import build_runner
from model_service.step import launch_ahead
from model_service.step.plan import LogitsProcessing, PlanArrays, PlanError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Recorder:
    """A runner's execute, each plan and result kept (plain plans marked as the fast path
    would read them); the slots of `masked` sample under a grammar's mask (every third token)."""

    def __init__(self, runner):
        self.runner = runner
        self.steps: list[tuple[PlanArrays, object]] = []
        self.driver: Driver | None = None
        self.masked: set[int] = set()
        vocab = runner.limits.vocab_size
        allowed = np.arange(-(-vocab // 32) * 32) % 3 == 0
        self.bitmask = np.packbits(allowed, bitorder="little").view("<u4")

    def execute(self, plan: PlanArrays):
        seqs = self.driver.seqs
        masked = [
            slot
            for slot, n in zip(plan.slots.tolist(), plan.num_scheduled_tokens.tolist())
            if slot in self.masked and seqs[slot].computed + n >= len(seqs[slot].tokens)
        ]
        plain = not (plan.new_sequences or plan.finished_slots.size or masked)
        plan = dataclasses.replace(plan, plain=plain)
        if masked:
            bitmasks = np.tile(self.bitmask, (len(masked), 1))
            plan = dataclasses.replace(
                plan, masked_slots=np.array(masked, dtype=np.int64), allowed_token_bitmask=bitmasks
            )
        output = self.runner.execute(plan)
        self.steps.append((plan, output))
        return output


def _recorded(runner) -> list[tuple[PlanArrays, object]]:
    recorder = Recorder(runner)
    driver = recorder.driver = Driver(recorder)
    driver.add(0, list(range(3, 40)))
    driver.add(1, list(range(50, 61)))
    driver.run_to_completion(12, chunk=16, joins={4: [(3, list(range(200, 230)))]})
    driver.add(2, list(range(100, 103)), temperature=0.8, top_k=20, seed=7)  # sampled: at once
    # Slot 3 ended in the last step (its token in flight there, at position 41) and is
    # registered again, past that position, in the plan that drops it.
    assert set(driver._pending_drop) == {3}
    driver.add(3, list(range(300, 360)))
    driver.run_to_completion(6, chunk=16)
    recorder.masked.add(6)  # a greedy slot under a mask, beside plain greedy ones only
    driver.add(6, list(range(500, 510)))
    driver.add(12, list(range(520, 530)))
    driver.run_to_completion(4, chunk=16)
    driver.add(5, list(range(400, 420)), with_logprobs=True, num_logprobs=2)
    driver.add(7, list(range(600, 605)), temperature=0.7, top_p=0.9, seed=11)
    recorder.masked.add(7)  # a seeded draw under a mask
    driver.run_to_completion(4, chunk=16)
    # Penalties count the token in flight on the device, bias and min tokens beside them: token
    # 3's bias wins until its frequency penalty has counted it twice, so a token in flight that
    # went uncounted would show as a third 3.
    penalties = LogitsProcessing(
        num_prompt_tokens=8, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=100.0,
        logit_bias=((3, 200.0), (11, -1.5)), min_new_tokens=3, min_tokens_suppressed_ids=(5, 6),
    )  # fmt: skip
    driver.add(8, [700, 701, 702, 700, 703, 704, 701, 705], processing=penalties)
    driver.add(9, list(range(800, 812)), temperature=0.9, seed=5, processing=penalties)
    driver.run_to_completion(5, chunk=16)
    prompt_scored = LogitsProcessing(num_prompt_tokens=12, num_prompt_logprobs=1)
    driver.add(10, list(range(900, 912)), processing=prompt_scored)  # at once
    driver.add(11, list(range(950, 953)))
    driver.run_to_completion(3, chunk=16)
    return recorder.steps


def _sampled(plan: PlanArrays, output, slot: int) -> int | None:
    """The token `slot` sampled in this step, if it did."""
    sampling = plan.slots[output.num_sampled_tokens > 0].tolist()
    return int(output.sampled_token_ids[sampling.index(slot)]) if slot in sampling else None


def _result(output) -> tuple:
    ids, logprobs = output.sampled_token_ids.tolist(), output.logprobs.tolist()
    return (output.step_id, output.num_sampled_tokens.tolist(), ids, logprobs)


def _runners(dtype: str, device: str = "cpu"):
    """(lockstep, launching ahead) runners over one loaded model: on the CPU the padded steps
    run eagerly and launch_ahead is "on"; on CUDA the graphs replay and it is the default."""
    if device == "cpu":
        config = tiny_config(dtype=dtype, cuda_graphs="eager", profile_step_tokens=48)
    else:
        config = tiny_config(device=device, dtype=dtype, profile_step_tokens=64)
    loaded = load_model(config)
    lockstep = build_runner(loaded, dataclasses.replace(config, launch_ahead="off"))
    mode = "on" if device == "cpu" else "auto"
    ahead = build_runner(loaded, dataclasses.replace(config, launch_ahead=mode))
    return lockstep, ahead


@pytest.mark.parametrize(
    "dtype, device",
    [(d, "cpu") for d in served_dtypes("tiny")]
    + [pytest.param(d, "cuda", marks=[pytest.mark.gpu, needs_cuda]) for d in ("float32", "auto")],
)
def test_steps_launched_ahead_give_the_lockstep_results(dtype, device):
    """On CUDA: the graphs' replays, the pinned double buffers and the device-side tokens."""
    lockstep, ahead = _runners(dtype, device)
    assert lockstep.ahead is None and lockstep.compute["launch_ahead"] == "off (launch_ahead=off)"
    assert ahead.ahead is not None and ahead.compute["launch_ahead"] == launch_ahead.DESCRIBED
    steps = _recorded(lockstep)
    plain = sum(plan.plain for plan, _ in steps)
    assert 10 <= plain < len(steps)  # registrations and drops between runs of plain steps

    results = replay_ahead(ahead, steps)
    assert [_result(o) for o in results] == [_result(o) for _, o in steps]
    # Every step that schedules a slot launched (the sampled slots 2, 7 and 9 draw from their
    # seed and position alone, slots 6 and 7 under masks, slot 5's logprobs come back with its
    # ids, slots 8 and 9 count their token in flight on the device) but slot 10's prompt step
    # (its prompt's logprobs; its decodes launch); behind another where that one launched too.
    for plan, output in steps:  # the masks bind: every masked token is one the mask allows
        sampling = plan.slots[output.num_sampled_tokens > 0]
        masked = output.sampled_token_ids[np.isin(sampling, plan.masked_slots)]
        assert (masked % 3 == 0).all()
    assert sum(plan.masked_slots.size for plan, _ in steps) >= 6
    assert any(output.logprob_token_ids.size for _, output in steps)
    penalized = [_sampled(plan, output, 8) for plan, output in steps]
    assert [t for t in penalized if t is not None][:3] in ([3, 3, t] for t in range(4, 10**6))
    scores_prompt = [any(seq.slot == 10 for seq in plan.new_sequences) for plan, _ in steps]
    launches = [plan.slots.size > 0 and not scored for (plan, _), scored in zip(steps, scores_prompt)]
    assert launches[-3:] == [False, True, True]  # slot 10's prompt, then its two decodes
    behind = sum(a and b for a, b in zip(launches, launches[1:]))
    assert behind >= len(steps) // 2 and ahead.ahead.launched == behind
    live = lockstep.slot_table.active.nonzero()[0]
    assert (ahead.slot_table.active.nonzero()[0] == live).all()


def test_a_bad_plan_behind_a_launched_step_changes_nothing_and_the_step_still_finishes():
    lockstep, ahead = _runners("float32")
    steps = _recorded(lockstep)
    first_plain = next(i for i, (plan, _) in enumerate(steps) if plan.plain and i > 6)
    in_flight = None
    for plan, _ in steps[:first_plain]:
        _, in_flight = ahead.step_ahead(plan, in_flight)
    plan, expected = steps[first_plain]
    done, in_flight = ahead.step_ahead(plan, in_flight)
    assert in_flight is not None  # launched, its tokens not on the host yet
    tokens_before = ahead.slot_table.num_tokens.copy()
    bad = dataclasses.replace(
        steps[first_plain + 1][0], num_scheduled_tokens=np.full_like(plan.slots, 10_000)
    )
    with pytest.raises(PlanError, match="num_scheduled_tokens"):
        ahead.step_ahead(bad, in_flight)
    assert (ahead.slot_table.num_tokens == tokens_before).all()
    assert _result(ahead.finish(in_flight)) == _result(expected)


def test_an_abandoned_step_is_waited_for_and_writes_nothing():
    """A stream that ends with a step in flight only waits for it: by then a new stream may
    have reset the slots and registered others there, which its ids must not touch."""
    lockstep, ahead = _runners("float32")
    steps = _recorded(lockstep)
    in_flight = None
    for plan, _ in steps[:8]:
        _, in_flight = ahead.step_ahead(plan, in_flight)
    assert in_flight is not None
    tokens = ahead.slot_table.tokens.copy()
    ahead.ahead.wait_for(in_flight)
    assert (ahead.slot_table.tokens == tokens).all()
    assert _result(ahead.finish(in_flight)) == _result(steps[7][1])  # finishing does write
    assert (ahead.slot_table.tokens != tokens).any()


def test_the_cpus_steps_never_launch_ahead_unless_asked(tiny_loaded):
    default = build_runner(tiny_loaded, tiny_config())
    assert default.ahead is None
    assert default.compute["launch_ahead"] == "off (steps not padded)"
    padded = build_runner(tiny_loaded, tiny_config(cuda_graphs="eager", profile_step_tokens=48))
    assert padded.ahead is None and padded.compute["launch_ahead"] == "off (device cpu)"


def test_runners_whose_steps_cannot_queue_padded_say_why(tiny_loaded):
    """A drafting runner (speculation) never launches ahead, nor one whose adapter rows run
    unpadded (the torch LoRA path; the Triton path launches: test_ms_lora_triton_forward.py)."""
    asked = {"cuda_graphs": "eager", "profile_step_tokens": 48, "launch_ahead": "on"}
    drafting = build_runner(tiny_loaded, tiny_config(speculative_method="ngram", **asked))
    assert drafting.ahead is None
    assert drafting.compute["launch_ahead"] == "off (speculative drafts)"
    adapters = build_runner(tiny_loaded, tiny_config(enable_lora=True, lora_kernel="torch", **asked))
    assert adapters.ahead is None and adapters.graphs.lora_stack is None
    assert adapters.compute["launch_ahead"] == "off (adapter rows not padded)"


async def test_a_bad_plan_ends_the_stream_with_a_step_launched_and_the_next_stream_serves(
    tiny_loaded, monkeypatch
):
    """Over the real server: a registration and two decodes, each launched behind the one
    before, then a plan for a slot never registered: the first two are answered, the stream
    ends with
    INVALID_ARGUMENT naming the field (the launched step unanswered: the scheduler recovers the
    whole stream), and a new stream registers the same slot at once (the slots were dropped)."""
    import grpc

    from model_service.server import serve, shutdown
    from planserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    # Each launched step waits for the next plan however loaded the machine (the client sends
    # them all at once): which steps are answered does not depend on the timing.
    monkeypatch.setattr(launch_ahead, "HOLD_NS", 2_000_000_000)
    config = tiny_config(port=0, cuda_graphs="eager", profile_step_tokens=48, launch_ahead="on")
    runner = build_runner(tiny_loaded, config)
    server = await serve(config, runner=runner)
    sampling = common_pb2.SamplingParams(temperature=0.0)
    register = engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(
        step_id=0, slots=[0], num_scheduled_tokens=[10], num_new_blocks=[1], new_block_ids=[1],
        new_sequences=[engine_pb2.NewSequence(slot=0, token_ids=list(range(10, 20)),
                                              sampling=sampling)]))  # fmt: skip

    def decode(step_id: int, slot: int = 0) -> engine_pb2.ExecuteRequest:
        return engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(
            step_id=step_id, slots=[slot], num_scheduled_tokens=[1], num_new_blocks=[0]))  # fmt: skip

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            launched = runner.ahead.launched
            call = stub.Execute(iter([register, decode(1), decode(2), decode(3, slot=5)]))
            answered = []
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for response in call:
                    answered.append(response.result.step_id)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "slots" in error.value.details()
            assert answered == [0, 1] and runner.ahead.launched == launched + 2
            again = stub.Execute(iter([register, decode(1)]))
            assert [r.result.step_id async for r in again] == [0, 1]
    finally:
        await shutdown(server, grace_s=0.5)
