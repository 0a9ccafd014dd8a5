"""The Execute stream's plans as the server's step loop takes them.

In line (the default): `next` reads the gRPC request iterator on the handler's thread and blocks
until a plan comes. With launch-ahead (model_service/step/launch_ahead.py) the loop must wait for
two things at once, the next plan and the device finishing the step in flight, whichever comes
first: a thread then reads the iterator into a queue, and `next` polls it while the step is not
done.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator, Optional

# How often a wait for the next plan looks at the device again. A plan that comes is taken at
# once (the queue wakes the waiter); this only bounds how late a finished step is noticed.
POLL_S = 0.0001


class End:
    """The stream ended (the client closed its side)."""


END = End()


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


class PlanStream:
    """The request iterator's wire bytes, in order, END after the last."""

    def __init__(self, requests: Iterator[bytes], threaded: bool) -> None:
        self._requests = requests
        self._queue: Optional[queue.Queue] = None
        if threaded:
            self._queue = queue.Queue()
            threading.Thread(target=self._read, name="execute-plans", daemon=True).start()

    def _read(self) -> None:
        assert self._queue is not None
        try:
            for wire in self._requests:
                self._queue.put(wire)
            self._queue.put(END)
        except BaseException as error:  # the stream broke: the step loop raises it
            self._queue.put(_Raised(error))

    def next(self, done: Optional[Callable[[], bool]] = None) -> bytes | End | None:
        """The next plan's bytes, or END; with `done` (the step in flight's test), None as soon
        as it is done before a plan comes. The stream's own error is raised here."""
        if self._queue is None:
            return next(self._requests, END)
        item = None
        if done is None:
            item = self._queue.get()
        else:
            while item is None:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    if done():
                        return None
                    try:
                        item = self._queue.get(timeout=POLL_S)
                    except queue.Empty:
                        pass
        if isinstance(item, _Raised):
            raise item.error
        return item
