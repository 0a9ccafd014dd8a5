"""The step watchdog (model_service/step_watchdog.py) with its process ending recorded instead
of done: a step past the timeout ends the process with EXIT_STEP_HUNG, one within it never does,
and a timeout of 0 watches nothing. tests/e2e/test_step_watchdog.py has a real process end."""

import threading
import time

from model_service.step_watchdog import EXIT_STEP_HUNG, StepWatchdog


def _watchdog(timeout_s: float) -> tuple[StepWatchdog, threading.Event, list[int]]:
    ended, statuses = threading.Event(), []

    def end_process(status: int) -> None:
        statuses.append(status)
        ended.set()

    return StepWatchdog(timeout_s, end_process), ended, statuses


def test_a_step_past_the_timeout_ends_the_process():
    watchdog, ended, statuses = _watchdog(0.2)
    with watchdog.timing(lambda: 41):
        assert ended.wait(timeout=10)
    assert statuses == [EXIT_STEP_HUNG]


def test_steps_within_the_timeout_never_end_it():
    watchdog, ended, statuses = _watchdog(1.0)
    deadline = time.monotonic() + 3.0  # many of the watchdog's looks, over many steps
    while time.monotonic() < deadline:
        with watchdog.timing(lambda: 1):
            time.sleep(0.05)
        time.sleep(0.6)  # between steps nothing is timed
    assert not ended.is_set() and statuses == []


def _watching() -> int:
    return sum(t.name == "step-watchdog" for t in threading.enumerate())


def test_a_timeout_of_zero_watches_nothing():
    before = _watching()
    watchdog, ended, _ = _watchdog(0)
    assert _watching() == before  # no thread started
    with watchdog.timing(lambda: 1):
        time.sleep(0.3)
    assert not ended.is_set()
