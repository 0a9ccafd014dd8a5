"""Fuzz a live model service (the tiny model, real compute) with random Execute streams of
random plans: every stream ends in bounded time with results or INVALID_ARGUMENT naming a field,
never INTERNAL (a plan the checks let through and the runner then failed on) nor UNKNOWN; the
process stays up, and afterwards the same valid plans give the same tokens as before the fuzz
(no state leaked across streams)."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from conftest import EngineProcess
from fuzz_settings import FUZZ
from proto_strategies import messages
from planserve.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.slow(
    reason="150 random examples a property, each a round trip to a live server (PLANSERVE_FUZZ_EXAMPLES sets fewer)"
)

CALL_TIMEOUT_S = 60  # (a plan runs real steps: longer than the shared 30 s)
NUM_KV_BLOCKS = 32

# Values near the real bounds (a few slots, a few blocks, a short vocabulary prefix), with the
# edges and far-out values mixed in, so that many plans pass the stateless checks.
SMALL = st.one_of(st.integers(0, 6), st.integers(0, NUM_KV_BLOCKS + 1),
                  st.sampled_from([2**32 - 1, 255, 256, 512, 513]))
PLAN = messages(engine_pb2.ExecuteRequest, overrides={
    "slot": SMALL, "slots": SMALL, "num_scheduled_tokens": SMALL, "num_new_blocks": SMALL,
    "new_block_ids": SMALL, "finished_slots": SMALL, "preempted_slots": SMALL,
    "aborted_slots": SMALL, "copy_src": SMALL, "copy_dst": SMALL, "token_ids": SMALL,
    "num_computed_tokens": SMALL, "swap_out_src": SMALL, "swap_out_dst": SMALL,
    "swap_in_src": SMALL, "swap_in_dst": SMALL, "masked_slots": SMALL,
    "num_prompt_tokens": SMALL, "step_id": st.integers(0, 10),
})


def _valid_plans() -> list[engine_pb2.ExecuteRequest]:
    """Two sequences: prefill, then three decodes, then finished."""
    plans = []
    first = engine_pb2.ExecuteRequest()
    for slot, tokens in ((0, [5, 6, 7, 8, 9]), (1, [11, 12, 13])):
        sequence = first.plan.new_sequences.add(slot=slot, token_ids=tokens)
        sequence.sampling.temperature = 0.0
    first.plan.step_id = 1
    first.plan.slots.extend([0, 1])
    first.plan.num_scheduled_tokens.extend([5, 3])
    first.plan.num_new_blocks.extend([1, 1])
    first.plan.new_block_ids.extend([1, 2])
    plans.append(first)
    for step in range(2, 5):
        decode = engine_pb2.ExecuteRequest()
        decode.plan.step_id = step
        decode.plan.slots.extend([0, 1])
        decode.plan.num_scheduled_tokens.extend([1, 1])
        decode.plan.num_new_blocks.extend([0, 0])
        plans.append(decode)
    end = engine_pb2.ExecuteRequest()
    end.plan.step_id = 5
    end.plan.finished_slots.extend([0, 1])
    plans.append(end)
    return plans


def _run(stub, plans) -> tuple[grpc.StatusCode, list[list[int]], str]:
    tokens = []
    try:
        for response in stub.Execute(iter(plans), timeout=CALL_TIMEOUT_S):
            tokens.append(list(response.result.sampled_token_ids))
    except grpc.RpcError as error:
        return error.code(), tokens, error.details()
    return grpc.StatusCode.OK, tokens, ""


@pytest.fixture(scope="module")
def engine():
    process = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks",
                            str(NUM_KV_BLOCKS), "--max-num-slots", "8")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def stub(engine):
    with grpc.insecure_channel(engine.address) as channel:
        yield engine_pb2_grpc.EngineServiceStub(channel)


@pytest.fixture(scope="module")
def reference_tokens(stub):
    code, tokens, details = _run(stub, _valid_plans())
    assert code == grpc.StatusCode.OK, details
    return tokens


@FUZZ
@given(plans=st.lists(PLAN, min_size=1, max_size=3), prefix=st.integers(0, 4))
def test_random_plans_get_results_or_invalid_argument(stub, reference_tokens, plans, prefix):
    # Some streams start with valid steps, so that random plans also meet registered slots.
    code, _, details = _run(stub, _valid_plans()[:prefix] + plans)
    event(code.name)  # see --hypothesis-show-statistics
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert ":" in details, details  # "field: what is wrong"


def test_after_the_fuzz_the_engine_computes_the_same_tokens(engine, stub, reference_tokens):
    assert engine.process.poll() is None
    code, tokens, details = _run(stub, _valid_plans())
    assert code == grpc.StatusCode.OK, details
    assert tokens == reference_tokens
