"""The model service's OpenMP set-up: made before torch is imported, because libgomp reads its
environment once, when torch loads it.

torch runs its intra-op work (GEMMs, and our attention and layer kernels, which share torch's
libgomp) on OpenMP threads that spin while they wait for the next parallel region: GNU libgomp
spins GOMP_SPINCOUNT times (300,000 by default) before sleeping. The scheduler, gRPC and the
clients share the same cores, so a spinning thread can keep a core from the process the step
is waiting for. The defaults below were chosen by measurement (bench/bench_threads.py: the peer
workload through `planserve serve` on a quiet machine and with one core kept busy by another
process; bench/results/threads.json).

A variable already in the environment wins; one set to the empty string is removed, so libgomp's
own default applies (bench_threads.py uses that to measure it). The settings in effect are logged
at start-up and reported in Describe (`compute`).
"""

from __future__ import annotations

import os

# Why these settings (the measurements: docs/benchmarks.md, "Figures behind the code's comments",
# and bench/results/threads.json): the 2-thread waiting policies tie within the noise, binding
# threads to cores loses a third of the throughput when another process holds a core, and one
# thread loses a quarter on a quiet machine. Of the ties, the short spin gives a core back soonest
# after a parallel region (a fraction of a millisecond instead of several), which leaves the cores
# to the scheduler and clients between steps. Thread count: torch's default (the physical cores
# this process may use); tensor-parallel ranks share them (tp_worker.py).
DEFAULTS: dict[str, str] = {"GOMP_SPINCOUNT": "10000"}
# numpy's OpenBLAS starts a thread per core at import and never does work here: one is enough.
QUIET_LIBRARIES = {"OPENBLAS_NUM_THREADS": "1"}
_REPORTED = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND", "OMP_PLACES")


def configure(environ=os.environ) -> None:
    """Apply the defaults to `environ` where it sets nothing; drop variables set to ""."""
    for key, value in {**DEFAULTS, **QUIET_LIBRARIES}.items():
        environ.setdefault(key, value)
    for key in [k for k, v in environ.items() if k in _REPORTED and v == ""]:
        del environ[key]


def settings() -> dict[str, str]:
    """What the model service computes with: torch's thread count and the OpenMP variables in
    effect (libgomp's default where unset)."""
    import torch

    return {
        "torch_threads": str(torch.get_num_threads()),
        **{key.lower(): os.environ.get(key, "(libgomp default)") for key in _REPORTED},
    }
