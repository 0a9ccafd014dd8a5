"""Structured output end to end: JSON schema, regex, choice and any-JSON-object constraints,
compiled by the scheduler (outlines-core), applied as token masks by the model service, over
gRPC and the OpenAI API. The tiny random model shows the constraint holds whatever the model
prefers; SmolLM2 shows a prompt that gives prose unconstrained gives valid JSON constrained."""
from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import openai
import pytest

from api import assert_no_leaked_blocks, complete, stub_for, wait_until_idle
from planserve.v1 import common_pb2, generate_pb2
from scheduler_service.api.http_server import HttpServer

PROMPT_IDS = [1, 17, 300, 4000, 22, 9]
EMAIL = r"[a-z]{3,8}@example\.(com|org)"
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "enum": [1, 2, 3, 10, 20]},
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["colour", "size", "name", "tags"],
    "additionalProperties": False,
}


def _request(max_new_tokens: int = 64, seed: int = 3, prompt_ids=PROMPT_IDS,
             **kwargs) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(**kwargs)
    request.token_ids.ids.extend(prompt_ids)
    request.sampling.temperature = 1.0
    request.sampling.seed = seed
    request.stopping.max_new_tokens = max_new_tokens
    return request


def _constrained(**structured) -> dict:
    return {"structured_output": common_pb2.StructuredOutput(**structured)}


async def _chunks(stub, request) -> list[generate_pb2.GenerateResponse]:
    return [chunk async for chunk in stub.Generate(request)]


