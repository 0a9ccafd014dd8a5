"""EventStream (scheduler_service/api/streams.py), the HTTP doors' streamed answer, served by a
real uvicorn on 127.0.0.1: every event arrives and nothing of the answer outlives it; a client
that disconnects mid-stream has its generator closed (where a door aborts its request) without
an error in the server's log; an answer cancelled by its server, not its client, stays
cancelled; LastEvents go out with the end of the body."""

import asyncio
import contextlib
import logging

from asgi_served import served
from starlette.applications import Starlette
from starlette.routing import Route

from scheduler_service.api.streams import EventStream, LastEvents


class _Answers:
    """A Starlette app whose /stream answers `events` events, then waits on `release`."""

    def __init__(self, events: int):
        self.events = events
        self.release = asyncio.Event()
        self.closed = asyncio.Event()  # the generator's finally ran
        self.app = Starlette(routes=[Route("/stream", self.stream)])

    async def stream(self, request):
        return EventStream(self._generate())

    async def _generate(self):
        try:
            for i in range(self.events):
                yield f"data: {i}\n\n"
            await self.release.wait()
        finally:
            self.closed.set()


async def _get(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"content-type: text/event-stream" in head.lower()
    assert b"cache-control: no-cache" in head.lower()
    return reader, writer


async def _read_event(reader: asyncio.StreamReader) -> bytes:
    size = int(await reader.readline(), 16)
    data = await reader.readexactly(size + 2)
    return data[:-2]


def _watchers() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if "listen_for_disconnect" in repr(t.get_coro())]


async def test_every_event_arrives_and_the_watch_ends_with_the_answer():
    answers = _Answers(events=5)
    answers.release.set()
    async with served(answers.app) as (_, port):
        reader, writer = await _get(port)
        events = [await _read_event(reader) for _ in range(5)]
        assert events == [f"data: {i}\n\n".encode() for i in range(5)]
        assert await reader.readline() == b"0\r\n"  # the chunked body's end
        await asyncio.wait_for(answers.closed.wait(), 5)
        await asyncio.sleep(0.05)
        assert _watchers() == []
        writer.close()


async def test_a_client_gone_mid_stream_closes_the_generator_without_an_error(caplog):
    answers = _Answers(events=2)
    with caplog.at_level(logging.ERROR):
        async with served(answers.app) as (_, port):
            reader, writer = await _get(port)
            assert await _read_event(reader) == b"data: 0\n\n"
            writer.close()
            await asyncio.wait_for(answers.closed.wait(), 5)
            await asyncio.sleep(0.05)
            assert _watchers() == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def _answer_called_directly(answers: _Answers, disconnect: asyncio.Event):
    """The answer as an ASGI call of its own (the server's part played here: what a server does
    when it stops, cancelling the call, is what this shows), with its sends and the task."""
    sent = []

    async def receive():
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    task = asyncio.ensure_future(EventStream(answers._generate())(scope, receive, send))
    while len(sent) < 2:  # the head and the first event
        await asyncio.sleep(0)
    return task, sent


async def test_an_answer_cancelled_by_its_server_stays_cancelled():
    answers = _Answers(events=1)
    task, sent = await _answer_called_directly(answers, asyncio.Event())
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled() and answers.closed.is_set()
    assert sent[-1]["body"] == b"data: 0\n\n"  # no end of body: the answer did not finish
    await asyncio.sleep(0)
    assert _watchers() == []


async def test_a_cancel_beside_a_disconnect_stays_a_cancel():
    answers = _Answers(events=1)
    disconnect = asyncio.Event()
    task, _ = await _answer_called_directly(answers, disconnect)
    disconnect.set()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled() and answers.closed.is_set()


async def test_a_disconnect_alone_ends_the_answer_quietly():
    answers = _Answers(events=1)
    disconnect = asyncio.Event()
    task, _ = await _answer_called_directly(answers, disconnect)
    disconnect.set()
    assert await asyncio.wait_for(task, 5) is None
    assert answers.closed.is_set()


async def test_last_events_go_out_with_the_end_of_the_body():
    async def events():
        yield "data: 0\n\n"
        yield LastEvents("data: 1\n\ndata: [DONE]\n\n")

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        await asyncio.Event().wait()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    await asyncio.wait_for(EventStream(events())(scope, receive, send), 5)
    assert [(m.get("body"), m.get("more_body")) for m in sent[1:]] == [
        (b"data: 0\n\n", True), (b"data: 1\n\ndata: [DONE]\n\n", False)]

    answers = _Answers(events=3)
    answers.release.set()
    sent.clear()
    await asyncio.wait_for(EventStream(answers._generate())(scope, receive, send), 5)
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
