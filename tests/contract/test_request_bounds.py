"""One owner per contract fact (planserve/contract.py): the model service reports the contract's
version and sampling bounds in Describe and checks plans by them; the scheduler takes the bounds
the engine reported (the contract's where an older engine reports none) and refuses a request
outside them, naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from model_service.batch import facts_to_pb, from_pb
from model_service.described import DescribedFacts
from model_service.step.plan import PlanError, PlanLimits
from planserve.contract import CONTRACT_VERSION, REQUEST_BOUNDS
from planserve.v1 import engine_pb2, generate_pb2
from scheduler_service.api import intake
from scheduler_service.api.intake import InvalidRequest
from scheduler_service.engine.client import EngineFacts


def _described() -> engine_pb2.DescribeResponse:
    facts = DescribedFacts(
        model_name="m", architecture="LlamaForCausalLM", dtype="float32", device="cpu",
        vocab_size=1000, max_model_len=64, block_size=16, num_kv_blocks=8, max_num_slots=4,
        eos_token_ids=[2], bos_token_id=None, tokenizer_json="{}", chat_template="",
        special_tokens={},
    )  # fmt: skip
    return facts_to_pb(facts)


def test_describe_reports_the_contracts_version_and_bounds_and_the_scheduler_reads_them():
    reply = _described()
    assert reply.contract_version == CONTRACT_VERSION
    facts = EngineFacts.from_pb(reply)
    assert facts.bounds == REQUEST_BOUNDS
    assert reply.request_bounds.max_logit_bias == REQUEST_BOUNDS.max_logit_bias
    assert reply.max_top_logprobs == REQUEST_BOUNDS.max_top_logprobs


def test_the_scheduler_checks_requests_by_the_bounds_the_engine_reported():
    reply = _described()
    reply.max_top_logprobs = 3
    reply.request_bounds.max_logit_bias = 5.0
    reply.request_bounds.max_penalty = 0.5
    facts = EngineFacts.from_pb(reply)
    assert facts.bounds == dataclasses.replace(
        REQUEST_BOUNDS, max_top_logprobs=3, max_logit_bias=5.0, max_penalty=0.5
    )
    request = generate_pb2.GenerateRequest()
    request.sampling.logit_bias[7] = 6.0
    with pytest.raises(InvalidRequest, match=r"sampling.logit_bias\[7\]: must be in \[-5, 5\], got 6"):
        intake._sampling(request, facts)
    request = generate_pb2.GenerateRequest()
    request.sampling.presence_penalty = 0.75
    with pytest.raises(InvalidRequest, match=r"sampling.presence_penalty: must be in \[-0.5, 0.5\]"):
        intake._sampling(request, facts)
    request = generate_pb2.GenerateRequest(logprobs=True, top_logprobs=4)
    with pytest.raises(InvalidRequest, match=r"top_logprobs: must be in \[0, 3\], got 4"):
        intake._check_logprobs(request, facts.bounds.max_top_logprobs)


def test_an_engine_that_reports_no_bounds_gets_the_contracts():
    reply = _described()
    reply.ClearField("request_bounds")
    reply.max_top_logprobs = 0
    assert EngineFacts.from_pb(reply).bounds == REQUEST_BOUNDS


def test_the_model_service_checks_plans_by_the_same_bounds():
    limits = PlanLimits(vocab_size=1000, num_kv_blocks=8, max_num_slots=4, max_model_len=64)
    request = engine_pb2.ExecuteRequest()
    request.plan.step_id = 1
    seq = request.plan.new_sequences.add(slot=0, token_ids=[1, 2, 3])
    seq.sampling.seed = 1
    seq.sampling.repetition_penalty = REQUEST_BOUNDS.max_repetition_penalty + 0.5
    request.plan.slots.append(0)
    request.plan.num_scheduled_tokens.append(3)
    request.plan.num_new_blocks.append(1)
    request.plan.new_block_ids.append(1)
    with pytest.raises(PlanError, match=r"repetition_penalty: 2.5 is outside \(0, 2\]"):
        from_pb(request, limits)
    seq.sampling.repetition_penalty = 1.5
    for token_id in range(REQUEST_BOUNDS.max_logit_bias_entries + 1):
        seq.sampling.logit_bias[token_id] = 1.0
    with pytest.raises(PlanError, match=r"logit_bias: 301 entries exceed 300"):
        from_pb(request, limits)