def _by_sample(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
    return texts


async def test_regex_output_matches_and_ends_with_eos(tiny_server):
    stub = stub_for(tiny_server)
    plain = await complete(stub, _request(24))
    assert not re.fullmatch(EMAIL, plain.text)  # the random model's own choice is not an email
    for seed in range(4):
        out = await complete(stub, _request(seed=seed, **_constrained(regex=EMAIL)))
        assert re.fullmatch(EMAIL, out.text), out.text
        # The grammar ends the output: EOS is the only token allowed once it is complete.
        assert out.finish_reason == generate_pb2.FINISH_REASON_EOS
        assert tiny_server.servicer.serving.facts.eos_token_ids & {out.token_ids[-1]}


async def test_json_schema_output_parses_and_validates(tiny_server):
    stub = stub_for(tiny_server)
    plain = await complete(stub, _request(48))
    with pytest.raises(ValueError):
        json.loads(plain.text)
    for seed in range(3):
        out = await complete(stub, _request(
            max_new_tokens=200, seed=seed, **_constrained(json_schema=json.dumps(SCHEMA))))
        assert out.finish_reason == generate_pb2.FINISH_REASON_EOS, out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


async def test_json_object_output_is_a_json_object(tiny_server):
    stub = stub_for(tiny_server)
    # Greedy on the random model: short, but a valid object whatever it is.
    request = _request(max_new_tokens=300, **_constrained(json_object=True))
    request.sampling.temperature = 0.0
    out = await complete(stub, request)
    if out.finish_reason == generate_pb2.FINISH_REASON_EOS:
        assert isinstance(json.loads(out.text), dict)
    else:  # cut by the length: still a prefix of an object
        assert out.text.startswith("{")


async def test_choice_with_parallel_samples_each_pick_a_choice(tiny_server):
    stub = stub_for(tiny_server)
    choices = ["red", "green", "blue", "no colour at all"]
    chunks = await _chunks(stub, _request(
        n=4, seed=11, structured_output=common_pb2.StructuredOutput(
            choice=common_pb2.Choices(choices=choices))))
    texts = _by_sample(chunks)
    assert sorted(texts) == [0, 1, 2, 3]
    assert all(text in choices for text in texts.values()), texts


async def test_guides_survive_preemption(tiny_server):
    """A crowd of long constrained outputs on a small KV cache forces recompute preemptions;
    each seeded output is the one it gives alone, and still matches."""
    stub = stub_for(tiny_server)
    scheduler = tiny_server.loop.scheduler
    regex = r"([a-z]{2,6} ){80,90}end\."
    prompt = list(range(200, 260))

    def request(seed: int) -> generate_pb2.GenerateRequest:
        return _request(max_new_tokens=420, seed=seed, prompt_ids=prompt,
                        **_constrained(regex=regex))

    alone = await complete(stub, request(100))
    assert re.fullmatch(regex, alone.text), alone.text
    preemptions_before = scheduler.num_preemptions_total
    crowd = await asyncio.gather(*[complete(stub, request(100 + i)) for i in range(12)])
    assert scheduler.num_preemptions_total > preemptions_before
    assert crowd[0].token_ids == alone.token_ids
    for out in crowd:
        assert re.fullmatch(regex, out.text), out.text
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_compiled_grammars_are_cached(tiny_server):
    stub = stub_for(tiny_server)
    grammars = tiny_server.servicer.serving.grammars
    regex = r"cached-[0-9]{4}"
    await complete(stub, _request(**_constrained(regex=regex)))
    compiled = grammars.num_compiled
    outs = await asyncio.gather(*[complete(stub, _request(seed=s, **_constrained(regex=regex)))
                                  for s in range(3)])
    assert grammars.num_compiled == compiled
    assert all(re.fullmatch(regex, out.text) for out in outs)


@pytest.mark.parametrize("structured, field", [
    ({"regex": "(unclosed"}, "structured_output.regex"),
    ({"regex": ""}, "structured_output.regex"),
    ({"json_schema": "{not json"}, "structured_output.json_schema"),
    ({"json_schema": '{"type": "no-such-type"}'}, "structured_output.json_schema"),
    ({"json_object": False}, "structured_output.json_object"),
    ({"choice": common_pb2.Choices(choices=[])}, "structured_output.choice.choices"),
    ({"choice": common_pb2.Choices(choices=["a", ""])},
     "structured_output.choice.choices[1]"),
    ({}, "structured_output"),
])
async def test_bad_grammars_are_invalid_argument_naming_the_field(tiny_server, structured,
                                                                  field):
    stub = stub_for(tiny_server)
    request = _request()
    request.structured_output.SetInParent()
    request.structured_output.MergeFrom(common_pb2.StructuredOutput(**structured))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await complete(stub, request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(field + ":"), error.value.details()


async def test_session_rejects_a_bad_grammar_and_serves_a_good_one(tiny_server):
    stub = stub_for(tiny_server)
    requests = [
        generate_pb2.SessionRequest(generate=_request(
            request_id="bad", **_constrained(json_schema='{"type": "no-such-type"}'))),
        generate_pb2.SessionRequest(generate=_request(
            request_id="good", **_constrained(regex=EMAIL))),
    ]
    texts, errors, finals = {}, [], {}
    async for response in stub.Session(iter(requests)):
        if response.HasField("error"):
            errors.append(response.error)
            continue
        chunk = response.chunk
        texts[chunk.request_id] = texts.get(chunk.request_id, "") + chunk.text
        if chunk.finish_reason:
            finals[chunk.request_id] = chunk.finish_reason
    assert [(e.request_id, e.code) for e in errors] == [
        ("bad", grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    assert errors[0].message.startswith("structured_output.json_schema:")
    assert finals == {"good": generate_pb2.FINISH_REASON_EOS}
    assert re.fullmatch(EMAIL, texts["good"])


# ---- the OpenAI API -------------------------------------------------------------------------

@pytest.fixture
def client(tiny_server):
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{tiny_server.http_port}/v1",
                              api_key="x", max_retries=0, timeout=120)


def _model(server) -> str:
    return server.servicer.serving.facts.model_name


async def test_openai_response_format_json_schema_and_json_object(tiny_server, client):
    result = await client.chat.completions.create(
        model=_model(tiny_server), messages=[{"role": "user", "content": "Describe a ball."}],
        max_tokens=200, seed=5, response_format={
            "type": "json_schema", "json_schema": {"name": "ball", "schema": SCHEMA}})
    jsonschema.validate(json.loads(result.choices[0].message.content), SCHEMA)
    result = await client.completions.create(
        model=_model(tiny_server), prompt="A JSON object:", max_tokens=300, temperature=0,
        extra_body={"response_format": {"type": "json_object"}})
    text = result.choices[0].text
    assert text.startswith("{")
    if result.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


async def test_openai_guided_fields(tiny_server, client):
    model = _model(tiny_server)
    result = await client.completions.create(
        model=model, prompt="An email:", max_tokens=40, seed=1,
        extra_body={"guided_regex": EMAIL})
    assert re.fullmatch(EMAIL, result.choices[0].text)
    result = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Pick one."}], max_tokens=10, n=3,
        seed=2, extra_body={"guided_choice": ["left", "right"]})
    assert all(c.message.content in ("left", "right") for c in result.choices)
    result = await client.completions.create(
        model=model, prompt="JSON:", max_tokens=200, seed=3,
        extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(result.choices[0].text), SCHEMA)
    # Streamed: the chunks concatenate to a match.
    stream = await client.completions.create(
        model=model, prompt="An email:", max_tokens=40, seed=4, stream=True,
        extra_body={"guided_regex": EMAIL})
    text = "".join([choice.text async for chunk in stream for choice in chunk.choices])
    assert re.fullmatch(EMAIL, text)


async def test_openai_bad_grammar_names_the_param(tiny_server, client):
    model = _model(tiny_server)
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(model=model, prompt="x", max_tokens=4,
                                        extra_body={"guided_regex": "(unclosed"})
    assert error.value.body["param"] == "guided_regex"
    assert "structured_output.regex" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(model=model, prompt="x", max_tokens=4, extra_body={
            "guided_regex": "a", "guided_choice": ["a"]})
    assert error.value.body["param"] == "guided_choice"
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert error.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(model=model, prompt="x", max_tokens=4,
                                        extra_body={"guided_grammar": "root ::= \"a\""})
    assert error.value.body["param"] == "guided_grammar"


# ---- a real model ---------------------------------------------------------------------------

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "number"},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


@pytest.mark.slow(reason="SmolLM2 decoding up to 80 tokens, constrained by a grammar over its vocabulary")
async def test_smollm2_prose_prompt_gives_valid_json_when_constrained(smollm2_server):
    stub = stub_for(smollm2_server)

    def request(**kwargs) -> generate_pb2.GenerateRequest:
        pb = generate_pb2.GenerateRequest(messages=generate_pb2.ChatMessages(messages=[
            generate_pb2.ChatMessage(role="user",
                                     content="Tell me about Paris in two sentences.")]),
            **kwargs)
        pb.sampling.temperature = 0.0
        pb.stopping.max_new_tokens = 80
        return pb

    plain = await complete(stub, request())
    with pytest.raises(ValueError):
        json.loads(plain.text)
    constrained = await complete(stub, request(**_constrained(
        json_schema=json.dumps(CITY_SCHEMA))))
    assert constrained.finish_reason == generate_pb2.FINISH_REASON_EOS, constrained.text
    value = json.loads(constrained.text)
    jsonschema.validate(value, CITY_SCHEMA)
    assert "paris" in value["city"].lower()

    regex = r"(Yes|No)\. [A-Z][a-z ,]{5,60}\."
    out = await complete(stub, request(**_constrained(regex=regex)))
    assert re.fullmatch(regex, out.text), out.text

    # The same through the OpenAI API (an HTTP door on this server, on a free port).
    http = HttpServer(smollm2_server.admission, "127.0.0.1", 0)
    port = await http.start()
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                    max_retries=0, timeout=300)
        kwargs = dict(model=smollm2_server.servicer.serving.facts.model_name, max_tokens=80,
                      temperature=0, messages=[{"role": "user", "content":
                                                "Tell me about Paris in two sentences."}])
        plain_http = await client.chat.completions.create(**kwargs)
        assert plain_http.choices[0].message.content == plain.text
        reply = await client.chat.completions.create(response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}},
            **kwargs)
        assert json.loads(reply.choices[0].message.content) == value
        reply = await client.chat.completions.create(
            extra_body={"guided_choice": ["France", "Germany", "Spain"]}, **kwargs)
        assert reply.choices[0].message.content in ("France", "Germany", "Spain")
        assert reply.choices[0].finish_reason == "stop"
    finally:
        await http.stop(grace_s=1)
