"""The scheduler's step budget: the engine's step shape (Describe) unless the config sets it, the
contract's CPU shape for an engine that reports none, and a restarted engine's taken on reset."""

from __future__ import annotations

from factories import make_facts, make_request, make_scheduler

from planserve.contract import CONTRACT_VERSION, CPU_STEP
from planserve.v1 import engine_pb2
from scheduler_service.config import SchedulerConfig
from scheduler_service.core.scheduler import step_budget
from scheduler_service.engine.client import EngineFacts


def test_the_config_leaves_the_step_to_the_engine_by_default():
    config = SchedulerConfig()
    assert (config.max_num_batched_tokens, config.max_num_seqs) == (None, None)


def _reply(**fields) -> engine_pb2.DescribeResponse:
    return engine_pb2.DescribeResponse(
        contract_version=CONTRACT_VERSION, model_name="m", vocab_size=10, max_model_len=64,
        block_size=16, num_kv_blocks=8, max_num_slots=256, **fields)


def test_an_engine_reporting_no_step_gets_the_contracts_cpu_shape():
    facts = EngineFacts.from_pb(_reply())
    assert (facts.step_token_budget, facts.step_max_seqs) == (CPU_STEP.token_budget, CPU_STEP.max_seqs)
    assert step_budget(SchedulerConfig(), facts) == (64, 512)  # today's CPU defaults
    facts = EngineFacts.from_pb(_reply(step_token_budget=8192, step_max_seqs=256))
    assert (facts.step_token_budget, facts.step_max_seqs) == (8192, 256)


def test_flags_win_and_sequences_stay_within_the_slots():
    facts = make_facts(max_num_slots=16, step_token_budget=8192, step_max_seqs=16)
    assert step_budget(SchedulerConfig(), facts) == (16, 8192)
    assert step_budget(SchedulerConfig(max_num_batched_tokens=100), facts) == (16, 100)
    assert step_budget(SchedulerConfig(max_num_seqs=4), facts) == (4, 8192)
    assert step_budget(SchedulerConfig(max_num_seqs=400), facts) == (16, 8192)


def test_the_steps_follow_the_engines_budget_and_a_restarted_engines():
    facts = make_facts(num_blocks=200, max_num_slots=16, step_token_budget=20, step_max_seqs=3)
    scheduler = make_scheduler(max_num_batched_tokens=None, max_num_seqs=None, facts=facts)
    for _ in range(5):
        scheduler.add_request(make_request(num_prompt_tokens=50))
    plan = scheduler.schedule()
    assert sum(plan.num_scheduled_tokens) == 20
    scheduler.reset_engine(make_facts(num_blocks=200, max_num_slots=16, step_token_budget=30,
                                      step_max_seqs=2))
    assert (scheduler.token_budget, scheduler.max_num_seqs) == (30, 2)
    plan = scheduler.schedule()
    assert sum(plan.num_scheduled_tokens) == 30 and len(plan.slots) <= 2
