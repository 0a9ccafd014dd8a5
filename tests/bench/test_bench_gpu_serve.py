"""bench/bench_gpu_serve.py's CPU dry run as a user runs it (a subprocess): the tiny dummy shape
served by a real `planserve serve`, its ceiling and transformers, into the JSON the GPU run
writes; and the stored "big" workload it serves on a GPU."""
import json
import os
import subprocess
import sys

import pytest

from bench.gpu.monitor import percentiles, service_trees
from bench.load import workloads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_big_is_the_issues_workload_and_a_pure_function_of_the_seed():
    big = workloads.load("big")
    assert len(big) == 512 and all(r.arrival == 0.0 and r.ignore_eos for r in big)
    assert {r.max_new_tokens for r in big} == {256}
    lengths = [len(r.prompt_ids) for r in big]
    assert min(lengths) >= 32 and max(lengths) <= 512
    assert max(i for r in big for i in r.prompt_ids) < workloads.SMOLLM2_VOCAB
    assert workloads.generate("big", None, seed=0) == big  # the stored file is the seed's


def test_percentiles_and_the_process_trees():
    assert percentiles([]) is None
    assert percentiles([float(v) for v in range(1, 101)]) == {
        "mean": 50.5, "p10": 11.0, "p50": 51.0, "p90": 91.0}
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    child = subprocess.Popen(sleep)
    # Services' command lines (the arguments after -c's code are only its argv).
    model = subprocess.Popen([*sleep, "-m", "model_service"])
    frontend = subprocess.Popen([*sleep, "-m", "scheduler_service.frontends"])
    try:
        # This process may hold other services (a session's fixtures): only these three are asked.
        trees = service_trees(os.getpid())
        assert [name for name, pids in trees.items() if child.pid in pids] == ["scheduler"]
        assert [name for name, pids in trees.items() if model.pid in pids] == ["model_service"]
        assert [name for name, pids in trees.items() if frontend.pid in pids] == ["frontends"]
    finally:
        for process in (child, model, frontend):
            process.kill()
            process.wait()


@pytest.mark.slow(
    reason="runs the whole benchmark script on the CPU: a scheduler and a model service started "
    "per phase, 16 requests, transformers' static batches (~60 s on 2 loaded cores)"
)
def test_the_dry_run_writes_every_field_and_the_counts_add_up(tmp_path):
    out = tmp_path / "gpu_serve.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "protos")]))
    done = subprocess.run(
        [sys.executable, "bench/bench_gpu_serve.py", "--dry-run", "--out", str(out),
         "--log-dir", str(tmp_path / "logs")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tiny: transformers" in done.stderr  # the progress lines
    report = json.loads(out.read_text())
    machine = report["machine"]
    assert report["finished"] and machine["torch"] and machine["device"] == "cpu"
    assert report["workload"] == {"name": "dry", "requests": 16, "prompt_tokens": 648,
                                  "output_tokens": 128}
    assert report["sampling"] == {"temperature": 0.0, "top_p": 1.0}  # greedy unless asked
    tiny = report["shapes"]["tiny"]
    serve, ceiling, hf = tiny["serve"], tiny["ceiling"], tiny["transformers"]
    assert serve["completed"] == 16 and serve["failed"] == 0
    assert serve["output_tokens"] == serve["expected_output_tokens"] == 16 * 8
    assert serve["output_tokens_per_s"] > 0 and serve["itl_ms"]["p50"] > 0
    assert serve["ttft_ms"]["p99"] >= serve["ttft_ms"]["p50"] > 0
    assert serve["describe"]["compute"]["weights"].startswith("dummy")
    assert serve["describe"]["model_name"] == "dummy-tiny"
    assert serve["gpu"]["utilization_pct"] is None and "cpu" in serve["gpu"]["reason"]
    assert set(serve["cpu_percent"]) == {"scheduler", "frontends", "model_service", "clients"}
    assert serve["cpu_percent"]["model_service"] > 0 and serve["cpu_percent"]["clients"] > 0
    engine = serve["engine"]  # from the scheduler's /metrics around the run
    assert engine["steps"] >= 8  # 8 new tokens a request
    # Not forward <= wall: the steps counted between the two scrapes of /metrics may run outside
    # the clients' window (the wall time's), so on a loaded machine the forward a step can exceed
    # the window's wall time a step. The report's arithmetic holds whatever the timing.
    assert engine["forward_ms_per_step"] > 0 and engine["wall_ms_per_step"] > 0
    assert engine["not_forward_ms_per_step"] == pytest.approx(
        engine["wall_ms_per_step"] - engine["forward_ms_per_step"], abs=2e-3)
    # The CPU's steps are not padded: none launched ahead (the model service's closing line).
    assert serve["describe"]["compute"]["launch_ahead"] == "off (steps not padded)"
    assert engine["launched_ahead"] == 0
    assert ceiling["error"] is None and ceiling["batch"] >= 1 and ceiling["eager_ms"] > 0
    assert ceiling["graph_ms"] is None  # no graphs on the CPU
    assert ceiling["floor_ms"] == max(ceiling["memory_floor_ms"], ceiling["flop_floor_ms"])
    # The parts in turn take at least as long as the slower of the whole step's two bounds.
    assert ceiling["serial_floor_ms"] >= ceiling["floor_ms"] - 1e-3
    assert hf["error"] is None and hf["complete"] and hf["completed"] == 16
    assert hf["output_tokens"] == 16 * 8
