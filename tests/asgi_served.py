"""An ASGI app served by a real uvicorn (httptools) on 127.0.0.1, for the HTTP layers' tests."""

import asyncio
import contextlib

import uvicorn


@contextlib.asynccontextmanager
async def served(app):
    """Yields (the uvicorn server, its port) while it serves `app`; stops it after."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None,
                                           lifespan="off", http="httptools"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield server, server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
