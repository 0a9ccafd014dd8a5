"""Bad input gets INVALID_ARGUMENT naming the field and the bound; the server keeps serving."""
import grpc
import pytest

from api import complete, greedy_ids_request, stub_for
from planserve.v1 import generate_pb2

TINY_MAX_MODEL_LEN = 512
VOCAB = 49152


def _text(text="Hello", **stopping):
    request = generate_pb2.GenerateRequest(text=text)
    for name, value in stopping.items():
        setattr(request.stopping, name, value)
    return request


def _sampling(**params):
    request = _text()
    for name, value in params.items():
        setattr(request.sampling, name, value)
    return request


BAD_REQUESTS = {
    "no prompt": (generate_pb2.GenerateRequest(), "prompt"),
    "empty text": (_text(""), "text: must not be empty"),
    "empty token ids": (greedy_ids_request([], 4), "token_ids.ids: must not be empty"),
    "empty messages": (generate_pb2.GenerateRequest(messages=generate_pb2.ChatMessages()),
                       "messages.messages"),
    "prompt as long as the model": (greedy_ids_request([5] * TINY_MAX_MODEL_LEN, 4),
                                    f"below the model's max length {TINY_MAX_MODEL_LEN}"),
    "prompt longer than the model": (greedy_ids_request([5] * (TINY_MAX_MODEL_LEN + 9), 4),
                                     "prompt: "),
    "max_new_tokens 0": (_text(max_new_tokens=0), "stopping.max_new_tokens: must be in [1, 512]"),
    "max_new_tokens above the model": (_text(max_new_tokens=TINY_MAX_MODEL_LEN + 1),
                                       "stopping.max_new_tokens: must be in [1, 512]"),
    "negative temperature": (_sampling(temperature=-0.5), "sampling.temperature: must be >= 0"),
    "top_p 0": (_sampling(top_p=0.0), "sampling.top_p: must be in (0, 1]"),
    "top_p above 1": (_sampling(top_p=1.5), "sampling.top_p: must be in (0, 1]"),
    "top_k 0": (_sampling(top_k=0), "sampling.top_k: must be >= 1"),
    "token id outside the vocabulary": (greedy_ids_request([1, 2, VOCAB], 4),
                                        f"token_ids.ids[2]: {VOCAB} is outside the vocabulary"),
    "stop token outside the vocabulary": (
        generate_pb2.GenerateRequest(text="hi", stopping=generate_pb2.StoppingCriteria(
            stop_token_ids=[VOCAB + 1])), "stopping.stop_token_ids[0]"),
    "bad chat role": (generate_pb2.GenerateRequest(messages=generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role="wizard", content="hi")])),
        "messages.messages[0].role"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
async def test_bad_request_is_invalid_argument_and_server_keeps_serving(tiny_server, case):
    request, expected = BAD_REQUESTS[case]
    stub = stub_for(tiny_server)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await complete(stub, request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in raised.value.details()

    after = await complete(stub, greedy_ids_request([1, 2, 3], 3))
    assert after.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert len(after.token_ids) == 3


async def test_duplicate_in_flight_request_id_is_already_exists(tiny_server):
    stub = stub_for(tiny_server)
    first = stub.Generate(greedy_ids_request([1, 2, 3], 200, request_id="dup"))
    await first.read()  # the first chunk: the request is in flight now
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await complete(stub, greedy_ids_request([1, 2, 3], 4, request_id="dup"))
    assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
