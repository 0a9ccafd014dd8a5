"""The Execute stream's step thread: calls run in order on one thread that is not the event
loop's, errors reach the awaiting coroutine, a cancelled wait leaves the thread serving, and
close() ends the thread after what was queued before it."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from model_service.step.plan import PlanError
from model_service.step_thread import StepThread


async def test_calls_run_in_order_on_one_thread_off_the_loop():
    steps = StepThread()
    ran = []

    def step(i):
        time.sleep(0.001 * (5 - i))  # later calls are quicker: order must still hold
        ran.append(i)
        return i, threading.get_ident()

    results = await asyncio.gather(*(steps.run(step, i) for i in range(5)))
    steps.close()
    assert [i for i, _ in results] == ran == [0, 1, 2, 3, 4]
    threads = {ident for _, ident in results}
    assert len(threads) == 1 and threading.get_ident() not in threads


async def test_an_error_reaches_the_caller_and_the_thread_goes_on():
    steps = StepThread()

    def bad():
        raise PlanError("slots", "slot 9 is not registered")

    with pytest.raises(PlanError) as error:
        await steps.run(bad)
    assert error.value.field == "slots"
    assert await steps.run(lambda: "next") == "next"
    steps.close()


async def test_a_cancelled_wait_leaves_the_thread_serving_and_close_ends_it():
    steps = StepThread(name="test-steps")
    started = threading.Event()

    def slow():
        started.set()
        time.sleep(0.2)
        return "late"

    waiting = asyncio.ensure_future(steps.run(slow))
    await asyncio.to_thread(started.wait, 5)
    waiting.cancel()  # the stream ended while its step ran
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert await steps.run(lambda: 7) == 7  # queued behind the slow step, which still finished
    thread = next(t for t in threading.enumerate() if t.name == "test-steps")
    steps.close()
    await asyncio.to_thread(thread.join, 5)
    assert not thread.is_alive()
