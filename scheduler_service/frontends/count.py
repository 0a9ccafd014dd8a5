"""How many frontend processes serve the doors when --frontend-processes is not given.

On a CPU a step is long and the cores are the model's: the doors stay in the scheduler process.
On a GPU steps come fast enough that streaming every token of every stream on the scheduler
loop's own thread holds the GPU back, so `planserve serve` moves the doors out to a few
processes when the host has the cores for them (docs/benchmarks.md, "Served after the host
path", has the figures).
"""

from __future__ import annotations

import os
from typing import Optional

from scheduler_service.api import security
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine.client import EngineClient

GPU_FRONTENDS = 4
"""The most frontend processes chosen for a GPU: the figure measured against none."""
CORES_PER_FRONTEND = 4
"""A frontend per this many cores: the rest are the scheduler's, the model service's and the
clients' (a host of fewer cores keeps the doors in the scheduler process)."""


def host_cores() -> int:
    """The cores this process may run on (its affinity, as a container's cpuset limits it)."""
    return len(os.sched_getaffinity(0))


def for_device(device: str, cores: int, host: str = "127.0.0.1") -> int:
    """Frontend processes for a model service on `device` ("cuda", "cuda:1", "cpu", ...)."""
    if not device.startswith("cuda") or host.startswith("unix:"):  # unix: no shared TCP port
        return 0
    return min(GPU_FRONTENDS, cores // CORES_PER_FRONTEND)


async def for_engine(config: SchedulerConfig, cores: Optional[int] = None) -> int:
    """for_device of the model service at config.engine_address, from its Describe."""
    client = EngineClient(
        config.engine_address,
        security.engine_channel_credentials(config),
        security.engine_channel_options(config),
    )
    try:
        facts = await client.describe(config.engine_connect_timeout_s)
    finally:
        await client.close()
    return for_device(facts.device, host_cores() if cores is None else cores, config.host)
