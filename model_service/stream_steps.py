"""An Execute stream's steps, in the plans' order: each plan's bytes decoded (a plain plan by
step/decode_fast.py's C loops), its step id checked against the one before, run (with
launch-ahead: launched behind the step in flight, model_service/step/launch_ahead.py) and each
result encoded. The server (model_service/server.py) reads the plans, writes the answers and
maps what this raises to status codes."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

from model_service.batch import from_pb, result_to_pb
from model_service.runner import ModelRunner
from model_service.step import decode_fast
from model_service.step.launch_ahead import Launched
from model_service.step.plan import ComputedStep, PlanArrays, PlanError
from model_service.tp_worker import TensorParallelRunner
from planserve.v1 import engine_pb2


class StreamSteps:
    """One stream's place: the step launched and not yet answered (and when its plan came),
    the last step id run (each must be above it), the step id being run (errors name it)."""

    def __init__(
        self, runner: ModelRunner | TensorParallelRunner, launcher: Optional[ModelRunner]
    ) -> None:
        """`launcher`: the runner where steps launch ahead (None: each plan is run and
        answered before the next is read)."""
        self.runner, self.launcher = runner, launcher
        self.in_flight: tuple[Launched, int] | None = None
        self.last_step_id: int | None = None
        self.step_id: int | None = None

    def done_first(self) -> Optional[Callable[[], bool]]:
        """The test of the step in flight being done on the device (None: no step in flight)."""
        return self.in_flight[0].ready if self.in_flight is not None else None

    def answer(self, wire: bytes | None) -> list[bytes]:
        """The results a plan's arrival (or, `wire` None, the step in flight being done first)
        lets the stream send, in the plans' order."""
        self.step_id = None
        launcher, in_flight = self.launcher, self.in_flight
        received = time.perf_counter_ns()
        if wire is None:
            assert launcher is not None and in_flight is not None
            self.in_flight = None
            return [encode(launcher.finish(in_flight[0]), in_flight[1])]
        plan = self._checked(wire)
        if launcher is None:
            return [encode(self.runner.execute(plan), received)]
        done, launched = launcher.step_ahead(plan, in_flight[0] if in_flight else None)
        self.in_flight = None if launched is None else (launched, received)
        # `done`: the step in flight (step_ahead always finishes it), then this one unless it
        # was launched.
        came = [in_flight[1], received] if in_flight is not None else [received]
        return [encode(output, received_ns) for output, received_ns in zip(done, came)]

    def _checked(self, wire: bytes) -> PlanArrays:
        """The plan (PlanError for a step id not above the last one, or a bad plan)."""
        plan = decode_fast.parse_request(wire, self.runner.limits)
        request = None
        if plan is None:
            request = engine_pb2.ExecuteRequest.FromString(wire)
            step_id = self.step_id = request.plan.step_id
        else:
            step_id = self.step_id = plan.step_id
        if self.last_step_id is not None and step_id <= self.last_step_id:
            raise PlanError(
                "step_id", f"{step_id} is not after the previous step {self.last_step_id}"
            )
        self.last_step_id = step_id
        if request is not None:
            return from_pb(request, self.runner.limits)
        assert plan is not None
        return plan

    def abandon(self) -> None:
        """The stream ends with a step in flight: it is not answered, and its device work ends
        before its buffers are written again; its ids go nowhere (a new stream may have reset
        the slots already: LaunchAhead.wait_for)."""
        ahead = self.launcher.ahead if self.launcher is not None else None
        if ahead is not None and self.in_flight is not None:
            with contextlib.suppress(Exception):  # logged where it first failed
                ahead.wait_for(self.in_flight[0])
        self.in_flight = None

    @property
    def launched(self) -> int:
        """Steps launched behind another, over the runner's life (the stream's closing line)."""
        ahead = self.launcher.ahead if self.launcher is not None else None
        return ahead.launched if ahead is not None else 0


def encode(output: ComputedStep, received_ns: int) -> bytes:
    """A step's result (without logprobs by decode_fast's C loop, else by batch.result_to_pb);
    total_ns counts from its plan's receipt."""
    total_ns = time.perf_counter_ns() - received_ns
    wire = decode_fast.encode_result(output, total_ns)
    if wire is None:
        return result_to_pb(output, total_ns=total_ns).SerializeToString()
    return wire
