"""The model service's OpenMP set-up (model_service/threads.py): defaults apply where the
environment sets nothing, the user's settings win, "" restores libgomp's own default, and a real
model service process reports what it runs with in Describe."""
from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from model_service import threads
from planserve.v1 import engine_pb2, engine_pb2_grpc

PORT_LINE = "PLANSERVE_ENGINE_PORT="


def test_defaults_fill_only_what_is_unset():
    environ = {"OMP_NUM_THREADS": "1"}
    threads.configure(environ)
    assert environ["GOMP_SPINCOUNT"] == threads.DEFAULTS["GOMP_SPINCOUNT"]
    assert environ["OMP_NUM_THREADS"] == "1" and environ["OPENBLAS_NUM_THREADS"] == "1"
    environ = {"GOMP_SPINCOUNT": "5", "OMP_WAIT_POLICY": "PASSIVE"}
    threads.configure(environ)
    assert environ["GOMP_SPINCOUNT"] == "5" and environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_empty_means_libgomps_own_default():
    environ = {"GOMP_SPINCOUNT": "", "OMP_WAIT_POLICY": ""}
    threads.configure(environ)
    assert "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ


@pytest.mark.parametrize("env, expected", [({}, threads.DEFAULTS["GOMP_SPINCOUNT"]), ({"GOMP_SPINCOUNT": "777"}, "777")])
async def test_a_model_service_process_reports_its_settings(env, expected):
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    process = subprocess.Popen([sys.executable, "-m", "model_service", "--port", "0", "--model", "tiny", "--dtype", "float32",
                                "--num-kv-blocks", "16"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**base, **env})
    try:
        address = next(line[len(PORT_LINE):].strip() for line in process.stdout if line.startswith(PORT_LINE))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{address}") as channel:
            facts = await engine_pb2_grpc.EngineServiceStub(channel).Describe(engine_pb2.DescribeRequest(), timeout=30)
        assert facts.compute["gomp_spincount"] == expected
        assert facts.compute["omp_wait_policy"] == "(libgomp default)"
        assert int(facts.compute["torch_threads"]) >= 1
    finally:
        process.terminate()
        process.wait(timeout=10)
