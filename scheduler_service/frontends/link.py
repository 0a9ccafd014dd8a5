"""The link between the engine-core process and one frontend process: one end of a
`socket.socketpair()` each (the frontend's end passed with Popen's pass_fds), never TCP and
nothing on disk, so no other process can reach it.

Frames are a 4-byte big-endian length, then a pickled message (a tuple whose first item names
its kind; scheduler_service/frontends/__init__.py lists them). Pickle is acceptable here because
both ends are this program's own processes on a private socketpair: nothing else can write to
it, and what one end unpickles the other end made.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any

_HEADER = struct.Struct(">I")
# A frame bigger than this is a bug (a step of every request's outputs stays far below it).
MAX_FRAME_BYTES = 1 << 30


class LinkClosed(Exception):
    """The other end went away (its process exited or was killed)."""


class Link:
    """Framed messages over one end of the socketpair, on asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer
        self.closed = False

    @classmethod
    async def open(cls, sock: socket.socket) -> "Link":
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_FRAME_BYTES)
        return cls(reader, writer)

    def send(self, message: tuple) -> None:
        """Queues one message (the transport writes it without blocking the loop); a closed
        link drops it: its reader learns of the end on its own."""
        if self.closed or self._writer.is_closing():
            return
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(_HEADER.pack(len(body)) + body)

    async def drain(self) -> None:
        """Waits until what was sent is handed to the socket (a frontend's last words)."""
        try:
            await self._writer.drain()
        except (ConnectionError, RuntimeError):
            pass

    async def receive(self) -> Any:
        """The next message; LinkClosed at the end of the stream."""
        try:
            header = await self._reader.readexactly(_HEADER.size)
            (size,) = _HEADER.unpack(header)
            if size > MAX_FRAME_BYTES:
                raise LinkClosed(f"frame of {size} bytes is over {MAX_FRAME_BYTES}")
            body = await self._reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            self.closed = True
            raise LinkClosed(str(error)) from None
        return pickle.loads(body)

    def close(self) -> None:
        self.closed = True
        self._writer.close()
