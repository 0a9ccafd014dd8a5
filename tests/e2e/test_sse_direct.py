"""A streamed response's common chunk written to the socket where its output arrives
(scheduler_service/api/sse_direct.py): the client reads the same events as from the response
task's path, chunked the same way; the first and last chunks, HTTP/1.0 and logprobs take the
task's path. Counted in the default layout (the doors in this process); behind frontend
processes the same reads are checked without the count."""
import asyncio
import json
import urllib.request

import pytest
from api import assert_no_leaked_blocks, sse_request, wait_until_idle
from conftest import FRONTEND_PROCESSES

from scheduler_service.api import openai_http
from scheduler_service.api.sse_direct import DirectSse

PROMPT = "The quick brown fox"


@pytest.fixture
def direct(monkeypatch):
    """Every DirectSse made from now on, for its count of chunks written at once."""
    made: list[DirectSse] = []

    class Counted(DirectSse):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(openai_http, "DirectSse", Counted)
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
async def test_a_plain_stream_written_at_once_reads_as_the_whole_answer(tiny_server, direct,
                                                                       chat):
    port = tiny_server.http_port
    path = "/v1/chat/completions" if chat else "/v1/completions"
    streamed = await sse_request(port, path, _body(tiny_server, True, chat))
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.events[-1] == "[DONE]"
    assert streamed.text() == await _whole_text(tiny_server, chat)
    # One HTTP chunk per event, as the task's path frames them: 24 tokens (some may carry no
    # text yet), the chat's role first, [DONE] last.
    assert streamed.num_http_chunks == len(streamed.events)
    if chat:
        assert '"role":"assistant"' in streamed.events[0]
    if not FRONTEND_PROCESSES:
        assert _written(direct) >= 12  # most of the 24 tokens' chunks
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_http_1_0_and_logprobs_take_the_response_task_path(tiny_server, direct):
    port = tiny_server.http_port
    whole = await _whole_text(tiny_server, chat=False)
    old = await sse_request(port, "/v1/completions", _body(tiny_server, True), http_version="1.0")
    assert old.text() == whole and old.events[-1] == "[DONE]"
    with_logprobs = await sse_request(port, "/v1/completions", _body(tiny_server, True, logprobs=1))
    assert with_logprobs.text() == whole
    assert all('"logprobs":{' in event for event in with_logprobs.events[:-1])
    if not FRONTEND_PROCESSES:
        assert len(direct) == 1  # only the HTTP/1.0 stream is plain
        assert _written(direct) == 0
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)
