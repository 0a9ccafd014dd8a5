"""How many frontend processes `planserve serve` starts when --frontend-processes is not given
(scheduler_service/frontends/count.py): none for a model service on the CPU, one per 4 host cores
(at most 4) on a GPU, none over a unix socket (its doors cannot share a TCP port)."""
from __future__ import annotations

import os

import pytest

from conftest import EngineProcess
from scheduler_service.config import SchedulerConfig
from scheduler_service.frontends import count


@pytest.mark.parametrize(
    "device, cores, host, expected",
    [
        ("cuda", 16, "127.0.0.1", 4),
        ("cuda:1", 8, "0.0.0.0", 2),
        ("cuda", 7, "127.0.0.1", 1),
        ("cuda", 3, "127.0.0.1", 0),  # too few cores: the doors stay in the scheduler process
        ("cuda", 192, "127.0.0.1", count.GPU_FRONTENDS),
        ("cuda", 16, "unix:/tmp/planserve.sock", 0),
        ("cpu", 64, "127.0.0.1", 0),
    ],
)
def test_the_device_and_the_host_cores_choose(device, cores, host, expected):
    assert count.for_device(device, cores, host) == expected


def test_the_host_cores_are_this_process_affinity():
    assert 1 <= count.host_cores() <= (os.cpu_count() or 1)


@pytest.fixture(scope="module")
def null_engine():
    engine = EngineProcess("--model", "null")
    yield engine.address
    engine.stop()


async def test_a_model_service_on_the_cpu_keeps_the_doors_in_the_scheduler(null_engine):
    config = SchedulerConfig(engine_address=null_engine)
    assert config.frontend_processes is None  # not given
    assert await count.for_engine(config, cores=64) == 0
