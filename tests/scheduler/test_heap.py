"""scheduler_service/heap.py: once serving, the start-up heap is frozen out of the collector's
generations and the young generation's threshold is raised. Run in a child interpreter: freezing
pytest's own heap would keep whatever it holds in cycles for the rest of the session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent(
    """
    import gc, json, weakref
    from scheduler_service import heap

    class Thing:
        pass

    kept = Thing()                       # start-up state the process keeps
    cycle = Thing(); cycle.me = cycle    # start-up garbage, reachable only from itself
    cycle_gone = weakref.ref(cycle)
    del cycle
    threshold_before = gc.get_threshold()
    frozen = heap.freeze_startup_heap()
    later = Thing()                      # made while serving
    print(json.dumps({
        "frozen": frozen,
        "freeze_count": gc.get_freeze_count(),
        "kept_in_a_generation": any(o is kept for o in gc.get_objects()),
        "start_up_garbage_collected": cycle_gone() is None,
        "later_in_the_young_generation": any(o is later for o in gc.get_objects(generation=0)),
        "threshold_before": threshold_before,
        "threshold": gc.get_threshold(),
    }))
    """
)


def _run_child() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "protos")]))
    result = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_start_up_heap_is_frozen_and_what_serving_makes_is_collected_as_before():
    from scheduler_service.heap import YOUNG_THRESHOLD

    seen = _run_child()
    # Frozen: out of every generation, so no collection walks it again.
    assert seen["frozen"] == seen["freeze_count"] > 0
    assert not seen["kept_in_a_generation"]
    # Start-up garbage in cycles was collected first, not frozen for ever.
    assert seen["start_up_garbage_collected"]
    # What serving makes is tracked as before, in the young generation.
    assert seen["later_in_the_young_generation"]
    # The young threshold is raised; the older generations' stay.
    assert seen["threshold"][0] == YOUNG_THRESHOLD > seen["threshold_before"][0]
    assert seen["threshold"][1:] == seen["threshold_before"][1:]
