"""Departures: requests leave by abort, deadline or a stop, and what they held is freed (their
blocks, their slot, their place in the queue); the model service hears of the slot with the
next plan.

A part of the Scheduler (core/scheduler.py), split off by lifecycle: it reads and writes the
scheduler's state as the scheduler's own methods do."""

from __future__ import annotations

import heapq
import time

from scheduler_service.core.part import SchedulerPart
from scheduler_service.core.request import FinishReason, Request, RequestStatus


class Departures(SchedulerPart):
    """Ending requests and releasing what they held (a part of Scheduler)."""

    def collect_departures(self) -> None:
        """Applies passed deadlines and aborts now, outside a step (while the model service is
        down nothing is running, so no slot is involved); their outputs wait in
        take_early_outputs()."""
        now = time.monotonic()
        if self._deadlines and self._deadlines[0][0] <= now:
            self._expire_deadlines(now)
        if self._abort_ids:
            self._collect_aborts()

    def end_all(self, reason: FinishReason) -> None:
        """Ends every request in flight for `reason` (outputs in take_early_outputs())."""
        for request in list(self.requests.values()):
            if not request.is_finished:
                self._end(request, reason, self._aborted_slots)

    def end_repeat_failures(self, max_failures: int) -> int:
        """The model service failed with these sequences running: each counts one failure
        more, and one that has run through more than `max_failures` ends with ERROR (outputs
        in take_early_outputs()) instead of being recomputed yet again. Returns how many
        ended."""
        num_ended = 0
        for request in list(self.running):
            request.num_engine_failures += 1
            if request.num_engine_failures > max_failures:
                self._end(request, FinishReason.ERROR, self._aborted_slots)
                num_ended += 1
        return num_ended

    def fail_adapter(self, name: str) -> None:
        """The model service refused to load adapter `name`: its waiting requests end with
        ERROR (outputs in take_early_outputs()); running ones, if any, go on."""
        for request in list(self.requests.values()):
            if request.lora_name == name and request.status is RequestStatus.WAITING:
                self._end(request, FinishReason.ERROR, self._aborted_slots)

    def _expire_deadlines(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._end(request, FinishReason.DEADLINE, self._finished_slots)

    def _collect_aborts(self) -> None:
        for request_id in self._abort_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._end(request, FinishReason.CANCELLED, self._aborted_slots)
        self._abort_ids.clear()

    def _end(self, request: Request, reason: FinishReason, lifecycle: list[int]) -> None:
        """Ends a request for a reason outside its tokens: out of the queue, blocks freed."""
        if request.status is RequestStatus.WAITING:
            self.policy.remove(request)
        else:
            self.running.remove(request)
            self.loras.on_stop(request.lora_name, self._next_step_id)
        self._early_outputs.append((request, self.outputs.finish(request, reason)))
        self._early_outputs.extend((request, output) for output in request.unforked_finals(reason))
        request.forked = True
        self._release(request, lifecycle)

    def _release(self, request: Request, lifecycle: list[int]) -> None:
        self._free_blocks(request)
        if request.slot is not None:
            self.slots.free(request.slot)
            if self._pending_forks.pop(request.slot, None) is None:
                lifecycle.append(request.slot)  # the model service knows the slot
            request.slot = None
        request.status = RequestStatus.FINISHED
        if request.guide is not None:
            self._num_constrained -= 1
        self.outputs.release(request)
        self.policy.on_finished(request)
        del self.requests[request.request_id]
        self.loras.on_leave(request.lora_name)
        members = self._groups.get(request.public_id)
        if members and members[0].forked and all(m.is_finished for m in members):
            del self._groups[request.public_id]
