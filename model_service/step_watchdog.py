"""The step watchdog: a step that runs past --step-timeout-seconds ends the process.

A step that never returns (a device that hangs, a collective whose peer is gone, a deadlock)
leaves the process up, answering health checks and keepalive pings, with every sequence it holds
waiting: no one restarts it and the scheduler waits on its result. Nothing inside the process can
undo a hung device call, so the watchdog ends the process (EXIT_STEP_HUNG) from a thread of its
own; its supervisor (`planserve serve`, Kubernetes, systemd) starts it again, and the scheduler
reconnects and recomputes what was in flight (docs/operations.md), as after a crash.

What is timed is how long the stream's thread is inside one plan's step (StreamSteps.answer):
its forward and sampling and, with launch-ahead, the wait for the step in flight before it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator, Optional

import structlog

log = structlog.get_logger(__name__)

# The process's exit status when the watchdog ends it (a supervisor's logs show why).
EXIT_STEP_HUNG = 3


class StepWatchdog:
    def __init__(self, timeout_s: float, end_process: Callable[[int], None] = os._exit) -> None:
        """`timeout_s` 0: never (no thread). `end_process`: how the process ends, os._exit by
        default: sys.exit would wait for the hung thread."""
        self.timeout_s = timeout_s
        self._end_process = end_process
        self._started: Optional[float] = None  # time.monotonic() at the running step's start
        self._step_id: Callable[[], Optional[int]] = lambda: None
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def timing(self, step_id: Callable[[], Optional[int]]) -> Iterator[None]:
        """Times the step run inside; `step_id` names it in the log if it hangs."""
        self._step_id = step_id
        self._started = time.monotonic()
        try:
            yield
        finally:
            self._started = None

    def _watch(self) -> None:
        period_s = min(1.0, self.timeout_s / 4)
        while True:
            time.sleep(period_s)
            now = time.monotonic()  # before the read: a step running at the read ran this long
            started = self._started
            if started is None:
                continue
            running_s = now - started
            if running_s > self.timeout_s:
                log.error(
                    "step_hung; ending the process so that it is started again",
                    step_id=self._step_id(),
                    running_s=round(running_s, 1),
                    step_timeout_s=self.timeout_s,
                    exit_status=EXIT_STEP_HUNG,
                )
                sys.stdout.flush()
                sys.stderr.flush()
                self._end_process(EXIT_STEP_HUNG)
                return
