"""The thread an Execute stream's steps run on: one per stream, fed through a queue.

Each step used to go through `asyncio.to_thread`, the default executor: a work item, a
concurrent future chained to an asyncio future, a context copy and the executor's own locks
for every step. Here the stream owns one thread; `run` queues the call and the thread hands
the result back with one `call_soon_threadsafe`. Steps run one at a time and in the order
they were queued, which is what the stream needs (a step's plan is a diff on the previous
one's slot state).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Callable

_STOP = None


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # the stream ended while the step ran
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class StepThread:
    """Runs calls on one thread, in order; `run` is awaited on the event loop."""

    def __init__(self, name: str = "execute-steps") -> None:
        self._loop = asyncio.get_running_loop()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        future = self._loop.create_future()
        self._calls.put((future, fn, args))
        return await future

    def close(self) -> None:
        """The thread ends once the calls queued before this one have run."""
        self._calls.put(_STOP)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not _STOP:
            future, fn, args = call
            try:
                result, error = fn(*args), None
            except BaseException as caught:  # handed to the awaiting coroutine
                result, error = None, caught
            try:
                self._loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop closed (process exit)
                return
