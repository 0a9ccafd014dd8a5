"""The conformance kit: our model service passes the engine suite (through the CLI, as a user
runs it), our scheduler passes the API suite, and engines broken on purpose fail with a report
that names the check and says why."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from api import assert_no_leaked_blocks, wait_until_idle
from tools.conformance import run_suite
from tools.conformance.report import passed

ENGINE_PORT_LINE = "PLANSERVE_ENGINE_PORT="
_EMPTY = np.zeros(0, dtype=np.int64)


@pytest.fixture(scope="module")
def own_engine():
    """A tiny model service of our own: the session's tiny_engine is held by the scheduler's
    Execute stream, and the engine suite needs the engine to itself. With swap space, so that
    every check applies."""
    process = subprocess.Popen(
        [sys.executable, "-m", "model_service", "--model", "tiny", "--dtype", "float32",
         "--num-kv-blocks", "128", "--max-num-slots", "16", "--swap-space", "16MiB", "--port", "0"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PLANSERVE_LOG_JSON="1"))
    for line in process.stdout:
        if line.startswith(ENGINE_PORT_LINE):
            break
    else:
        raise RuntimeError(f"model service exited with {process.wait()}")
    yield f"127.0.0.1:{int(line[len(ENGINE_PORT_LINE):])}"
    process.terminate()
    process.wait(timeout=10)


def report_lines(report: str) -> dict[str, str]:
    """{check name: status} from the report's PASS/FAIL/SKIP lines."""
    return {m.group(2): m.group(1) for m in re.finditer(r"^(PASS|FAIL|SKIP)  (\S+)", report, re.M)}


