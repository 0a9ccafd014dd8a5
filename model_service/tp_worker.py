"""The ranks of a tensor-parallel model service, and how rank 0 keeps them in step.

Rank 0 is the model service process: it speaks the EngineService contract. Before it runs a plan
(or drops every slot when a stream ends) it broadcasts the call to ranks 1..N-1 over a gloo control
group; every rank then runs the same ModelRunner code on the same plan, so slot state, block tables
and each rank's own paged KV cache (its KV heads only) stay identical in shape and in step, and the
two all_reduces per layer meet. Logits are replicated, so every rank samples the same tokens; only
rank 0's result goes back to the scheduler.

Two ways to start the ranks:
- spawned (default): rank 0 starts ranks 1..N-1 with torch.multiprocessing (spawn), rendezvous on
  a free 127.0.0.1 TCP port; a rank that dies takes the service down (a half model cannot serve);
- torchrun: when RANK and WORLD_SIZE are set, every rank is a `python -m model_service` started by
  torchrun (env:// rendezvous); rank 0 serves, the others run `worker_loop`.
A plan that rank 0 rejects raises the same PlanError on every rank before any state changes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import os
import signal
import socket
import threading
from typing import Any, Optional

import structlog
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model_service.config import ModelServiceConfig
from model_service.described import DescribedFacts
from model_service.models.parallel import RankShare
from model_service.runner import ModelRunner
from model_service.start import start_runner
from model_service.step.plan import ComputedStep, PlanArrays, PlanError

log = structlog.get_logger(__name__)

EXECUTE, RESET, STOP = "execute", "reset", "stop"

# Ranks other than 0 wait on the control broadcast while the service is idle, which may last
# days; gloo applies the group's timeout to every wait, so the control group's is long.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
# A collective inside a step that takes longer than this means a rank is gone.
COMPUTE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    compute: Optional[dist.ProcessGroup]  # of the all_reduces (nccl on CUDA, gloo on CPU)
    control: dist.ProcessGroup  # gloo group on which rank 0 broadcasts each step's plan


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def threads_per_rank(world_size: int) -> int:
    """CPU threads for each rank: the cores this process may use, shared evenly, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_group(rank: int, world_size: int, device: str, init_method: str) -> TPGroup:
    """Join the default process group (the compute backend) and make the gloo control group."""
    backend = backend_for(device)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=COMPUTE_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank=rank, world_size=world_size, compute=dist.group.WORLD, control=control)


def torchrun_rank() -> Optional[tuple[int, int]]:
    """(rank, world_size) when started by torchrun (or any env:// launcher), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def rank_config(config: ModelServiceConfig, rank: int, world_size: int) -> ModelServiceConfig:
    """This rank's config: on CUDA one GPU per rank, counted from the one --device names
    (`cuda:2` with 4 ranks: cuda:2..cuda:5; `cuda` or `auto`: from cuda:0)."""
    device = config.resolved_device()
    if device.startswith("cuda"):
        first = int(device.partition(":")[2] or 0)
        device = f"cuda:{first + int(os.environ.get('LOCAL_RANK', rank))}"
    return dataclasses.replace(config, device=device, tensor_parallel_size=world_size)


def setup_rank(
    config: ModelServiceConfig, rank: int, world_size: int, init_method: str
) -> tuple[ModelRunner, TPGroup]:
    """Join the group, load this rank's share of the model and its runner (KV cache included)."""
    config = rank_config(config, rank, world_size)
    if config.device.startswith("cuda"):
        torch.cuda.set_device(config.device)
    else:
        # N ranks on C cores: C // N threads each, or they fight over the cores.
        torch.set_num_threads(threads_per_rank(world_size))
    group = init_group(rank, world_size, config.device, init_method)
    # int8 quantizes the tied embedding / lm_head as one whole matrix: they stay replicated then.
    vocab_parallel = config.quantization == "none"
    runner = start_runner(config, RankShare(rank, world_size, group.compute, vocab_parallel))
    log.info(
        "tensor_parallel_rank_ready",
        rank=rank,
        world_size=world_size,
        device=config.device,
        threads=torch.get_num_threads(),
        num_kv_heads=runner.loaded.num_kv_heads_per_rank,
    )
    return runner, group


