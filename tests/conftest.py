"""Shared fixtures: real servers on 127.0.0.1, started once per test session (once per worker
process where `make test` runs the files in several: Makefile, TEST_WORKERS).

The model service runs as its own process (as in production); the scheduler runs inside the
test's event loop so that tests can look at its block pool after the traffic ends.

PLANSERVE_TEST_FRONTEND_PROCESSES=N runs every scheduler the tests start with N frontend processes
serving its doors (`--frontend-processes`; the engine core stays in the test's loop): the e2e
suites' second layout, run apart from `make test` (docs/design-notes.md, "Frontend processes",
says which suites pass). PLANSERVE_TEST_SELECTOR_WATCH=FILE reports to FILE any socket transport
its event loop stopped reading (tests/selector_watch.py).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import dtypes  # first: a forced CPU class (tests/cpu_class.py) caps torch before its first matmul
import pytest
import pytest_asyncio

from scheduler_service.config import SchedulerConfig
from scheduler_service.server import SchedulerServer

ENGINE_PORT_LINE = "PLANSERVE_ENGINE_PORT="

if os.environ.get("PLANSERVE_TEST_SELECTOR_WATCH"):  # a diagnosis run (tests/selector_watch.py)
    import selector_watch

    selector_watch.install(os.environ["PLANSERVE_TEST_SELECTOR_WATCH"])


def pytest_report_header(config):
    """Says which CPU class the suite runs as and what it serves models in (tests/dtypes.py)."""
    return dtypes.header()


class EngineProcess:
    def __init__(self, *args: str, keep_log: bool = False):
        """`keep_log`: its log (JSON lines on stderr) is kept for the test to read once the
        process has ended (process.stderr), not shown."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "model_service", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE if keep_log else None, text=True,
            env=dict(os.environ, PLANSERVE_LOG_JSON="1"))
        for line in self.process.stdout:
            if line.startswith(ENGINE_PORT_LINE):
                self.address = f"127.0.0.1:{int(line[len(ENGINE_PORT_LINE):])}"
                break
        else:
            raise RuntimeError(f"model service exited with {self.process.wait()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


FRONTEND_PROCESSES = int(os.environ.get("PLANSERVE_TEST_FRONTEND_PROCESSES", "0"))

# Every async HTTP client a test makes (httpx's, and httpx2's under the OpenAI and Anthropic
# SDKs), kept until its test module ends and closed then. A client dropped unclosed was the
# suite's rare hang: the collector ran its connections' transports' __del__, which closes each
# socket but leaves the transport thinking it is open; the SDK's own __del__ then schedules the
# client's aclose(), which aborts those transports later, and an abort removes the loop's reader
# by fd number, by then another connection's (a server's accepted one, never read again).
# docs/design-notes.md, "Why it was opt-in for a while, and the hang's cause", has the watch's
# record of it.
_OPEN_HTTP_CLIENTS: list = []


def _keep_async_clients(module) -> None:
    opened = module.AsyncClient.__init__

    def init(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        _OPEN_HTTP_CLIENTS.append(self)

    module.AsyncClient.__init__ = init


for _name in ("httpx", "httpx2"):
    try:
        _keep_async_clients(__import__(_name))
    except ImportError:
        pass


@pytest_asyncio.fixture(scope="module", autouse=True)
async def _close_http_clients():
    yield
    clients, _OPEN_HTTP_CLIENTS[:] = list(_OPEN_HTTP_CLIENTS), []
    for client in clients:
        if not client.is_closed:
            await client.aclose()


async def start_scheduler(engine_address: str, **overrides) -> SchedulerServer:
    if FRONTEND_PROCESSES and not overrides.get("host", "").startswith("unix:"):
        overrides.setdefault("frontend_processes", FRONTEND_PROCESSES)
    config = SchedulerConfig(port=0, engine_address=engine_address, **overrides)
    server = SchedulerServer(config)
    await server.start()
    await server.connect_engine()
    return server


@pytest.fixture(scope="session")
def tiny_engine():
    # 64 blocks of 16 tokens: small enough that the concurrency test exercises preemption.
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    yield engine.address
    engine.stop()


@pytest_asyncio.fixture(scope="session")
async def tiny_server(tiny_engine):
    server = await start_scheduler(tiny_engine, max_num_batched_tokens=64, max_num_seqs=16,
                                   http_port=0)  # the OpenAI-compatible API on a free port
    yield server
    await server.stop(grace_s=1)


@pytest.fixture(scope="session")
def smollm2_engine():
    """SmolLM2 in float32: parity with transformers' float32 (and tensor parallelism's reference)."""
    engine = EngineProcess("--model", "smollm2", "--dtype", "float32")
    yield engine.address
    engine.stop()


@pytest.fixture(scope="session")
def smollm2_default_engine():
    """SmolLM2 in this CPU's default dtype (tests/dtypes.py): what users run, for the tests whose
    point is not parity (sampling, grammars, tools)."""
    engine = EngineProcess("--model", "smollm2", "--dtype", dtypes.DEFAULT)
    yield engine.address
    engine.stop()


@pytest_asyncio.fixture(scope="session")
async def smollm2_default_server(smollm2_default_engine):
    server = await start_scheduler(smollm2_default_engine, max_num_batched_tokens=64)
    yield server
    await server.stop(grace_s=1)


@pytest_asyncio.fixture(scope="session")
async def smollm2_server(smollm2_engine):
    # A small budget so that a long prompt is prefilled in several chunks.
    server = await start_scheduler(smollm2_engine, max_num_batched_tokens=64)
    yield server
    await server.stop(grace_s=1)


def pytest_collection_modifyitems(config, items):
    """A `slow` test (over ~30 s; any over a minute on a 2-core CPU is one) says why it needs the
    time: `@pytest.mark.slow(reason=...)`. Tests marked `gpu` need a CUDA device: skipped, saying
    so, without one."""
    import torch

    unexplained = [item.nodeid for item in items
                   if any("reason" not in mark.kwargs for mark in item.iter_markers("slow"))]
    if unexplained:
        raise pytest.UsageError(f"marked slow without a reason: {', '.join(unexplained)}")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def held_port():
    """A port another process (this test) listens on."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]
