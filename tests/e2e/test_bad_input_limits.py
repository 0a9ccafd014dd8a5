"""More bad input, each with the status naming the field and the bound (docs/bad-input.md):
the public API's remaining per-field bounds, undecodable bytes, configuration names, and plans
the model service refuses over gRPC (out-of-order steps, unknown sequences, ids out of range).
After each, the server serves as before."""
from __future__ import annotations

import grpc
import pytest
import pytest_asyncio

from api import complete, greedy_ids_request, stub_for
from conftest import EngineProcess
from planserve.v1 import engine_pb2, engine_pb2_grpc, generate_pb2
from scheduler_service.api import intake
from scheduler_service.config import SchedulerConfig


def _request(**fields) -> generate_pb2.GenerateRequest:
    request = greedy_ids_request([1, 2, 3], 4)
    for name, value in fields.items():
        target = request
        *path, last = name.split(".")
        for part in path:
            target = getattr(target, part)
        if isinstance(value, list):
            getattr(target, last).extend(value)
        else:
            setattr(target, last, value)
    return request


BAD_REQUESTS = {
    "too many stop strings": (
        _request(**{"stopping.stop": ["x"] * (intake.MAX_STOP_STRINGS + 1)}),
        f"stopping.stop: at most {intake.MAX_STOP_STRINGS} stop strings"),
    "stop string too long": (
        _request(**{"stopping.stop": ["x" * (intake.MAX_STOP_STRING_CHARS + 1)]}),
        f"stopping.stop[0]: length must be in [1, {intake.MAX_STOP_STRING_CHARS}]"),
    "empty stop string": (_request(**{"stopping.stop": [""]}),
                          f"stopping.stop[0]: length must be in [1, {intake.MAX_STOP_STRING_CHARS}]"),
    "n 0": (_request(n=0), f"n: must be in [1, {intake.MAX_SAMPLES}], got 0"),
    "n above the bound": (_request(n=intake.MAX_SAMPLES + 1),
                          f"n: must be in [1, {intake.MAX_SAMPLES}]"),
    "deadline_ms 0": (_request(deadline_ms=0), "deadline_ms: must be >= 1 when set, got 0"),
    "ttft_target_ms 0": (_request(ttft_target_ms=0),
                         "ttft_target_ms: must be >= 1 when set, got 0"),
    "tenant too long": (_request(tenant="t" * (intake.MAX_TENANT_CHARS + 1)),
                        f"tenant: at most {intake.MAX_TENANT_CHARS} characters"),
    "cache_salt too long": (_request(cache_salt="s" * (intake.MAX_CACHE_SALT_CHARS + 1)),
                            f"cache_salt: at most {intake.MAX_CACHE_SALT_CHARS} characters"),
    "request_id too long": (_request(request_id="r" * (intake.MAX_REQUEST_ID_CHARS + 1)),
                            f"request_id: at most {intake.MAX_REQUEST_ID_CHARS} characters"),
    "stream_interval 0": (_request(stream_interval=0),
                          f"stream_interval: must be in [1, {intake.MAX_STREAM_INTERVAL}]"),
}


async def _still_serves(stub) -> None:
    after = await complete(stub, greedy_ids_request([1, 2, 3], 3))
    assert after.finish_reason == generate_pb2.FINISH_REASON_LENGTH and len(after.token_ids) == 3


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
async def test_bad_field_is_invalid_argument_naming_field_and_bound(tiny_server, case):
    request, expected = BAD_REQUESTS[case]
    stub = stub_for(tiny_server)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await complete(stub, request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in raised.value.details()
    await _still_serves(stub)


async def test_bytes_that_are_not_a_message_get_invalid_argument(tiny_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tiny_server.port}") as channel:
        call = channel.unary_stream("/planserve.v1.GenerationService/Generate")(b"\xff\xff")
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in call:
                pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request: the bytes are not a valid planserve.v1.GenerateRequest" in \
        raised.value.details()
    await _still_serves(stub_for(tiny_server))


async def test_abort_of_an_unknown_id_is_not_found(tiny_server):
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub_for(tiny_server).Abort(generate_pb2.AbortRequest(request_id="nobody"))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert "request_id: no request 'nobody' in flight" in raised.value.details()


async def test_session_request_without_an_id_gets_a_session_error(tiny_server):
    stub = stub_for(tiny_server)
    requests = [generate_pb2.SessionRequest(generate=greedy_ids_request([1, 2, 3], 2))]
    replies = [reply async for reply in stub.Session(iter(requests))]
    assert [r.WhichOneof("kind") for r in replies] == ["error"]
    assert replies[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert replies[0].error.message == "request_id: must be set on a Session"
    await _still_serves(stub)


def test_unknown_policy_name_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError) as raised:
        SchedulerConfig(policy="no-such-policy").validate()
    assert "no-such-policy" in str(raised.value) and "fcfs" in str(raised.value)


@pytest.mark.parametrize("field,value,message", [
    ("max_queue_tokens", 0, "max_queue_tokens must be >= 1, got 0"),
    ("max_stream_buffer_chunks", 0, "max_stream_buffer_chunks must be >= 1, got 0"),
    ("drain_grace_s", -1.0, "drain_grace_s must be >= 0, got -1.0"),
    ("max_message_bytes", 10, "max_message_bytes must be >= 1024, got 10"),
    ("tls_cert", "cert.pem", "tls_cert and tls_key go together"),
])
def test_bad_hardening_settings_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError) as raised:
        SchedulerConfig(**{field: value}).validate()
    assert message in str(raised.value)


# ---- the engine side, over gRPC ------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    process = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "32",
                            "--max-num-slots", "8")
    yield process.address
    process.stop()


@pytest_asyncio.fixture(scope="module")
async def engine_stub(engine):
    async with grpc.aio.insecure_channel(engine) as channel:
        yield engine_pb2_grpc.EngineServiceStub(channel)


def _plan(step_id: int, **fields) -> engine_pb2.ExecuteRequest:
    return engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(step_id=step_id, **fields))


def _prefill(step_id: int) -> engine_pb2.ExecuteRequest:
    request = _plan(step_id, slots=[0], num_scheduled_tokens=[3], num_new_blocks=[1],
                    new_block_ids=[1])
    request.plan.new_sequences.add(slot=0, token_ids=[5, 6, 7]).sampling.temperature = 0.0
    return request


BAD_PLANS = {
    "step out of order": ([_prefill(5), _plan(5, slots=[0], num_scheduled_tokens=[1],
                                              num_new_blocks=[0])],
                          "step_id: 5 is not after the previous step 5"),
    "unknown sequence": ([_plan(1, slots=[3], num_scheduled_tokens=[1], num_new_blocks=[1],
                                new_block_ids=[2])], "slots: slot 3 is not registered"),
    "slot out of range": ([_plan(1, slots=[8], num_scheduled_tokens=[1], num_new_blocks=[0])],
                          "slots"),
    "block id out of range": ([_plan(1, slots=[0], num_scheduled_tokens=[1], num_new_blocks=[1],
                                     new_block_ids=[32])], "new_block_ids"),
    "finish of an unknown sequence": ([_plan(1, finished_slots=[2])],
                                      "finished_slots: slot 2 is not registered"),
}


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
async def test_bad_plan_is_invalid_argument_and_the_engine_keeps_serving(engine_stub, case):
    plans, expected = BAD_PLANS[case]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in engine_stub.Execute(iter(plans)):
            pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in raised.value.details()
    results = [r async for r in engine_stub.Execute(iter([_prefill(1)]))]
    assert list(results[0].result.num_sampled_tokens) == [1]