def worker_loop(runner: ModelRunner, group: TPGroup) -> None:
    """Ranks 1..N-1: run what rank 0 broadcasts until it says stop."""
    while True:
        message: list[Any] = [None]  # rank 0's (kind, plan)
        dist.broadcast_object_list(message, src=0, group=group.control)
        kind, plan = message[0]
        if kind == EXECUTE:
            try:
                runner.execute(plan)
            except PlanError:
                pass  # rank 0 rejected the same plan, before any state changed anywhere
        elif kind == RESET:
            runner.reset()
        else:
            return


def _die_with_parent() -> None:
    """A spawned rank must not outlive rank 0 (it would wait on the control group for a year)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _spawned_rank(
    index: int, config: ModelServiceConfig, world_size: int, init_method: str
) -> None:
    from model_service.logs import configure_logging

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops the others
    configure_logging()
    runner, group = setup_rank(config, index + 1, world_size, init_method)
    worker_loop(runner, group)
    dist.destroy_process_group()


def run_torchrun_worker(config: ModelServiceConfig) -> None:
    """Entry of a rank > 0 started by torchrun."""
    # torchrun forwards SIGTERM / SIGINT to every rank; this one waits for rank 0's stop (sent
    # while rank 0 shuts down) so that it leaves the group cleanly, and exits 0.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    launched = torchrun_rank()
    assert launched is not None, "run_torchrun_worker runs under torchrun only"
    rank, world_size = launched
    runner, group = setup_rank(config, rank, world_size, "env://")
    worker_loop(runner, group)
    dist.destroy_process_group()


class RankWatcher:
    """Takes the service down when a spawned rank dies: rank 0 alone would hang in its next
    all_reduce, and a supervisor (Kubernetes) restarts a process that exits."""

    def __init__(self, processes) -> None:
        self._processes = processes
        self.closing = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tp-ranks", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            while not self._processes.join(timeout=1.0):
                pass
            error = "a rank exited"
        except Exception as exc:  # ProcessExitedException / ProcessRaisedException
            error = str(exc)
        if not self.closing.is_set():
            log.error("tensor_parallel_rank_lost", error=error)
            os._exit(1)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)


class TensorParallelRunner:
    """Rank 0's runner: every call goes to the other ranks first, then runs here.

    The lock keeps the broadcast order equal to the execution order (execute runs in worker
    threads, reset may come from the event loop)."""

    def __init__(
        self, runner: ModelRunner, group: TPGroup, watcher: Optional[RankWatcher] = None
    ) -> None:
        self.runner = runner
        self.group = group
        self.loaded, self.limits, self.config = runner.loaded, runner.limits, runner.config
        self._lock = threading.Lock()
        self._watcher = watcher

    def describe_facts(self) -> DescribedFacts:
        return self.runner.describe_facts()

    def _broadcast(self, kind: str, plan: Optional[PlanArrays] = None) -> None:
        dist.broadcast_object_list([(kind, plan)], src=0, group=self.group.control)

    def execute(self, plan: PlanArrays) -> ComputedStep:
        with self._lock:
            self._broadcast(EXECUTE, plan)
            return self.runner.execute(plan)

    def reset(self) -> None:
        with self._lock:
            self._broadcast(RESET)
            self.runner.reset()

    def close(self) -> None:
        """Stop the other ranks and leave the group."""
        with self._lock:
            if self._watcher is not None:
                self._watcher.closing.set()
            self._broadcast(STOP)
        if self._watcher is not None:
            self._watcher.join(timeout_s=30)
        dist.destroy_process_group()


def start_tensor_parallel(config: ModelServiceConfig) -> TensorParallelRunner:
    """Rank 0: start (or, under torchrun, join) the other ranks; returns once every rank loaded."""
    launched = torchrun_rank()
    if launched is not None:
        rank, world_size = launched
        if rank != 0:
            raise RuntimeError("start_tensor_parallel runs on rank 0 only")
        runner, group = setup_rank(config, 0, world_size, "env://")
        return TensorParallelRunner(runner, group)
    world_size = config.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
    processes = mp.start_processes(
        _spawned_rank,
        args=(config, world_size, init_method),
        nprocs=world_size - 1,
        join=False,
        start_method="spawn",
    )
    watcher = RankWatcher(
        processes
    )  # from now: a rank failing to load must not leave rank 0 waiting
    runner, group = setup_rank(config, 0, world_size, init_method)
    return TensorParallelRunner(runner, group, watcher)
