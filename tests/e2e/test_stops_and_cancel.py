"""Stops decided by the scheduler (token ids, strings, eos) and cancellation, on real servers."""
import asyncio

from api import assert_no_leaked_blocks, complete, greedy_ids_request, stub_for, wait_until_idle
from planserve.v1 import generate_pb2

PROMPT = [17, 4000, 1203, 88, 9, 3141, 59, 26]


async def _reference(stub, max_new_tokens=32):
    return await complete(stub, greedy_ids_request(PROMPT, max_new_tokens))


async def test_stop_token_id_ends_with_stop_and_keeps_the_token(tiny_server):
    stub = stub_for(tiny_server)
    reference = await _reference(stub)
    stop_id = reference.token_ids[5]
    first = reference.token_ids.index(stop_id)
    request = greedy_ids_request(PROMPT, 32)
    request.stopping.stop_token_ids.append(stop_id)
    completion = await complete(stub, request)
    assert completion.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert completion.last.stop_token_id == stop_id
    assert completion.token_ids == reference.token_ids[:first + 1]


async def test_stop_string_is_matched_and_not_returned(tiny_server):
    stub = stub_for(tiny_server)
    reference = await _reference(stub)
    text = reference.text
    assert len(text) > 20, text
    stop = text[10:14]
    request = greedy_ids_request(PROMPT, 32)
    request.stopping.stop.append(stop)
    completion = await complete(stub, request)
    assert completion.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert completion.last.stop_string == stop
    assert completion.text == text[:text.index(stop)]
    assert stop not in completion.text


async def test_text_streams_incrementally_and_adds_up_to_the_full_decode(tiny_server):
    stub = stub_for(tiny_server)
    chunks = [c async for c in stub.Generate(greedy_ids_request(PROMPT, 24))]
    assert len(chunks) > 1
    assert all(c.finish_reason == 0 for c in chunks[:-1])
    ids = [t for c in chunks for t in c.token_ids]
    tokenizer = tiny_server.servicer.serving.tokenizer
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids)


async def test_cancelled_call_frees_its_blocks_and_others_go_on(tiny_server):
    stub = stub_for(tiny_server)
    survivor = asyncio.ensure_future(complete(stub, greedy_ids_request(PROMPT, 40)))
    doomed = stub.Generate(greedy_ids_request(list(range(1, 200)), 400))
    await doomed.read()
    assert tiny_server.loop.scheduler.kv.num_free_blocks < tiny_server.loop.scheduler.kv.num_usable_blocks
    doomed.cancel()
    finished = await survivor
    assert finished.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert len(finished.token_ids) == 40
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_text_prompt_and_chat_prompt_are_served(tiny_server):
    stub = stub_for(tiny_server)
    text = await complete(stub, generate_pb2.GenerateRequest(
        text="Once upon a time", sampling={"temperature": 0.0},
        stopping={"max_new_tokens": 5, "ignore_eos": True}))
    tokenizer = tiny_server.servicer.serving.tokenizer
    assert text.usage.prompt_tokens == len(tokenizer.encode("Once upon a time"))
    chat = await complete(stub, generate_pb2.GenerateRequest(
        messages=generate_pb2.ChatMessages(messages=[
            generate_pb2.ChatMessage(role="user", content="Hi")]),
        sampling={"temperature": 0.0}, stopping={"max_new_tokens": 5, "ignore_eos": True}))
    # The chat template wraps the message in role markup: more tokens than the text alone.
    assert chat.usage.prompt_tokens > len(tokenizer.encode("Hi")) + 3
    assert len(chat.token_ids) == 5


async def test_get_model_info(tiny_server):
    stub = stub_for(tiny_server)
    info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
    assert info.vocab_size == 49152
    assert info.max_model_len == 512
    assert info.dtype == "float32"
