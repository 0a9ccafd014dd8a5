"""/v1/completions with a list of prompts and with `echo`, through the official `openai`
client against real servers: what evaluation harnesses send (a batch of token-id prompts, echo,
logprobs) to score texts. Each prompt is answered as it would be alone; echo's logprobs are the
engine's prompt logprobs (checked against transformers in float32), and on SmolLM2 in this CPU's
default dtype they rank a right continuation above a wrong one."""
from __future__ import annotations

import asyncio
import math

import openai
import pytest
import pytest_asyncio

from api import (assert_no_leaked_blocks, complete, greedy_ids_request, http_json, stub_for,
                 wait_until_idle)
from conftest import EngineProcess, start_scheduler
from reference import hf_llama_from_loaded, reference_logprobs
from scheduler_service.api.http_server import HttpServer

PROMPTS = [[1, 17, 300, 4000, 22, 9], [5, 6, 7], list(range(700, 730))]
# Float32 against transformers' float32 over the tiny vocabulary (test_sampling_surface.py).
TOLERANCE = 1e-3


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x",
                              max_retries=0, timeout=120)


def _model(server) -> str:
    return server.servicer.serving.facts.model_name


@pytest.fixture(scope="module")
def tiny_reference_model():
    from model_service.config import ModelServiceConfig
    from model_service.loading.loader import load_model
    return hf_llama_from_loaded(load_model(ModelServiceConfig(model="tiny", dtype="float32")))


async def _alone(server, prompt: list[int], max_tokens: int):
    return await complete(stub_for(server), greedy_ids_request(prompt, max_tokens))


async def test_a_list_of_prompts_answers_each_as_alone_in_prompt_order(tiny_server):
    alone = [await _alone(tiny_server, prompt, 8) for prompt in PROMPTS]
    result = await _client(tiny_server).completions.create(
        model=_model(tiny_server), prompt=PROMPTS, max_tokens=8, temperature=0, n=2,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [choice.index for choice in result.choices] == list(range(6))
    for choice in result.choices:
        expected = alone[choice.index // 2]  # prompt p's samples are choices 2p and 2p+1
        assert choice.model_extra["token_ids"] == expected.token_ids
        assert choice.text == expected.text
        assert choice.finish_reason == "length"
    assert result.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert result.usage.completion_tokens == 6 * 8
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_a_streamed_list_of_prompts_equals_the_whole_answer(tiny_server):
    kwargs = dict(model=_model(tiny_server), prompt=["Hello there", "One, two,"], max_tokens=6,
                  temperature=0, extra_body={"ignore_eos": True})
    whole = await _client(tiny_server).completions.create(**kwargs)
    stream = await _client(tiny_server).completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs)
    texts, reasons, usage, ids = {0: "", 1: ""}, {}, None, set()
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    assert len(ids) == 1  # one answer, however many requests
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == 12 and usage.prompt_tokens == whole.usage.prompt_tokens


async def test_echo_leads_with_the_prompt_and_its_logprobs_match_transformers(
        tiny_server, tiny_reference_model):
    prompt = PROMPTS[2]
    result = await _client(tiny_server).completions.create(
        model=_model(tiny_server), prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
        echo=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    [choice] = result.choices
    generated = choice.model_extra["token_ids"]
    tokenizer = tiny_server.servicer.serving.tokenizer
    assert choice.text == tokenizer.decode(prompt, skip_special_tokens=False) + \
        tokenizer.decode(generated)
    logprobs = choice.logprobs
    assert len(logprobs.token_logprobs) == len(prompt) + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = reference_logprobs(tiny_reference_model, prompt + generated)
    for i, token in enumerate((prompt + generated)[1:], start=1):
        assert abs(logprobs.token_logprobs[i] - float(reference[i - 1][token])) < TOLERANCE, i
        assert len(logprobs.top_logprobs[i]) >= 2
    offsets = logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert result.usage.completion_tokens == 4


async def test_echo_of_the_prompt_alone_scores_it_and_generates_nothing(
        tiny_server, tiny_reference_model):
    """max_tokens 0 with echo: lm-evaluation-harness's and OpenAI's legacy way to score a text."""
    result = await _client(tiny_server).completions.create(
        model=_model(tiny_server), prompt=PROMPTS[:2], max_tokens=0, echo=True, logprobs=0,
        temperature=0)
    tokenizer = tiny_server.servicer.serving.tokenizer
    for prompt, choice in zip(PROMPTS[:2], result.choices):
        assert choice.text == tokenizer.decode(prompt, skip_special_tokens=False)
        assert choice.finish_reason == "length"
        scores = choice.logprobs.token_logprobs
        assert len(scores) == len(prompt) and scores[0] is None
        reference = reference_logprobs(tiny_reference_model, prompt)
        for i, token in enumerate(prompt[1:], start=1):
            assert abs(scores[i] - float(reference[i - 1][token])) < TOLERANCE
    assert result.usage.completion_tokens == 0
    assert result.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])


