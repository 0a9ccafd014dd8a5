"""A TCP proxy on 127.0.0.1 that can go silent, as a peer whose host is lost: it then keeps every
connection it holds open and passes nothing more on them, neither way, so that only a keepalive
ping left unanswered tells either end. New connections after that go to `next_target` (another
server, as a Service's name leads to a rescheduled pod), or are held silent too."""

from __future__ import annotations

import asyncio
from typing import Optional


class SilentProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.next_target_port: Optional[int] = None
        self.silent = False
        self._server: Optional[asyncio.base_events.Server] = None
        self._pipes: set[asyncio.Task] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        """Listens; returns the port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    def go_silent(self, next_target: Optional[int] = None) -> None:
        """From now on the connections held pass nothing; new ones go to `next_target`."""
        self.silent = True
        self.next_target_port = next_target

    async def close(self) -> None:
        for pipe in self._pipes:
            pipe.cancel()
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        target = self.next_target_port if self.silent else self.target_port
        if target is None:
            return  # held open, never answered
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        self._writers.append(up_writer)
        # A connection made after the silence is the new target's: it is never silenced.
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.ensure_future(self._pipe(source, sink, silenced=not self.silent))
            self._pipes.add(pipe)

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, silenced: bool
    ) -> None:
        while data := await source.read(65536):
            if silenced and self.silent:
                await asyncio.Event().wait()  # what came stays unread and unsent
            sink.write(data)
            await sink.drain()
