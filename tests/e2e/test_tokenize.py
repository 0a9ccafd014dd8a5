"""Tokenize / Detokenize over gRPC and vLLM-style /tokenize and /detokenize over HTTP: the
served model's tokenizer, the same prompts Generate builds, bounds named."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from api import complete, http_json, stub_for
from planserve.v1 import generate_pb2

TEXTS = ["Hello, world!", "  leading spaces and ünïcödé — 漢字 🙂\nnew line", "x"]


@pytest.mark.parametrize("text", TEXTS)
async def test_tokenize_then_detokenize_round_trips(tiny_server, text):
    stub = stub_for(tiny_server)
    tokens = await stub.Tokenize(generate_pb2.TokenizeRequest(text=text))
    assert tokens.token_ids and tokens.max_model_len == \
        tiny_server.servicer.serving.facts.max_model_len
    back = await stub.Detokenize(generate_pb2.DetokenizeRequest(token_ids=tokens.token_ids))
    assert back.text == text


async def test_text_tokens_are_the_prompt_generate_uses(tiny_server):
    stub = stub_for(tiny_server)
    text = "The quick brown fox"
    tokens = await stub.Tokenize(generate_pb2.TokenizeRequest(text=text,
                                                              add_special_tokens=True))
    request = generate_pb2.GenerateRequest(text=text)
    request.stopping.max_new_tokens = 1
    out = await complete(stub, request)
    assert out.usage.prompt_tokens == len(tokens.token_ids)


async def test_chat_messages_tokenize_like_generates_messages_prompt(tiny_server):
    stub = stub_for(tiny_server)
    turns = [generate_pb2.ChatMessage(role="system", content="Be brief."),
             generate_pb2.ChatMessage(role="user", content="Name a colour.")]
    tokens = await stub.Tokenize(generate_pb2.TokenizeRequest(
        messages=generate_pb2.ChatMessages(messages=turns)))
    # The same ids as Generate's prompt: generating from them as token ids gives the same
    # greedy tokens as generating from the messages.
    by_messages = generate_pb2.GenerateRequest(messages=generate_pb2.ChatMessages(messages=turns))
    by_ids = generate_pb2.GenerateRequest()
    by_ids.token_ids.ids.extend(tokens.token_ids)
    for request in (by_messages, by_ids):
        request.sampling.temperature = 0
        request.stopping.max_new_tokens = 6
        request.stopping.ignore_eos = True
    a, b = await complete(stub, by_messages), await complete(stub, by_ids)
    assert a.usage.prompt_tokens == len(tokens.token_ids)
    assert a.token_ids == b.token_ids
    with_specials = (await stub.Detokenize(generate_pb2.DetokenizeRequest(
        token_ids=tokens.token_ids))).text
    text = (await stub.Detokenize(generate_pb2.DetokenizeRequest(
        token_ids=tokens.token_ids, skip_special_tokens=True))).text
    assert "Name a colour." in text and "<|im_start|>" not in text
    assert with_specials.count("<|im_start|>") == 3  # two turns and the assistant prompt


async def test_bad_ids_and_inputs_are_invalid_argument_naming_the_field(tiny_server):
    stub = stub_for(tiny_server)
    facts = tiny_server.servicer.serving.facts
    cases = [
        (stub.Detokenize(generate_pb2.DetokenizeRequest(token_ids=[5, facts.vocab_size])),
         f"token_ids[1]: {facts.vocab_size} is outside the vocabulary"),
        (stub.Detokenize(generate_pb2.DetokenizeRequest(
            token_ids=[5] * (facts.max_model_len + 1))),
         f"token_ids: at most {facts.max_model_len} ids"),
        (stub.Tokenize(generate_pb2.TokenizeRequest()), "input: one of text or messages"),
        (stub.Tokenize(generate_pb2.TokenizeRequest(messages=generate_pb2.ChatMessages(
            messages=[generate_pb2.ChatMessage(role="robot", content="hi")]))),
         "messages.messages[0].role"),
    ]
    for call, expected in cases:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in error.value.details()


async def test_http_tokenize_and_detokenize(tiny_server):
    port = tiny_server.http_port
    model = tiny_server.servicer.serving.facts.model_name
    stub = stub_for(tiny_server)
    text = TEXTS[1]
    status, body = await asyncio.to_thread(http_json, port, "/tokenize",
                                           {"model": model, "prompt": text})
    grpc_tokens = await stub.Tokenize(generate_pb2.TokenizeRequest(text=text,
                                                                   add_special_tokens=True))
    assert status == 200
    assert body["tokens"] == list(grpc_tokens.token_ids) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == grpc_tokens.max_model_len
    status, back = await asyncio.to_thread(http_json, port, "/detokenize",
                                           {"model": model, "tokens": body["tokens"]})
    assert (status, back) == (200, {"prompt": text})

    messages = [{"role": "user", "content": "Name a colour."}]
    status, chat = await asyncio.to_thread(http_json, port, "/tokenize", {"messages": messages})
    grpc_chat = await stub.Tokenize(generate_pb2.TokenizeRequest(
        messages=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(
            role="user", content="Name a colour.")])))
    assert status == 200 and chat["tokens"] == list(grpc_chat.token_ids)

    status, error = await asyncio.to_thread(http_json, port, "/detokenize",
                                            {"tokens": [1, facts_vocab(tiny_server)]})
    assert status == 400 and error["error"]["param"] == "tokens"
    assert "tokens[1]" in error["error"]["message"]
    status, error = await asyncio.to_thread(http_json, port, "/detokenize", {"tokens": [-1]})
    assert status == 400 and error["error"]["param"] == "tokens"
    status, error = await asyncio.to_thread(http_json, port, "/tokenize",
                                            {"model": "nope", "prompt": "x"})
    assert status == 404 and error["error"]["code"] == "model_not_found"


def facts_vocab(server) -> int:
    return server.servicer.serving.facts.vocab_size