def test_our_model_service_passes_the_engine_suite_via_the_cli(own_engine):
    result = subprocess.run(
        [sys.executable, "-m", "tools", "conformance", "--engine", own_engine],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    statuses = report_lines(result.stdout)
    # Every part of the contract was exercised, and nothing was skipped on our engine.
    for name in ("describe", "health", "prefill", "decode", "chunked_prefill", "batch",
                 "prefix_cache", "block_copy", "swap", "finish", "abort", "preempt", "stream_end",
                 "recovers"):
        assert statuses.get(name) == "PASS", f"{name}: {statuses.get(name)}\n{result.stdout}"
    bad_plans = [n for n in statuses if n.startswith("bad_plan.")]
    assert len(bad_plans) >= 10 and all(statuses[n] == "PASS" for n in bad_plans)
    assert re.search(r"^\d+ passed, 0 failed, 0 skipped", result.stdout, re.M), result.stdout


async def test_our_scheduler_passes_the_api_suite(tiny_server):
    report, outcomes = await run_suite("api", f"127.0.0.1:{tiny_server.port}")
    assert passed(outcomes), report
    statuses = report_lines(report)
    for name in ("health", "model_info", "server_status", "generate", "stop_token_ids", "stop_string",
                 "max_new_tokens", "parallel_samples", "abort", "cancel", "session",
                 "bad_input.max_new_tokens_zero"):
        assert statuses.get(name) == "PASS", f"{name}: {statuses.get(name)}\n{report}"
    # The suite's aborts, cancels and rejections leave nothing behind.
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


def test_a_server_that_is_not_there_fails_once_with_the_reason():
    result = subprocess.run(
        [sys.executable, "-m", "tools", "conformance", "--api", "127.0.0.1:1",
         "--connect-timeout", "1"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert report_lines(result.stdout) == {"connect": "FAIL"}
    assert "no gRPC server answered at 127.0.0.1:1 within 1 s" in result.stdout


def test_an_unknown_check_name_is_refused():
    result = subprocess.run(
        [sys.executable, "-m", "tools", "conformance", "--engine", "127.0.0.1:1",
         "--check", "no_such_check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no check no_such_check" in result.stdout


# -- engines broken on purpose: our runner with one rule of the contract bent -----------------

def _broken_runners():
    from model_service.step.plan import ComputedStep
    from model_service.runner import ModelRunner

    class DropsFinishedLate(ModelRunner):
        """Drops finished slots after the step instead of before its new sequences."""

        def execute(self, plan):
            output = super().execute(dataclasses.replace(plan, finished_slots=_EMPTY))
            if plan.finished_slots.size:
                super().execute(dataclasses.replace(
                    plan, new_sequences=[], slots=_EMPTY, num_scheduled_tokens=_EMPTY,
                    num_new_blocks=_EMPTY, new_block_ids=_EMPTY, preempted_slots=_EMPTY,
                    aborted_slots=_EMPTY, copy_src=_EMPTY, copy_dst=_EMPTY))
            return output

    class IgnoresAborts(ModelRunner):
        """Never drops an aborted slot."""

        def execute(self, plan):
            return super().execute(dataclasses.replace(plan, aborted_slots=_EMPTY))

    class IgnoresBlockCopies(ModelRunner):
        """Never copies blocks (copy-on-write forks read whatever the block held)."""

        def execute(self, plan):
            return super().execute(dataclasses.replace(plan, copy_src=_EMPTY, copy_dst=_EMPTY))

    class IgnoresSwapIn(ModelRunner):
        """Swaps out but never back in: a resumed sequence reads whatever its new blocks held."""

        def execute(self, plan):
            return super().execute(dataclasses.replace(plan, swap_in_src=_EMPTY, swap_in_dst=_EMPTY))

    class ResultsInSlotOrder(ModelRunner):
        """Returns each step's results sorted by slot instead of in the plan's order."""

        def execute(self, plan):
            output = super().execute(plan)
            tokens = np.split(output.sampled_token_ids, np.cumsum(output.num_sampled_tokens)[:-1])
            order = np.argsort(plan.slots, kind="stable")
            return ComputedStep(output.step_id, output.num_sampled_tokens[order],
                              np.concatenate([tokens[i] for i in order] or [_EMPTY]).astype(np.int64),
                              output.forward_ns, output.sample_ns)

    return {"drops_finished_late": DropsFinishedLate, "ignores_aborts": IgnoresAborts,
            "ignores_block_copies": IgnoresBlockCopies, "ignores_swap_in": IgnoresSwapIn,
            "results_in_slot_order": ResultsInSlotOrder}


@pytest.mark.parametrize("broken,failing,reason", [
    ("drops_finished_late", {"finish"}, "INVALID_ARGUMENT"),
    ("ignores_aborts", {"abort"}, "INVALID_ARGUMENT"),
    ("ignores_block_copies", {"block_copy"}, "differ from the reference"),
    ("ignores_swap_in", {"swap"}, "differ from the reference"),
    ("results_in_slot_order", {"batch"}, "differ from the reference"),
])
async def test_a_broken_engine_fails_the_check_it_breaks_with_a_readable_report(broken, failing, reason):
    from model_service.config import ModelServiceConfig
    from model_service.loading.loader import load_model
    from model_service.server import serve
    from model_service.start import build_runner

    config = ModelServiceConfig(model="tiny", dtype="float32", host="127.0.0.1", port=0,
                                num_kv_blocks=128, max_num_slots=16, swap_space_bytes=16 << 20)
    runner = build_runner(load_model(config), config, _broken_runners()[broken])
    server = await serve(config, runner=runner)
    try:
        report, outcomes = await run_suite("engine", f"127.0.0.1:{server.bound_port}")
    finally:
        await server.stop(0)
    assert not passed(outcomes), report
    failed = {o.name for o in outcomes if o.status == "FAIL"}
    assert failed == failing, report
    # The report names the failed check on its own line, gives the reason below it, and lists
    # the failures at the end.
    lines = report.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"FAIL  {min(failing)} "))
    assert "->" in lines[at + 1] and reason in lines[at + 1], report
    assert lines[-1] == "failed: " + ", ".join(sorted(failing))
