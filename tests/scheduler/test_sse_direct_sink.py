"""DirectSse (scheduler_service/api/sse_direct.py) over a real asyncio socket transport: an output
that does not end its sample is written by the sink only while the response task waits with
nothing queued and the socket has taken everything, once the delivering code yields, merged with
what came in the same go; anything else queued in order for the task, and a backlog behind a
socket that holds back merged as a slow reader's is."""
import argparse
import asyncio
import contextlib
import socket

from config_fields import add_flags, from_args

from scheduler_service.api.sse_chunks import SseChunks
from scheduler_service.api.sse_direct import DirectSse, writer_of
from scheduler_service.config import SchedulerConfig
from scheduler_service.api.streams import take_waiting
from scheduler_service.core.request import FinishReason, RequestOutput
from scheduler_service.text.outputs import merge

SSE = SseChunks("cmpl-1", "text_completion", 1764200000, "m", with_usage=False)


def _running(output: RequestOutput) -> str:
    """A completion's running chunk as the HTTP door makes it (openai_answers._Chunks.running)."""
    return SSE.text(output.index, output.text, None) if output.text or output.token_ids else ""


def _framed(*texts: str) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(t.encode()), t.encode()) for t in texts)


def _out(text: str, index: int = 0, final: bool = False) -> RequestOutput:
    return RequestOutput(token_ids=[ord(c) for c in text], text=text, index=index,
                         finish_reason=FinishReason.LENGTH if final else None)


@contextlib.asynccontextmanager
async def _connected(send_buffer: int = 0):
    """A server-side asyncio transport and the client's raw socket (blocking reads)."""
    server_sock, client = socket.socketpair()
    if send_buffer:
        server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, send_buffer)
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(
        asyncio.Protocol, server_sock)
    try:
        yield transport, client
    finally:
        transport.close()
        client.close()


async def _parked(sink: DirectSse) -> asyncio.Task:
    """The response task, waiting in get()."""
    task = asyncio.ensure_future(sink.get())
    await asyncio.sleep(0)
    return task


async def test_an_output_is_written_framed_once_the_delivering_code_yields():
    async with _connected() as (transport, client):
        sink = DirectSse(_running)
        sink.attach(transport)
        task = await _parked(sink)
        sink.put_nowait(_out("ab"))
        assert sink.num_written == 0  # held until this code yields
        await asyncio.sleep(0)
        assert client.recv(4096) == _framed(SSE.text(0, "ab", None))
        assert sink.num_written == 1 and sink.empty() and not task.done()
        sink.put_nowait(RequestOutput(token_ids=[], text=""))  # nothing to send: skipped
        await asyncio.sleep(0)
        assert sink.num_written == 1 and sink.empty()
        final = _out("c", final=True)
        sink.put_nowait(final)  # the last: the task's
        assert await task is final
        assert sink.num_written == 1


async def test_outputs_delivered_in_one_go_are_one_chunk_per_sample_before_the_last():
    """Several step messages read at once: each sample's outputs merged, one socket write; a
    last output arriving behind them goes to the task after they are written."""
    async with _connected() as (transport, client):
        sink = DirectSse(_running)
        sink.attach(transport)
        task = await _parked(sink)
        for output in (_out("a"), _out("x", index=1), _out("b"), _out("y", index=1)):
            sink.put_nowait(output)
        final = _out("c", final=True)
        sink.put_nowait(final)  # writes what is held first
        assert client.recv(4096) == _framed(SSE.text(0, "ab", None), SSE.text(1, "xy", None))
        assert sink.num_written == 2
        assert await task is final


async def test_outputs_queue_in_order_when_the_task_is_busy_or_not_attached():
    async with _connected() as (transport, _client):
        sink = DirectSse(_running)
        first = _out("a")
        sink.put_nowait(first)  # not attached yet
        sink.attach(transport)
        sink.put_nowait(_out("b"))  # no task waiting
        task = await _parked(sink)
        assert await task is first  # it had work waiting: it never parked
        task = await _parked(sink)
        assert (await task).text == "b"
        task = await _parked(sink)
        sink.put_nowait(_out("c", final=True))
        sink.put_nowait(_out("d", index=1))  # behind one queued: queued too
        assert (await task).text == "c"
        assert sink.get_nowait().text == "d"
        assert sink.num_written == 0


async def test_a_socket_that_holds_back_queues_and_the_backlog_merges():
    async with _connected(send_buffer=4096) as (transport, client):
        while transport.get_write_buffer_size() == 0:  # the client reads nothing
            transport.write(b"x" * 4096)
        sink = DirectSse(_running)
        sink.attach(transport)
        task = await _parked(sink)
        for text in ("a", "b", "c"):
            sink.put_nowait(_out(text))
        assert sink.num_written == 0
        first = await task
        taken = take_waiting(first, sink, lambda o: o.index, merge)
        assert [(o.text, o.token_ids) for o in taken] == [("abc", [97, 98, 99])]


async def test_take_over_keeps_what_the_first_queue_held():
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(_out("a"))
    queue.put_nowait(_out("b"))
    sink = DirectSse(_running).take_over(queue)
    assert queue.empty()
    assert [sink.get_nowait().text, sink.get_nowait().text] == ["a", "b"]


def test_on_by_default_and_no_socket_without_the_server_s_send():
    """On unless --no-sse-direct-writes (the HTTP server then leaves the app unwrapped, and a
    response finds no socket to write to)."""
    assert SchedulerConfig().no_sse_direct_writes is False
    parser = argparse.ArgumentParser()
    add_flags(parser, SchedulerConfig)
    off = from_args(SchedulerConfig, parser.parse_args(["--no-sse-direct-writes"]))
    assert off.no_sse_direct_writes is True
    assert writer_of({"type": "http", "http_version": "1.1"}) is None