async def test_streamed_echo_leads_each_choice_with_the_prompt(tiny_server):
    kwargs = dict(model=_model(tiny_server), prompt="Hello there", max_tokens=5, temperature=0,
                  n=2, echo=True, logprobs=1, extra_body={"ignore_eos": True})
    whole = await _client(tiny_server).completions.create(**kwargs)
    stream = await _client(tiny_server).completions.create(stream=True, **kwargs)
    firsts, texts, scores = {}, {0: "", 1: ""}, {0: [], 1: []}
    async for chunk in stream:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.text)
            texts[choice.index] += choice.text
            scores[choice.index] += choice.logprobs.token_logprobs
    assert all(first.startswith("Hello there") for first in firsts.values())
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert scores[choice.index] == choice.logprobs.token_logprobs
        assert scores[choice.index][0] is None


async def test_a_bad_prompt_in_a_list_is_named_and_nothing_of_the_list_runs(tiny_server):
    client = _client(tiny_server)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=_model(tiny_server),
                                        prompt=[[1, 2, 3], [1, 10**7]], max_tokens=4)
    assert caught.value.param == "prompt"
    assert caught.value.body["message"].startswith("prompt[1]")
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=_model(tiny_server), prompt=["a"] * 1025)
    assert caught.value.body["message"] == (
        "prompt: at most 1024 prompts in one request (max_queue_len), got 1025")
    with pytest.raises(openai.BadRequestError) as caught:  # max_tokens 0 only with echo
        await client.completions.create(model=_model(tiny_server), prompt="Hi", max_tokens=0)
    assert caught.value.param == "max_tokens"
    await wait_until_idle(tiny_server)
    assert tiny_server.loop.scheduler.num_waiting == 0
    assert_no_leaked_blocks(tiny_server)


async def test_a_client_gone_mid_stream_aborts_every_prompt_of_its_list(tiny_server, monkeypatch):
    aborted, abort = [], tiny_server.loop.abort_request

    def recording(request_id):
        aborted.append(request_id)
        return abort(request_id)

    monkeypatch.setattr(tiny_server.loop, "abort_request", recording)
    stream = await _client(tiny_server).completions.create(
        model=_model(tiny_server), prompt=["Hello", "Goodbye", "Again"], max_tokens=400,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        answer_id = chunk.id.removeprefix("cmpl-")
        break
    await stream.close()
    await wait_until_idle(tiny_server, timeout_s=30)
    assert sorted(aborted) == [f"{answer_id}-{p}" for p in range(3)]
    assert_no_leaked_blocks(tiny_server)


@pytest_asyncio.fixture(scope="module")
async def own_server():
    """A scheduler on an engine of its own: one sequence at a time, a queue of three, and
    /tokenizer_info served."""
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "32")
    server = await start_scheduler(engine.address, max_num_seqs=1, max_queue_len=3, http_port=0,
                                   enable_tokenizer_info_endpoint=True)
    yield server
    await server.stop(grace_s=1)
    engine.stop()


