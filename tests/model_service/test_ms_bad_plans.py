"""Bad plans raise PlanError naming the field, and leave the slot state untouched."""
from __future__ import annotations

import pytest

from model_service.batch import from_pb
from model_service.step.plan import PlanError
from planserve.v1 import common_pb2, engine_pb2


def _new(slot=0, tokens=(5, 6, 7), computed=0, **sampling):
    return engine_pb2.NewSequence(
        slot=slot, token_ids=list(tokens), num_computed_tokens=computed, sampling=common_pb2.SamplingParams(seed=1, **sampling)
    )


def _req(step_id=0, **fields) -> engine_pb2.ExecuteRequest:
    return engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(step_id=step_id, **fields))


def _start(runner):
    """Register slot 0 with 3 tokens and prefill it (block 1)."""
    plan = from_pb(_req(new_sequences=[_new()], slots=[0], num_scheduled_tokens=[3], num_new_blocks=[1], new_block_ids=[1]), runner.limits)
    return runner.execute(plan)


STATELESS = [
    ("num_scheduled_tokens", dict(slots=[0], num_scheduled_tokens=[], num_new_blocks=[0])),
    ("new_block_ids", dict(slots=[0], num_scheduled_tokens=[1], num_new_blocks=[2], new_block_ids=[3])),
    ("new_block_ids", dict(slots=[0], num_scheduled_tokens=[1], num_new_blocks=[1], new_block_ids=[0])),
    ("new_block_ids", dict(slots=[0], num_scheduled_tokens=[1], num_new_blocks=[1], new_block_ids=[512])),
    ("copy_dst", dict(copy_src=[1, 2], copy_dst=[3])),
    ("slots", dict(slots=[99], num_scheduled_tokens=[1], num_new_blocks=[0])),
    ("new_sequences[0].token_ids", dict(new_sequences=[_new(tokens=(1, 49152))])),
    ("new_sequences[0].token_ids", dict(new_sequences=[_new(tokens=range(513))])),
    ("new_sequences[0].num_computed_tokens", dict(new_sequences=[_new(computed=3)])),
    ("new_sequences[0].sampling.top_p", dict(new_sequences=[_new(top_p=1.5)])),
    ("new_sequences[0].sampling.temperature", dict(new_sequences=[_new(temperature=-1.0)])),
    ("slots", dict(slots=[1, 1], num_scheduled_tokens=[1, 1], num_new_blocks=[0, 0])),
]


@pytest.mark.parametrize("field,plan", STATELESS)
def test_stateless_checks_name_the_field(tiny_runner, field, plan):
    with pytest.raises(PlanError) as error:
        from_pb(_req(**plan), tiny_runner.limits)
    assert error.value.field == field


STATEFUL = [
    ("slots", dict(slots=[4], num_scheduled_tokens=[1], num_new_blocks=[1], new_block_ids=[2])),
    ("finished_slots", dict(finished_slots=[4])),
    ("new_sequences[0].slot", dict(new_sequences=[_new(slot=0)])),
    ("num_scheduled_tokens", dict(slots=[0], num_scheduled_tokens=[2], num_new_blocks=[0])),
    ("num_new_blocks", dict(new_sequences=[_new(slot=1, tokens=range(20))], slots=[1], num_scheduled_tokens=[20], num_new_blocks=[1], new_block_ids=[2])),
]


@pytest.mark.parametrize("field,plan", STATEFUL)
def test_state_checks_name_the_field_and_change_nothing(tiny_runner, field, plan):
    first = _start(tiny_runner)
    with pytest.raises(PlanError) as error:
        tiny_runner.execute(from_pb(_req(step_id=1, **plan), tiny_runner.limits))
    assert error.value.field == field
    # Slot 0 is exactly as before: a decode of one token still works.
    out = tiny_runner.execute(from_pb(_req(step_id=2, slots=[0], num_scheduled_tokens=[1], num_new_blocks=[0]), tiny_runner.limits))
    assert list(out.num_sampled_tokens) == [1] and first.num_sampled_tokens[0] == 1


def test_beyond_max_model_len(tiny_loaded):
    from conftest import tiny_config
    from model_service.start import build_runner

    runner = build_runner(tiny_loaded, tiny_config())
    tokens = [5] * 512
    plan = _req(new_sequences=[_new(tokens=tokens)], slots=[0], num_scheduled_tokens=[512], num_new_blocks=[32], new_block_ids=list(range(1, 33)))
    out = runner.execute(from_pb(plan, runner.limits))
    assert list(out.num_sampled_tokens) == [1]
    with pytest.raises(PlanError) as error:
        runner.execute(from_pb(_req(step_id=1, slots=[0], num_scheduled_tokens=[1], num_new_blocks=[1], new_block_ids=[40]), runner.limits))
    assert error.value.field in ("num_scheduled_tokens", "num_new_blocks")
