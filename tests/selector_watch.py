"""A diagnosis of the test process's event loop, on with PLANSERVE_TEST_SELECTOR_WATCH=FILE:
every socket transport that is open, reading and not paused must have its reader in the loop's
selector, both asyncio's map and the kernel's epoll set. Twice in a row not (0.5 s apart), the
transport is reported to FILE with its fd's recent history: each transport made on that fd
number, each reader added and removed (by whom: a short stack), each Python socket close.

Why: the full suite hung, rarely, with the server's accepted connections never read. This watch
recorded how (docs/design-notes.md, "Why it was opt-in for a while"): an HTTP client dropped
unclosed had its sockets closed by the collector under live transports, the fd numbers went to
new connections, and the SDK's deferred aclose() then aborted the dead transports, removing the
new connections' readers by fd number. tests/conftest.py now closes every client a test makes;
the watch stays for whatever else could leave a transport unread.

It patches asyncio's private selector methods, so it is for diagnosis runs only.
"""

from __future__ import annotations

import asyncio.selector_events as events
import collections
import os
import socket
import time
import traceback

_HISTORY: dict[int, collections.deque] = collections.defaultdict(
    lambda: collections.deque(maxlen=32)
)
_WATCHED: set[int] = set()
_report = None


def _stack() -> str:
    frames = traceback.extract_stack(limit=9)[:-2]
    return " < ".join(
        f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(frames)
    )


def _note(fd, what: str, detail: object = "") -> None:
    if isinstance(fd, int) and fd >= 0:
        _HISTORY[fd].append((time.time(), what, repr(detail)[:120], _stack()))


def _kernel_fds(loop) -> set[int] | None:
    epoll = getattr(loop._selector, "_selector", None)
    if epoll is None or not hasattr(epoll, "fileno"):
        return None
    with open(f"/proc/self/fdinfo/{epoll.fileno()}") as info:
        return {int(line.split()[1]) for line in info if line.startswith("tfd:")}


def _check(loop) -> None:
    if loop.is_closed():
        _WATCHED.discard(id(loop))
        return
    registered, kernel = loop._selector.get_map(), _kernel_fds(loop)
    for fd, transport in list(loop._transports.items()):
        if not isinstance(transport, events._SelectorSocketTransport) or not transport.is_reading():
            continue
        if transport._sock is None or transport._protocol is None:
            continue
        key = registered.get(fd)
        reader = key.data[0] if key is not None else None
        ok = getattr(getattr(reader, "_callback", None), "__self__", None) is transport
        ok = ok and (kernel is None or fd in kernel)
        strikes = 0 if ok else transport.__dict__.get("_watch_strikes", 0) + 1
        transport.__dict__["_watch_strikes"] = strikes
        if strikes == 2:
            _write(fd, transport, key)
    loop.call_later(0.5, _check, loop)


def _write(fd: int, transport, key) -> None:
    with open(_report, "a") as out:
        out.write(
            f"--- {time.strftime('%H:%M:%S')} pid {os.getpid()}: {transport!r} is not read "
            f"(selector key: {key!r})\n"
        )
        for when, what, detail, stack in _HISTORY.get(fd, ()):
            out.write(
                f"    {time.strftime('%H:%M:%S', time.localtime(when))}{f'{when % 1:.6f}'[1:]} "
                f"{what} {detail}\n        {stack}\n"
            )


def install(report: str) -> None:
    global _report
    _report = report
    make_transport = events._SelectorTransport.__init__
    add_reader = events.BaseSelectorEventLoop._add_reader
    remove_reader = events.BaseSelectorEventLoop._remove_reader
    close = socket.socket.close

    def transport_init(self, loop, sock, protocol, extra=None, server=None):
        _note(sock.fileno(), "transport", type(protocol).__name__)
        make_transport(self, loop, sock, protocol, extra, server)

    def loop_add_reader(self, fd, callback, *args):
        if id(self) not in _WATCHED:
            _WATCHED.add(id(self))
            self.call_later(0.5, _check, self)
        _note(fd, "add_reader", getattr(callback, "__self__", None))
        return add_reader(self, fd, callback, *args)

    def loop_remove_reader(self, fd):
        key = self._selector.get_map().get(fd) if isinstance(fd, int) else None
        reader = key.data[0] if key is not None else None
        _note(fd, "remove_reader", getattr(getattr(reader, "_callback", None), "__self__", None))
        return remove_reader(self, fd)

    def socket_close(self):
        _note(self.fileno(), "socket.close")
        return close(self)

    events._SelectorTransport.__init__ = transport_init
    events.BaseSelectorEventLoop._add_reader = loop_add_reader
    events.BaseSelectorEventLoop._remove_reader = loop_remove_reader
    socket.socket.close = socket_close