async def test_a_list_that_would_overfill_the_waiting_queue_is_refused_whole(own_server):
    server = own_server
    client = _client(server)
    # One running, one waiting: a list of three would make four waiting.
    hold = [asyncio.ensure_future(client.completions.create(
        model=_model(server), prompt=[1, 2, 3], max_tokens=200, temperature=0,
        extra_body={"ignore_eos": True})) for _ in range(2)]
    while server.loop.scheduler.num_waiting < 1:
        await asyncio.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as caught:
        await client.completions.create(model=_model(server), prompt=[[4], [5], [6]],
                                        max_tokens=2)
    message = caught.value.body["message"]  # (behind frontend processes: the core's words)
    assert message.startswith("queue full") and "(max_queue_len 3)" in message
    # None of the three stays queued (behind frontend processes the core took two before
    # refusing the third: they are aborted, and gone at its next step).
    for _ in range(500):
        if server.loop.scheduler.num_waiting == 1:
            break
        await asyncio.sleep(0.01)
    assert server.loop.scheduler.num_waiting == 1
    await asyncio.gather(*hold)
    two = await client.completions.create(model=_model(server), prompt=[[4], [5]], max_tokens=2)
    assert len(two.choices) == 2
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def test_tokenizer_info_is_served_only_when_enabled_and_names_the_eos_token(
        tiny_server, own_server):
    status, _ = await asyncio.to_thread(http_json, tiny_server.http_port, "/tokenizer_info")
    assert status == 404
    status, info = await asyncio.to_thread(http_json, own_server.http_port, "/tokenizer_info")
    facts = own_server.servicer.serving.facts
    assert status == 200
    assert info["model_max_length"] == facts.max_model_len
    assert info["chat_template"] == (facts.chat_template or None)
    # What a remote tokenizer does with it: the eos token's text back to its id.
    _, eos = await asyncio.to_thread(http_json, own_server.http_port, "/tokenize",
                                     {"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos["tokens"][0] in facts.eos_token_ids


async def test_render_answers_one_rendering_per_prompt(tiny_server):
    body = {"model": _model(tiny_server), "prompt": PROMPTS, "max_tokens": 3}
    status, rendered = await asyncio.to_thread(
        http_json, tiny_server.http_port, "/v1/completions/render", body)
    assert status == 200, rendered
    assert [r["token_ids"] for r in rendered] == PROMPTS


async def test_echo_scores_rank_the_right_continuation_first_on_smollm2(smollm2_default_server):
    """A harness's loglikelihood request, as lm-evaluation-harness sends it: token-id prompts
    of context + continuation in one list, echo, logprobs 1, one new token; the continuation's
    score is the sum of its tokens' logprobs. In this CPU's default dtype (what users run),
    through an HTTP door on the session's SmolLM2 scheduler (its model service takes one)."""
    server = smollm2_default_server
    http = HttpServer(server.admission, "127.0.0.1", 0)
    port = await http.start()
    try:
        tokenizer = server.servicer.serving.tokenizer
        context = tokenizer.encode("The capital of France is")
        endings = [" Paris.", " a banana.", " London."]
        prompts = [context + tokenizer.encode(ending) for ending in endings]
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                    max_retries=0, timeout=120)
        result = await client.completions.create(
            model=_model(server), prompt=prompts, max_tokens=1, temperature=0, logprobs=1,
            echo=True)
    finally:
        await http.stop(grace_s=1)
    scores = []
    for prompt, choice in zip(prompts, sorted(result.choices, key=lambda c: c.index)):
        assert len(choice.logprobs.token_logprobs) == len(prompt) + 1
        continuation = choice.logprobs.token_logprobs[len(context):-1]
        assert all(math.isfinite(score) and score <= 0 for score in continuation)
        scores.append(sum(continuation))
    assert scores[0] == max(scores), scores


async def test_prompt_logprobs_are_vllms_shape_per_choice_and_per_chat(tiny_server):
    """vLLM's `prompt_logprobs` extension: null for the first prompt token, then per token
    {"<id>": {"logprob", "rank", "decoded_token"}}: the prompt token's logprob as gRPC's, and
    the alternatives ranked 1 .. k."""
    client = _client(tiny_server)
    result = await client.completions.create(
        model=_model(tiny_server), prompt=PROMPTS[:2], max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 2})
    for prompt, choice in zip(PROMPTS[:2], result.choices):
        served = choice.model_extra["prompt_logprobs"]
        request = greedy_ids_request(prompt, 1, prompt_logprobs=2)
        chunks = [c async for c in stub_for(tiny_server).Generate(request)]
        entries = list(chunks[0].prompt_logprobs)
        assert served[0] is None and len(served) == len(prompt)
        for token_id, position, entry in zip(prompt[1:], served[1:], entries):
            assert position[str(token_id)]["logprob"] == pytest.approx(entry.logprob, abs=1e-6)
            ranked = sorted((p["rank"], int(t)) for t, p in position.items() if p["rank"])
            assert [t for _, t in ranked] == [alternative.token_id for alternative in entry.top]
    chat = await client.chat.completions.create(
        model=_model(tiny_server), messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    for extra, message in (({"prompt_logprobs": 1, "stream": True},
                            "prompt_logprobs: not available with stream true"),
                           ({"prompt_logprobs": 21}, "prompt_logprobs: must be in [0, 20]")):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=_model(tiny_server), prompt="Hi",
                                            max_tokens=2, extra_body=extra)
        assert caught.value.param == "prompt_logprobs"
        assert caught.value.body["message"].startswith(message)
