"""The scheduler's step timeout: a step whose result has not come back within
--engine-step-timeout-seconds is given up on, and the model service treated as down.

The model service ends itself when one of its steps hangs (model_service/step_watchdog.py), but
a service whose watchdog cannot run (a call that holds Python's lock forever), or another
implementation of the engine contract, can leave a step unanswered while its connection stays
up and answers pings. The engine loop would wait on that result for good; instead the watch
drops the Execute stream, so the loop's wait ends as for a broken stream and it recovers
(engine/loop.py): health NOT_SERVING, reconnect, recompute. The default sits above the model
service's own timeout, which ends a hung step first where it can.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional

import structlog

log = structlog.get_logger("planserve.loop")


class StepTimeout:
    """What the engine loop is waiting on, and the watch over it."""

    def __init__(self, timeout_s: float, give_up: Callable[[], None]) -> None:
        """`timeout_s` 0: never. `give_up`: ends the wait (drops the Execute stream)."""
        self.timeout_s = timeout_s
        self._give_up = give_up
        self._awaited: Optional[tuple[int, float]] = None  # (step id, perf_counter at its send)
        self.timed_out: Optional[str] = None  # why the last wait was given up, until taken

    def awaiting(self, step_id: int, sent: float) -> "StepTimeout":
        """The loop waits for the result of `step_id`, sent at `sent` (time.perf_counter()),
        until the `with` block it opens ends; a reason left from a wait given up on whose
        result came anyway is stale now."""
        self._awaited = (step_id, sent)
        self.timed_out = None
        return self

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info) -> None:
        self._awaited = None  # answered, or failed: nothing is awaited any more

    def take_reason(self, otherwise: str) -> str:
        """Why the stream ended: the timeout, if it gave up the wait, else `otherwise`."""
        why, self.timed_out = self.timed_out, None
        return why or otherwise

    async def watch(self) -> None:
        """Runs beside the loop (a task) while the timeout is on."""
        if self.timeout_s <= 0:
            return
        period_s = min(1.0, self.timeout_s / 4)
        while True:
            await asyncio.sleep(period_s)
            awaited = self._awaited
            if awaited is None:
                continue
            step_id, sent = awaited
            waited_s = time.perf_counter() - sent
            if waited_s > self.timeout_s:
                self._awaited = None
                self.timed_out = f"no result for step {step_id} in {waited_s:.1f} s"
                log.error(
                    "step_timed_out; the model service is treated as down",
                    waited_step_id=step_id,
                    waited_s=round(waited_s, 1),
                    engine_step_timeout_s=self.timeout_s,
                )
                self._give_up()
