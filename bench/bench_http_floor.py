"""What one streamed SSE chunk costs an HTTP server at the least, with no planserve code: the
floors under a frontend process's share of the host path (issue 31; bench_host_path.py has
gRPC's, --grpc-floor).

N clients each POST once and read a chunked text/event-stream response of T chunks; the server
writes every open stream one chunk per tick of D ms, as a frontend writes each stream's token of
a step. Server CPU (user + system, from /proc) per chunk, two servers in turn, each in a child
process:

  transport   asyncio's own loop, a bare Protocol: the request read, the head written, then each
              chunk one transport.write from the ticker (what writing straight from the step's
              message would cost: the socket write and the loop)
  starlette   uvicorn (httptools) with a Starlette app: a StreamingResponse per request whose
              generator reads an asyncio.Queue that the ticker fills (the frameworks' path a
              frontend's streams took before a plain chunk was written where its output
              arrives, scheduler_service/api/sse_direct.py; the others still take it)

The clients are the benchmark's own process (raw HTTP/1.1, as bench_host_path.py's).

    PYTHONPATH=protos:. .venv/bin/python bench/bench_http_floor.py [--streams 128] [--tokens 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import time

from bench.gpu.monitor import cpu_seconds

# A chunk of the size a completion's SSE event has (id, object, created, model, one choice).
CHUNK = (
    b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
    b'"created":1764200000,"model":"null","choices":[{"index":0,"text":"a","logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
FRAMED = b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
END = b"0\r\n\r\n"


class _Stream(asyncio.Protocol):
    """One request on the bare server: read until the body is in, then ticked."""

    def __init__(self, streams: set, tokens: int):
        self.streams, self.tokens, self.received, self.left = streams, tokens, b"", 0

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.received += data
        head, sep, body = self.received.partition(b"\r\n\r\n")
        if not sep or self.left:
            return
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        if len(body) >= length:
            self.left = self.tokens
            self.transport.write(HEAD)
            self.streams.add(self)

    def tick(self) -> None:
        self.left -= 1
        if self.left:
            self.transport.write(FRAMED)
        else:
            self.transport.write(FRAMED + END)
            self.streams.discard(self)
            self.transport.close()


async def _serve_transport(port_out, tokens: int, tick_s: float) -> None:
    streams: set[_Stream] = set()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Stream(streams, tokens), "127.0.0.1", 0)
    port_out.put(server.sockets[0].getsockname()[1])
    while True:
        await asyncio.sleep(tick_s)
        for stream in list(streams):
            stream.tick()


async def _serve_starlette(port_out, tokens: int, tick_s: float) -> None:
    import socket

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    queues: set[asyncio.Queue] = set()

    async def events(queue: asyncio.Queue):
        try:
            for _ in range(tokens):
                yield await queue.get()
        finally:
            queues.discard(queue)

    async def completions(request):
        await request.body()
        queue: asyncio.Queue = asyncio.Queue()
        queues.add(queue)
        return StreamingResponse(events(queue), media_type="text/event-stream")

    async def ticker():
        while True:
            await asyncio.sleep(tick_s)
            for queue in list(queues):
                queue.put_nowait(CHUNK)

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port_out.put(sock.getsockname()[1])
    config = uvicorn.Config(app, http="httptools", log_level="error", lifespan="off")
    task = asyncio.ensure_future(ticker())
    await uvicorn.Server(config).serve(sockets=[sock])
    task.cancel()


def _child(kind: str, port_out, tokens: int, tick_s: float) -> None:
    serve = _serve_transport if kind == "transport" else _serve_starlette
    asyncio.run(serve(port_out, tokens, tick_s))


async def _clients(port: int, n: int) -> int:
    """n streams read to the end; the chunks they got."""

    async def one() -> int:
        body = b'{"prompt": "a", "stream": true}'
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        chunks = 0
        async for line in reader:
            chunks += line.startswith(b"data: {")
        writer.close()
        return chunks

    return sum(await asyncio.gather(*(one() for _ in range(n))))


def floor(kind: str, args) -> dict:
    port_out: multiprocessing.Queue = multiprocessing.Queue()
    child = multiprocessing.Process(
        target=_child, args=(kind, port_out, args.tokens, args.tick_ms / 1000), daemon=True
    )
    child.start()
    port = port_out.get(timeout=60)
    time.sleep(0.5)
    try:
        cpu0, start = cpu_seconds(child.pid), time.perf_counter()
        chunks = asyncio.run(_clients(port, args.streams))
        wall, cpu = time.perf_counter() - start, cpu_seconds(child.pid) - cpu0
    finally:
        child.kill()
    assert chunks == args.streams * args.tokens, (chunks, args.streams * args.tokens)
    per_chunk_us = cpu * 1e6 / chunks
    return {"server": kind, "streams": args.streams, "tokens_each": args.tokens,
            "tick_ms": args.tick_ms, "server_cpu_us_per_chunk": round(per_chunk_us, 2),
            "server_cpu_ms_per_tick": round(per_chunk_us * args.streams / 1000, 3),
            "ms_per_tick": round(wall * 1000 / args.tokens, 3),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=128, help="a frontend's share of 256")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--tick-ms", type=float, default=4.0)
    parser.add_argument("--servers", default="transport,starlette")
    parser.add_argument("--out", default=None, help="also append the rows to this JSON file")
    args = parser.parse_args()
    rows = [floor(kind, args) for kind in args.servers.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        results = {"runs": []}
        if os.path.exists(args.out):
            with open(args.out) as f:
                results = json.load(f)
        results["runs"].append({"python": platform.python_version(), "rows": rows})
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
