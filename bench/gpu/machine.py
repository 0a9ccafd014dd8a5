"""The machine a GPU benchmark ran on: GPU, driver, torch, CUDA, Triton and transformers, read in
a child process (so no CUDA context stays in the benchmark's own process while it serves)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

_MACHINE_PROBE = """
import json, platform, torch
try:
    import triton; triton_version = triton.__version__
except ImportError:
    triton_version = None
try:
    import transformers; hf = transformers.__version__
except ImportError:
    hf = None
cuda = torch.cuda.is_available()
print(json.dumps({"gpu": torch.cuda.get_device_name(0) if cuda else None,
    "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
    "transformers": hf, "python": platform.python_version()}))
"""


def machine(device: str, env: dict[str, str] | None = None) -> dict:
    """GPU, driver and versions, read in a child process (no CUDA context stays in this one)."""
    from bench import measure

    probe = subprocess.run([sys.executable, "-c", _MACHINE_PROBE], capture_output=True,
                           text=True, env=env, timeout=120)  # fmt: skip
    facts = json.loads(probe.stdout) if probe.returncode == 0 else {"probe_error": probe.stderr}
    facts["driver"] = None
    if device.startswith("cuda"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            facts["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    return {**facts, "device": device, "cpu": measure.cpu_model(), "cpus": os.cpu_count()}
