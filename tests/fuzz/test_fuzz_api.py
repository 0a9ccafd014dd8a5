"""Fuzz the public API of a live scheduler (over the null model) with random protobuf messages
and random bytes: every call ends with a status in bounded time (no hang), never UNKNOWN or
INTERNAL for a message that parses (every bad field is mapped to a status), the process stays
up, and afterwards a valid request is served exactly and no KV block is leaked."""
from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import EngineProcess
from fuzz_settings import CALL_TIMEOUT_S, FUZZ
from model_service.models.null import null_continuation
from planserve.v1 import generate_pb2, generate_pb2_grpc
from proto_strategies import messages

pytestmark = pytest.mark.slow(
    reason="150 random examples a property, each a round trip to a live server (PLANSERVE_FUZZ_EXAMPLES sets fewer)"
)

# Codes that mean a handler raised something it did not map.
UNMAPPED = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

# Small, mostly in-vocabulary values where they matter, so that some requests get through.
GENERATE = messages(generate_pb2.GenerateRequest, overrides={
    # Token ids are uint32 on the wire: anything from 0 up, the vocabulary's ids most often.
    "ids": st.one_of(st.integers(0, 258), st.integers(0, 2**32 - 1)),
    "max_new_tokens": st.one_of(st.integers(0, 8), st.sampled_from([2**32 - 1, 9000])),
    "request_id": st.one_of(st.just(""), st.text(max_size=8), st.just("x" * 300)),
    "n": st.integers(0, 20),
}, max_repeated=40)


@pytest.fixture(scope="module")
def scheduler_address():
    engine = EngineProcess("--model", "null", "--num-kv-blocks", "512")
    process = subprocess.Popen(
        [sys.executable, "-m", "scheduler_service.cli", "--log-level", "warning", "scheduler",
         "--engine", engine.address, "--port", "0", "--metrics-port", "-1", "--http-port", "-1",
         "--max-message-bytes", str(1 << 20)],
        stdout=subprocess.PIPE, text=True)
    try:
        for line in process.stdout:
            if line.startswith("PLANSERVE_PORT="):
                address = f"127.0.0.1:{int(line.split('=', 1)[1])}"
                break
        else:
            raise RuntimeError(f"scheduler exited with {process.wait()}")
        yield address, process
    finally:
        process.kill()
        process.wait()
        engine.stop()


@pytest.fixture(scope="module")
def channel(scheduler_address):
    with grpc.insecure_channel(scheduler_address[0]) as channel:
        yield channel


def _first_chunks_then_cancel(call, num: int = 2) -> grpc.StatusCode:
    """Reads up to `num` responses (acceptance is what is fuzzed, not generation), then ends."""
    try:
        for index, _ in enumerate(call):
            if index + 1 >= num:
                call.cancel()
                return grpc.StatusCode.OK
        return grpc.StatusCode.OK
    except grpc.RpcError as error:
        return error.code()


def _check(code: grpc.StatusCode, allowed_unmapped=frozenset()) -> None:
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED, "the call hung"
    assert code not in UNMAPPED - allowed_unmapped, code


@FUZZ
@given(request=GENERATE)
def test_generate_with_random_messages(channel, request):
    stub = generate_pb2_grpc.GenerationServiceStub(channel)
    _check(_first_chunks_then_cancel(stub.Generate(request, timeout=CALL_TIMEOUT_S)))


@FUZZ
@given(kinds=st.lists(st.one_of(
    GENERATE.map(lambda g: generate_pb2.SessionRequest(generate=g)),
    messages(generate_pb2.AbortRequest).map(lambda a: generate_pb2.SessionRequest(abort=a)),
    st.just(generate_pb2.SessionRequest())), min_size=1, max_size=4))
def test_session_with_random_messages(channel, kinds):
    stub = generate_pb2_grpc.GenerationServiceStub(channel)
    _check(_first_chunks_then_cancel(stub.Session(iter(kinds), timeout=CALL_TIMEOUT_S), 4))


@FUZZ
@given(abort=messages(generate_pb2.AbortRequest),
       status=messages(generate_pb2.GetServerStatusRequest),
       info=messages(generate_pb2.GetModelInfoRequest))
def test_unary_calls_with_random_messages(channel, abort, status, info):
    stub = generate_pb2_grpc.GenerationServiceStub(channel)
    for method, request in ((stub.Abort, abort), (stub.GetServerStatus, status),
                            (stub.GetModelInfo, info)):
        try:
            method(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            _check(error.code())


@FUZZ
@given(payload=st.binary(max_size=256))
def test_generate_with_random_bytes(channel, payload):
    # Bytes that do not parse get INVALID_ARGUMENT naming the message type (not gRPC's UNKNOWN).
    call = channel.unary_stream("/planserve.v1.GenerationService/Generate")(
        payload, timeout=CALL_TIMEOUT_S)
    _check(_first_chunks_then_cancel(call))


@FUZZ
@given(payloads=st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_session_with_random_bytes(channel, payloads):
    call = channel.stream_stream("/planserve.v1.GenerationService/Session")(
        iter(payloads), timeout=CALL_TIMEOUT_S)
    _check(_first_chunks_then_cancel(call, 4))


def test_after_the_fuzz_the_server_serves_exactly_and_holds_nothing(scheduler_address, channel):
    # Runs after the fuzz tests above (file order).
    _, process = scheduler_address
    assert process.poll() is None
    stub = generate_pb2_grpc.GenerationServiceStub(channel)
    request = generate_pb2.GenerateRequest(sampling={"temperature": 0.0},
                                           stopping={"max_new_tokens": 20, "ignore_eos": True})
    request.token_ids.ids.extend([1, 2, 3, 4, 5])
    ids = [t for chunk in stub.Generate(request, timeout=CALL_TIMEOUT_S) for t in chunk.token_ids]
    assert ids == null_continuation([1, 2, 3, 4, 5], 20)
    deadline = time.monotonic() + 30
    while True:  # cancelled calls are aborted at the next step
        status = stub.GetServerStatus(generate_pb2.GetServerStatusRequest(), timeout=10)
        if status.num_waiting == status.num_running == 0 and \
                status.num_free_kv_blocks == status.num_kv_blocks:
            break
        assert time.monotonic() < deadline, f"blocks or requests left: {status}"
        time.sleep(0.05)
