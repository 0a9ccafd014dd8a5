"""vLLM's chat-template extensions on /v1/chat/completions (`chat_template_kwargs`,
`add_generation_prompt`, `continue_final_message`), and `stop_token_ids`: the prompt a body
renders to is transformers' `apply_chat_template` of the same conversation and options, token
for token, on a model folder whose template reads `enable_thinking` as Qwen3's does; the
generation uses that prompt; bad options are refused naming the parameter."""
from __future__ import annotations

import asyncio
import json
import os

import openai
import pytest
import pytest_asyncio

from api import (assert_no_leaked_blocks, complete, greedy_ids_request, http_json, stub_for,
                 wait_until_idle)
from conftest import EngineProcess, start_scheduler
from hf_folders import write_tiny_hf_folder

# ChatML with Qwen3's switch: without thinking, the reply opens with an empty think block.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "Name a colour."}]
STARTED = ASK + [{"role": "assistant", "content": "My favourite colour is"}]
CASES = {
    "thinking off": (ASK, {"chat_template_kwargs": {"enable_thinking": False}}),
    "thinking on": (ASK, {"chat_template_kwargs": {"enable_thinking": True}}),
    "no generation prompt": (ASK, {"add_generation_prompt": False}),
    "final message continued": (
        STARTED, {"add_generation_prompt": False, "continue_final_message": True}),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    folder = write_tiny_hf_folder(str(tmp_path_factory.mktemp("hf") / "tiny-thinking"))
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["chat_template"] = TEMPLATE
    config["eos_token"] = "<|im_end|>"  # (transformers 5 reads a string only)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return folder


@pytest_asyncio.fixture(scope="module")
async def server(folder):
    engine = EngineProcess("--model", folder, "--dtype", "float32", "--num-kv-blocks", "32")
    server = await start_scheduler(engine.address, http_port=0)
    yield server
    await server.stop(grace_s=1)
    engine.stop()


def _transformers_ids(folder: str, messages: list[dict], options: dict) -> list[int]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    kwargs = dict(options.get("chat_template_kwargs", {}))
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=False,
        add_generation_prompt=options.get("add_generation_prompt", True),
        continue_final_message=options.get("continue_final_message", False), **kwargs)
    return list(ids)


def _model(server) -> str:
    return server.servicer.serving.facts.model_name


@pytest.mark.parametrize("case", sorted(CASES))
async def test_the_prompt_is_transformers_rendering_and_generation_uses_it(server, folder, case):
    messages, options = CASES[case]
    body = {"model": _model(server), "messages": messages, "max_tokens": 4, **options}
    status, rendered = await asyncio.to_thread(
        http_json, server.http_port, "/v1/chat/completions/render", body)
    assert status == 200, rendered
    assert rendered["token_ids"] == _transformers_ids(folder, messages, options)
    status, reply = await asyncio.to_thread(
        http_json, server.http_port, "/v1/chat/completions", body)
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens"] == len(rendered["token_ids"])


async def test_the_thinking_switch_changes_the_prompt(server):
    """The kwargs reach the template: off adds the empty think block, on renders as no kwargs."""
    ids = {}
    for name, kwargs in (("off", {"enable_thinking": False}), ("on", {"enable_thinking": True}),
                         ("none", None)):
        body = {"model": _model(server), "messages": ASK, "chat_template_kwargs": kwargs}
        _, rendered = await asyncio.to_thread(
            http_json, server.http_port, "/v1/chat/completions/render", body)
        ids[name] = rendered["token_ids"]
    assert ids["on"] == ids["none"]
    tokenizer = server.servicer.serving.tokenizer
    assert tokenizer.decode(ids["off"][len(ids["on"]):], skip_special_tokens=False) == \
        "<think>\n\n</think>\n\n"


BAD = [
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
     "chat_template_kwargs.messages: reserved"),
    ({"continue_final_message": True}, "continue_final_message",
     "continue_final_message: needs add_generation_prompt set to false"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message",
     "continue_final_message: the last message must be an assistant's, with content"),
    ({"stop_token_ids": [10**7]}, "stop_token_ids",
     "stop_token_ids[0]: 10000000 is outside the vocabulary"),
]


@pytest.mark.parametrize("extra, param, message", BAD)
async def test_bad_template_options_are_refused_naming_the_parameter(server, extra, param, message):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                                api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=_model(server), messages=ASK, max_tokens=2,
                                             extra_body=extra)
    assert caught.value.param == param
    assert caught.value.body["message"].startswith(message)
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def test_stop_token_ids_end_a_completion_as_on_grpc(server):
    prompt = [1, 17, 300, 4000, 22, 9]
    free = await complete(stub_for(server), greedy_ids_request(prompt, 12))
    stop_id = free.token_ids[5]
    request = greedy_ids_request(prompt, 12)
    request.stopping.stop_token_ids.append(stop_id)
    stopped = await complete(stub_for(server), request)
    assert len(stopped.token_ids) < 12
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                                api_key="x", max_retries=0, timeout=60)
    result = await client.completions.create(
        model=_model(server), prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "return_token_ids": True})
    [choice] = result.choices
    assert choice.model_extra["token_ids"] == stopped.token_ids
    assert choice.finish_reason == "stop"
