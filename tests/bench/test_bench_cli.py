"""`planserve bench` as a user runs it (a subprocess) against a real scheduler over the null model."""
import asyncio
import json
import os
import sys

import pytest
import pytest_asyncio
from conftest import EngineProcess, start_scheduler

from model_service.models.null import null_continuation
from bench.load import workloads
from bench.load.loadgen import GrpcBackend, OpenAIBackend, run_workload
from bench.load.workloads import BenchRequest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def null_engine():
    engine = EngineProcess("--model", "null")
    yield engine.address
    engine.stop()


@pytest_asyncio.fixture(scope="module")
async def null_server(null_engine):
    server = await start_scheduler(null_engine, http_port=0)  # the OpenAI API for the peers' backend
    yield server
    await server.stop(grace_s=1)


async def _bench(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "protos"), ROOT]))
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tools", "bench", *args, cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await child.communicate()
    assert child.returncode == 0, err.decode()[-2000:]
    return out.decode()


async def test_bench_reports_throughput_and_latency_percentiles(null_server, tmp_path):
    report_path, plots = tmp_path / "report.json", tmp_path / "plots"
    stdout = await _bench("--workload", "peer", "--num-requests", "3", "--max-new-tokens", "12",
                          "--request-rate", "inf", "50", "--port", str(null_server.port),
                          "--out", str(report_path), "--plots", str(plots), "--no-progress")
    assert "output tok/s" in stdout
    report = json.loads(report_path.read_text())
    assert report["engine"] == "planserve" and report["workload"] == "peer"
    assert report["machine"]["cpus"] >= 1
    assert [run["request_rate"] for run in report["runs"]] == [None, 50.0]
    for run in report["runs"]:
        assert run["completed"] == 3 and run["failed"] == 0
        assert run["output_tokens"] == 3 * 12  # EOS ignored: every request runs to max_new_tokens
        assert run["prompt_tokens"] == 32 + 64 + 96
        assert run["output_tokens_per_s"] > 0 and run["requests_per_s"] > 0
        for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            stats = run[metric]
            assert set(stats) == {"mean", "p50", "p90", "p99"}
            assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"]
        assert run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]
    names = sorted(os.listdir(plots))
    assert names == ["planserve-peer-rate-50.0.png", "planserve-peer-rate-inf.png", "planserve-peer-sweep.png"]
    assert all((plots / n).read_bytes()[:4] == b"\x89PNG" for n in names)


async def test_a_missing_workload_names_the_choices(null_server):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "protos"), ROOT]))
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tools", "bench", "--workload", "nope", "--port", str(null_server.port),
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await child.communicate()
    assert child.returncode != 0
    assert "workload" in err.decode() and "peer" in err.decode()


def test_stored_workloads_match_their_description():
    peer = workloads.load("peer")
    assert [len(r.prompt_ids) for r in peer] == [32 * i for i in range(1, 17)]
    assert all(r.max_new_tokens == 128 and r.ignore_eos and r.arrival == 0.0 for r in peer)
    online = workloads.load("online")
    arrivals = [r.arrival for r in online]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    # Unit-rate Poisson: the mean gap is about 1 (200 draws: within 20% with overwhelming odds).
    assert 0.8 < arrivals[-1] / len(arrivals) < 1.2
    shared = workloads.load("shared_prefix")
    prefixes = {tuple(r.prompt_ids[:384]) for r in shared}
    assert len(prefixes) == 4
    long_mix = workloads.load("long_prompt")
    assert any(len(r.prompt_ids) >= 1024 for r in long_mix) and any(len(r.prompt_ids) <= 256 for r in long_mix)


def test_workloads_are_a_pure_function_of_the_seed():
    encode = lambda text: [ord(c) % 200 for c in text]  # noqa: E731  any tokenizer will do
    assert workloads.generate("online", encode, seed=3) == workloads.generate("online", encode, seed=3)
    assert workloads.generate("online", encode, seed=3) != workloads.generate("online", encode, seed=4)
    assert isinstance(workloads.generate("peer", encode)[0], BenchRequest)


async def test_both_backends_count_the_same_tokens_at_the_same_times(null_server):
    """The OpenAI SSE backend (used for vLLM and llama.cpp) against planserve's own HTTP API, and the
    gRPC backend, on the same requests: every streamed token is counted, none twice."""
    requests = [BenchRequest(f"r{i}", 0.0, [97 + i] * (5 + i), 9) for i in range(3)]
    async with OpenAIBackend(f"http://127.0.0.1:{null_server.http_port}", null_server.servicer.serving.facts.model_name) as http:
        over_http, _ = await run_workload(http, requests, progress=False)
    async with GrpcBackend(f"127.0.0.1:{null_server.port}", stream_interval=4) as grpc_backend:
        over_grpc, _ = await run_workload(grpc_backend, requests, progress=False)
    for request, a, b in zip(requests, over_http, over_grpc):
        assert not a.error and not b.error, (a.error, b.error)
        assert a.output_tokens == b.output_tokens == len(null_continuation(request.prompt_ids, 9))
        # Every token counted once. A reader that falls behind gets what waited as one chunk (the
        # null model steps faster than a loaded machine reads), so chunks may be merged: stream
        # interval 1's chunks sum to the tokens, interval 4's are whole fours but the last.
        assert sum(a.chunk_tokens) == 9 and min(a.chunk_tokens) >= 1, a.chunk_tokens
        assert sum(b.chunk_tokens) == 9 and all(n % 4 == 0 for n in b.chunk_tokens[:-1]), b.chunk_tokens
        assert len(a.chunk_times_s) == len(a.chunk_tokens)
        assert a.sent_s <= a.chunk_times_s[0] <= a.chunk_times_s[-1] <= a.end_s
