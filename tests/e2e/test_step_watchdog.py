"""The step watchdog on real processes: a model service whose step outlasts
--step-timeout-seconds ends itself (exit status 3, one log line naming the step), where it used
to hang with the request waiting on it for good; started again on the same port, it serves the
waiting request, whose client sees a pause, never an error."""

import asyncio
import json

from api import complete, greedy_ids_request, stub_for
from conftest import EngineProcess, start_scheduler
from model_service.step_watchdog import EXIT_STEP_HUNG
from planserve.v1 import generate_pb2


def _port_of(address: str) -> str:
    return address.rsplit(":", 1)[1]


async def test_a_hung_step_ends_the_model_service_and_the_restarted_one_serves_the_request():
    # Every step of the null model sleeps 1 s, past the 0.3 s timeout: the scheduler's first
    # step (its readiness probe) is the one that hangs.
    hung = EngineProcess("--model", "null", "--null-step-delay-ms", "1000",
                         "--step-timeout-seconds", "0.3", keep_log=True)
    server = await start_scheduler(hung.address)
    engine = None
    try:
        request = greedy_ids_request([1, 2, 3], 12)
        waiting = asyncio.ensure_future(complete(stub_for(server), request))
        status = await asyncio.to_thread(hung.process.wait, 30)
        assert status == EXIT_STEP_HUNG
        lines = [json.loads(line) for line in hung.process.stderr.read().splitlines()
                 if line.startswith("{")]
        [hang] = [line for line in lines if line["event"].startswith("step_hung")]
        assert hang["step_timeout_s"] == 0.3 and hang["running_s"] >= 0.3  # logged to 0.1 s
        assert hang["step_id"] is not None
        assert not waiting.done()

        engine = EngineProcess("--model", "null", "--port", _port_of(hung.address))
        served = await asyncio.wait_for(waiting, timeout=60)
        assert served.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert len(served.token_ids) == 12
    finally:
        await server.stop(grace_s=1)
        if engine is not None:
            engine.stop()
