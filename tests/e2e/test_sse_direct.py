"""A streamed response's common chunk written to the socket where its output arrives
(scheduler_service/api/sse_direct.py, on unless --no-sse-direct-writes): the client reads the same events as from the response
task's path, chunked the same way, with logprobs, token ids and n samples too; the first and
last chunks and HTTP/1.0 take the task's path. Counted in the default layout (the doors in this process); behind frontend
processes the same reads are checked without the count."""
import asyncio
import json
import urllib.request

import pytest
import pytest_asyncio
from api import assert_no_leaked_blocks, sse_request, wait_until_idle
from conftest import FRONTEND_PROCESSES, EngineProcess, start_scheduler

from scheduler_service.api import openai_answers
from scheduler_service.api.sse_direct import DirectSse

PROMPT = "The quick brown fox"


@pytest_asyncio.fixture(scope="module")
async def direct_server():
    """tiny_server's settings, on a model service of its own (a model service serves one
    scheduler at a time, and tiny_server holds the session's): the chunks written directly are
    counted here."""
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    server = await start_scheduler(engine.address, max_num_batched_tokens=64, max_num_seqs=16,
                                   http_port=0)
    yield server
    await server.stop(grace_s=1)
    engine.stop()


@pytest.fixture
def direct(monkeypatch):
    """Every DirectSse made from now on, for its count of chunks written at once."""
    made: list[DirectSse] = []

    class Counted(DirectSse):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(openai_answers, "DirectSse", Counted)
    return made


def _written(made: list[DirectSse]) -> int:
    return sum(sse.num_written for sse in made)


def _body(server, stream: bool, chat: bool = False, **extra) -> dict:
    body = {"model": server.servicer.serving.facts.model_name, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": stream, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return body


async def _whole_text(server, chat: bool) -> str:
    port = server.http_port
    path = "/v1/chat/completions" if chat else "/v1/completions"
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     data=json.dumps(_body(server, False, chat)).encode(),
                                     headers={"content-type": "application/json"})
    answer = await asyncio.to_thread(lambda: json.load(urllib.request.urlopen(request)))
    choice = answer["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_a_plain_stream_written_at_once_reads_as_the_whole_answer(direct_server, direct,
                                                                       chat):
    port = direct_server.http_port
    path = "/v1/chat/completions" if chat else "/v1/completions"
    streamed = await sse_request(port, path, _body(direct_server, True, chat))
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.events[-1] == "[DONE]"
    assert streamed.text() == await _whole_text(direct_server, chat)
    # One HTTP chunk per event, as the task's path frames them: 24 tokens (some may carry no
    # text yet), the chat's role first; the last token's chunk and [DONE] share the body's last
    # (streams.LastEvents).
    assert streamed.num_http_chunks == len(streamed.events) - 1
    if chat:
        assert '"role":"assistant"' in streamed.events[0]
    if not FRONTEND_PROCESSES:
        assert _written(direct) >= 12  # most of the 24 tokens' chunks
    await wait_until_idle(direct_server)
    assert_no_leaked_blocks(direct_server)


def _joined(events: list[str]) -> dict:
    """Each choice's stream joined: its text, token ids and logprobs in order, and its finish
    reason (a reader that fell behind gets the same in fewer chunks)."""
    choices: dict = {}
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            joined = choices.setdefault(choice["index"], {"text": "", "token_ids": [],
                                                          "logprobs": {}, "finish": None})
            joined["text"] += choice.get("text") or choice.get("delta", {}).get("content") or ""
            joined["token_ids"] += choice.get("token_ids") or []
            for key, values in (choice.get("logprobs") or {}).items():
                joined["logprobs"].setdefault(key, []).extend(values)
            joined["finish"] = choice["finish_reason"] or joined["finish"]
    return choices


@pytest.mark.parametrize("chat, extra", [
    (False, {}),
    (False, {"logprobs": 2}),
    (False, {"return_token_ids": True, "n": 2, "temperature": 1.0, "seed": 7}),
    (True, {"logprobs": True, "top_logprobs": 2}),
], ids=["plain", "logprobs", "token_ids_n_2", "chat_logprobs"])
async def test_a_stream_reads_the_same_written_at_once_or_by_the_response_task(
        direct_server, direct, chat, extra):
    """HTTP/1.0 keeps every chunk on the response task's path; the same request over HTTP/1.1
    has most written where its outputs arrive, and its client reads the same events."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    by_task = await sse_request(direct_server.http_port, path, _body(direct_server, True, chat, **extra),
                                http_version="1.0")
    at_once = await sse_request(direct_server.http_port, path, _body(direct_server, True, chat, **extra))
    assert by_task.events[-1] == at_once.events[-1] == "[DONE]"
    assert _joined(at_once.events) == _joined(by_task.events)
    assert at_once.num_http_chunks == len(at_once.events) - 1  # the last two in one
    assert len(_joined(at_once.events)) == extra.get("n", 1)
    assert all(choice["finish"] == "length" for choice in _joined(at_once.events).values())
    if not FRONTEND_PROCESSES:  # the HTTP/1.0 response made no sink
        assert len(direct) == 1 and direct[0].num_written >= 12
    await wait_until_idle(direct_server)
    assert_no_leaked_blocks(direct_server)

