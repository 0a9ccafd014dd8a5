"""What the GPU benchmark reads while a server serves: GPU utilization and memory (nvidia-smi's
200 ms samples), the served batch (the scheduler's running count), and each service's CPU time.

CPU% is (user + system) seconds of a process tree over the run's wall time, from /proc/PID/stat
(all threads; bench/bench_orchestration.py reads it the same way): 100% is one core busy.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time
from typing import Optional, Sequence

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
NVIDIA_SMI_QUERY = "--query-gpu=utilization.gpu,memory.used"


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads); 0 once it is gone."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """root and every process below it (children of children...), from /proc's parent ids."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            parent = int(_stat_fields(int(name))[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def service_trees(serve_pid: int) -> dict[str, list[int]]:
    """`planserve serve`'s processes by service: the model service child's tree (its command line
    runs model_service), the frontend processes (--frontend-processes: scheduler_service.frontends)
    and the scheduler: the serve process with the rest of its tree."""
    every = descendants(serve_pid)

    def running(module: str) -> list[int]:
        roots = [p for p in every if p != serve_pid and f"-m {module}" in _cmdline(p)]
        return sorted({p for root in roots for p in descendants(root)})

    model, frontends = running("model_service"), running("scheduler_service.frontends")
    rest = [p for p in every if p not in model and p not in frontends]
    return {"scheduler": rest, "frontends": frontends, "model_service": model}


class CpuMeter:
    """CPU seconds of each service tree between start() and stop(), as a percentage of one core."""

    def __init__(self, serve_pid: int) -> None:
        self.serve_pid = serve_pid

    def _read(self) -> dict[str, float]:
        trees = service_trees(self.serve_pid)
        return {name: sum(cpu_seconds(p) for p in pids) for name, pids in trees.items()}

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), self._read()

    def stop(self, wall: float | None = None) -> dict[str, float]:
        """CPU% of each tree since start(), over `wall` seconds (default: since start())."""
        cpu = self._read()
        wall = wall if wall is not None else time.perf_counter() - self._wall
        return {
            name: round(100.0 * (cpu[name] - self._cpu.get(name, 0.0)) / wall, 1) for name in cpu
        }


class GpuMonitor:
    """nvidia-smi's utilization and memory samples every 200 ms, in a thread, while serving.
    Without nvidia-smi (or on the CPU) it records nothing and says why."""

    def __init__(self, device: str) -> None:
        self.samples: list[tuple[float, float]] = []  # (utilization %, memory used MiB)
        self.reason: Optional[str] = None
        self._process: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None
        if not device.startswith("cuda"):
            self.reason = f"device {device}: no GPU to sample"
        elif shutil.which("nvidia-smi") is None:
            self.reason = "nvidia-smi is not on PATH"
        self._index = device.split(":", 1)[1] if ":" in device else "0"

    def start(self) -> None:
        if self.reason is not None:
            return
        argv = ["nvidia-smi", NVIDIA_SMI_QUERY, "--format=csv,noheader,nounits", "-lms", "200"]
        self._process = subprocess.Popen(
            [*argv, "-i", self._index], stdout=subprocess.PIPE, text=True
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            try:
                utilization, memory = (float(x) for x in line.split(","))
            except ValueError:
                continue  # "[N/A]" or a header: skipped
            self.samples.append((utilization, memory))

    def stop(self) -> dict:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            if self._thread is not None:
                self._thread.join(timeout=5)
        if not self.samples:
            return {"utilization_pct": None, "memory_used_mib_max": None, "samples": 0,
                    "reason": self.reason or "nvidia-smi printed no samples"}  # fmt: skip
        utilization = [u for u, _ in self.samples]
        return {
            "utilization_pct": percentiles(utilization),
            "memory_used_mib_max": max(m for _, m in self.samples),
            "samples": len(self.samples),
            "reason": None,
        }


def percentiles(values: Sequence[float]) -> Optional[dict]:
    """mean, p10, p50, p90 of samples (None when there are none)."""
    if not values:
        return None
    ordered = sorted(values)

    def at(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    mean = round(statistics.fmean(ordered), 2)
    return {"mean": mean, "p10": at(10), "p50": at(50), "p90": at(90)}
