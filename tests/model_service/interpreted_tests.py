"""A test file's Triton kernels under Triton's interpreter, on the CPU: its tests named
"interpreted" run in a child pytest with TRITON_INTERPRET=1 (Triton reads it at import, so the
parent, which imported Triton compiled, cannot run them itself)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_interpreted(test_file: str, expected: str, timeout_s: int, *pytest_args: str) -> None:
    """Runs `test_file`'s "interpreted" tests in the interpreter's child process and checks that
    `expected` ("2 passed") is in its report and nothing was skipped. Skips where Triton is
    missing, in that child itself, and on a GPU (which compiles the kernels instead)."""
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is the interpreter's process")
    if torch.cuda.is_available():
        pytest.skip("a GPU compiles the kernels instead (the gpu tests)")
    here = os.path.dirname(os.path.abspath(test_file))
    root = os.path.dirname(os.path.dirname(here))
    path = os.pathsep.join([here, os.path.join(root, "tests"), os.path.join(root, "protos"), root])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args,
               "-k", "interpreted", os.path.abspath(test_file)]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert expected in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]
