"""Fuzz the HTTP doors of a live scheduler (over the null model: completions, chat, render,
Anthropic's messages, OpenAI's responses, tokenize) with random JSON bodies: every field the doors
read, with plausible values and junk of every JSON type. Every body gets an answer
in bounded time with a status below 500, and every refusal has its door's error shape with a
message; the process stays up, and afterwards a valid request is served exactly and no KV block
or request is left."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import EngineProcess
from fuzz_settings import CALL_TIMEOUT_S, FUZZ
from model_service.models.null import null_continuation

pytestmark = pytest.mark.slow(
    reason="150 random bodies a door, each a round trip to a live server (PLANSERVE_FUZZ_EXAMPLES sets fewer)"
)

MODEL = "null"
VOCAB = 259  # the null model's byte-level vocabulary and its specials (models/null.py)

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
    st.text(max_size=8), st.lists(st.integers(-3, 2**33), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
)


IDS = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1),
                         st.integers(-1, 2**33)), max_size=10)
PROMPT = st.one_of(
    st.text(min_size=1, max_size=24), IDS, st.lists(st.text(min_size=1, max_size=12), max_size=4),
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), max_size=4),
)
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                              "text": st.text(max_size=8)})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "robot"]),
     "content": st.one_of(st.text(max_size=16), st.none(), st.lists(PART, max_size=2))},
    optional={"tool_call_id": st.text(max_size=4),
              "tool_calls": st.lists(st.fixed_dictionaries(
                  {"id": st.text(max_size=4), "type": st.just("function"),
                   "function": st.fixed_dictionaries(
                       {"name": st.sampled_from(["f", ""]),
                        "arguments": st.sampled_from(["{}", '{"a": 1}', "not json"])})}),
                  max_size=2)})
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", ""]),
     "parameters": st.sampled_from([{"type": "object"}, {"type": "nonsense"},
                                    {"type": "object", "properties": {"a": {"type": "integer"}}}])})})
COMMON = {
    "max_tokens": (st.integers(0, 6)),
    "temperature": (st.floats(0, 2)),
    "top_p": (st.floats(0.01, 1)),
    "top_k": (st.integers(-1, 50)),
    "seed": (st.integers(0, 2**64)),
    "n": (st.integers(1, 3)),
    "stop": (st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=5))),
    "ignore_eos": (st.booleans()),
    "return_token_ids": (st.booleans()),
    "stream": st.booleans(),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stream_interval": (st.integers(1, 3)),
    "presence_penalty": (st.floats(-2, 2)),
    "repetition_penalty": (st.floats(0.5, 2)),
    "min_p": (st.floats(0, 1)),
    "min_tokens": (st.integers(0, 8)),
    "prompt_logprobs": st.integers(0, 3),
    "logit_bias": (st.dictionaries(st.sampled_from(["1", "7", "258", "258", "x", "999999"]),
                                          st.floats(-200, 200), max_size=3)),
    "priority": (st.integers(-3, 3)),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3)),
    "cache_salt": (st.text(max_size=6)),
    # One way to constrain at a time (two are refused by name before anything else is read).
    "response_format": st.sampled_from(
        [{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
         {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, {"type": "x"}]),
}


def _one_spoiled(bodies):
    """The bodies, and a third of the time one with one field's value replaced by junk of any
    JSON type (a body with junk everywhere is refused at its first field, which fuzzes little)."""

    def spoil(body):
        return st.tuples(st.sampled_from(sorted(body)), JUNK).map(
            lambda pair: {**body, pair[0]: pair[1]})

    return st.one_of(bodies, bodies, bodies.flatmap(spoil))


COMPLETION = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL] * 7 + ["other"]), "prompt": PROMPT},
    optional={**COMMON, "logprobs": (st.integers(0, 5)), "echo": (st.booleans()),
              "suffix": st.just("")})
CHAT = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL] * 7 + ["other"]),
     "messages": st.lists(MESSAGE, max_size=4)},
    optional={**COMMON, "logprobs": (st.booleans()), "top_logprobs": (st.integers(0, 5)),
              "max_completion_tokens": (st.integers(1, 6)),
              "tools": (st.lists(TOOL, max_size=2)),
              "tool_choice": (st.sampled_from(
                  ["auto", "none", "required", "bogus", {"type": "function", "function": {"name": "f"}}])),
              "chat_template_kwargs": (st.dictionaries(
                  st.sampled_from(["enable_thinking", "messages", "x"]), st.booleans(), max_size=2)),
              "add_generation_prompt": (st.booleans()),
              "continue_final_message": (st.booleans())})
ANTHROPIC = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": (st.integers(1, 6)),
     "messages": st.lists(st.fixed_dictionaries(
         {"role": st.sampled_from(["user", "user", "assistant", "system"]),
          "content": st.one_of(st.text(max_size=12), st.lists(st.one_of(
              st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=6)}),
              st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=3),
                                     "name": st.just("f"), "input": st.just({})}),
              st.fixed_dictionaries({"type": st.just("tool_result"),
                                     "tool_use_id": st.text(max_size=3),
                                     "content": st.text(max_size=4)}),
              JUNK), max_size=2))}), max_size=3)},
    optional={"system": (st.text(max_size=8)), "stream": st.booleans(),
              "temperature": (st.floats(0, 1)),
              "stop_sequences": (st.lists(st.text(max_size=3), max_size=2)),
              "tool_choice": (st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "x"}]))})
ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "x"]),
                           "content": st.one_of(st.text(max_size=10), st.lists(
                               st.fixed_dictionaries({"type": st.sampled_from(
                                   ["input_text", "output_text", "input_image"]),
                                   "text": st.text(max_size=6)}), max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=3),
                           "name": st.just("f"),
                           "arguments": st.sampled_from(["{}", '{"a": 2}', "[", ""])}),
    st.fixed_dictionaries({"type": st.just("function_call_output"),
                           "call_id": st.text(max_size=3), "output": st.text(max_size=6)}),
    JUNK)
RESPONSES = st.fixed_dictionaries(
    {"model": st.just(MODEL),
     "input": st.one_of(st.text(min_size=1, max_size=16), st.lists(ITEM, max_size=3))},
    optional={"instructions": st.text(max_size=8), "max_output_tokens": st.integers(0, 6),
              "temperature": st.floats(0, 2), "stream": st.booleans(),
              "store": st.booleans(), "previous_response_id": st.text(max_size=4),
              "tools": st.lists(st.fixed_dictionaries(
                  {"type": st.just("function"), "name": st.sampled_from(["f", ""]),
                   "parameters": st.sampled_from([{"type": "object"}, {"type": "x"}])}),
                  max_size=2),
              "tool_choice": st.sampled_from(["auto", "none", "required", "bogus"])})

COMPLETION, CHAT, ANTHROPIC, RESPONSES = map(
    _one_spoiled, (COMPLETION, CHAT, ANTHROPIC, RESPONSES))


@pytest.fixture(scope="module")
def server():
    engine = EngineProcess("--model", "null", "--num-kv-blocks", "512")
    process = subprocess.Popen(
        [sys.executable, "-m", "scheduler_service.cli", "--log-level", "warning", "scheduler",
         "--engine", engine.address, "--port", "0", "--metrics-port", "-1", "--http-port", "0",
         "--enable-tokenizer-info-endpoint"],
        stdout=subprocess.PIPE, text=True)
    try:
        http = None
        for line in process.stdout:
            if line.startswith("PLANSERVE_HTTP_PORT="):
                http = f"http://127.0.0.1:{int(line.split('=', 1)[1])}"
            if line.startswith("PLANSERVE_PORT=") and http is None:
                continue
            if http is not None:
                break
        else:
            raise RuntimeError(f"scheduler exited with {process.wait()}")
        with httpx.Client(base_url=http, timeout=CALL_TIMEOUT_S) as client:
            _wait_ready(client)
            yield client, process
    finally:
        process.kill()
        process.wait()
        engine.stop()


def _wait_ready(client: httpx.Client) -> None:
    deadline = time.monotonic() + 60
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the scheduler never answered /health"
        time.sleep(0.1)


def _post(client: httpx.Client, path: str, body: dict) -> None:
    """Posts `body` and checks the answer: below 500, a refusal in its door's error shape. A
    streamed answer is read for its first events only (acceptance is what is fuzzed)."""
    with client.stream("POST", path, content=json.dumps(body),
                       headers={"Content-Type": "application/json"}) as response:
        if response.status_code == 200:
            for _ in response.iter_bytes():
                break  # the first bytes, then the client goes (the request is aborted)
            return
        text = response.read().decode()
    assert response.status_code < 500, (response.status_code, text, body)
    error = json.loads(text)["error"]
    assert isinstance(error["message"], str) and error["message"], text


@FUZZ
@given(body=COMPLETION)
def test_completions_with_random_bodies(server, body):
    _post(server[0], "/v1/completions", body)


@FUZZ
@given(body=CHAT)
def test_chat_completions_with_random_bodies(server, body):
    _post(server[0], "/v1/chat/completions", body)


@FUZZ
@given(body=st.one_of(COMPLETION, CHAT), chat=st.booleans())
def test_render_with_random_bodies(server, body, chat):
    path = "/v1/chat/completions/render" if "messages" in body else "/v1/completions/render"
    _post(server[0], path, body)


@FUZZ
@given(body=ANTHROPIC)
def test_anthropic_messages_with_random_bodies(server, body):
    _post(server[0], "/v1/messages", body)


@FUZZ
@given(body=RESPONSES)
def test_responses_with_random_bodies(server, body):
    _post(server[0], "/v1/responses", body)


@FUZZ
@given(body=st.one_of(
    st.fixed_dictionaries({}, optional={"prompt": (st.text(max_size=12)),
                                        "messages": (st.lists(MESSAGE, max_size=2)),
                                        "add_special_tokens": (st.booleans())}),
    st.fixed_dictionaries({"tokens": (IDS)})))
def test_tokenize_and_detokenize_with_random_bodies(server, body):
    _post(server[0], "/detokenize" if "tokens" in body else "/tokenize", body)


def test_after_the_fuzz_the_server_serves_exactly_and_holds_nothing(server):
    # Runs after the fuzz tests above (file order).
    client, process = server
    assert process.poll() is None
    prompt = [1, 2, 3, 4, 5]
    reply = client.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}).json()
    assert reply["choices"][0]["token_ids"] == null_continuation(prompt, 20)
    deadline = time.monotonic() + 30
    while True:  # streams the client left are aborted at the next step
        load = client.get("/load").json()
        if load["num_requests_waiting"] == load["num_requests_running"] == 0 and \
                load["kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() < deadline, f"requests or blocks left: {load}"
        time.sleep(0.05)
