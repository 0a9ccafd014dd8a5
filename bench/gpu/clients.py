"""The GPU benchmark's clients: the workload sent from one or several processes, with the CPU
they spent. At a GPU's token rates one Python gRPC client process could be what is measured;
several processes, each sending a share of the requests, keep it from being so, and the
clients' CPU% says how close they came.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import threading
import time
from typing import Callable


async def _send(
    address: str, requests, timeout_s: float, start_at: float, sampling: dict, started=None
):
    """Connects, waits for start_at (time.time()), sends (`sampling`: GrpcBackend's temperature
    and top_p); returns the results, the run's wall seconds and this process's CPU seconds over
    the run (not its imports or connecting)."""
    from bench.load.loadgen import GrpcBackend, run_workload

    async with GrpcBackend(address, **sampling) as backend:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        if started is not None:
            started()
        cpu = time.process_time()
        results, elapsed = await run_workload(
            backend, requests, progress=False, request_timeout_s=timeout_s
        )
        return results, elapsed, time.process_time() - cpu


def _client_process(address: str, requests, timeout_s: float, start_at: float, sampling: dict):
    return asyncio.run(_send(address, requests, timeout_s, start_at, sampling))


async def send_workload(
    address: str,
    requests,
    processes: int,
    timeout_s: float,
    started: Callable[[], None],
    sampling: dict | None = None,
):
    """Every request sent at t=0 from `processes` client processes (1: this process), request i
    from process i % processes; `started` is called as the first requests leave (the meters'
    window is the run's, not the clients' start-up), from a timer thread where there are several
    processes. Returns (results in the workload's order, the run's wall seconds, the clients'
    CPU% of one core)."""
    if processes <= 1:
        results, elapsed, cpu_s = await _send(
            address, requests, timeout_s, 0.0, sampling or {}, started
        )
        return results, elapsed, round(100.0 * cpu_s / elapsed, 1)
    shares = [requests[i::processes] for i in range(processes)]
    start_at = time.time() + 3.0  # every process connected before the first request leaves
    loop = asyncio.get_running_loop()
    # A timer thread, not the loop's call_later: on a loaded machine the loop ran it after a short
    # run had ended (the pool's start-up holding the loop, most likely), and the meters missed it.
    timer = threading.Timer(max(0.0, start_at - time.time()), started)
    timer.daemon = True
    timer.start()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        done = await asyncio.gather(
            *(
                loop.run_in_executor(
                    pool, _client_process, address, share, timeout_s, start_at, sampling or {}
                )
                for share in shares
            )
        )
    merged: list = [None] * len(requests)
    for index, (share_results, _, _) in enumerate(done):
        merged[index::processes] = share_results
    elapsed = max(share_elapsed for _, share_elapsed, _ in done)
    cpu_s = sum(share_cpu for _, _, share_cpu in done)
    return merged, elapsed, round(100.0 * cpu_s / elapsed, 1)
