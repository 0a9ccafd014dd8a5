"""planserve: the public gRPC contract (planserve.v1) and the offline Python API.

`from planserve import LLM, SamplingParams, LoRARequest` runs the scheduler and the model in
this process (tools/offline.py); they are imported on first use, so importing the generated
stubs stays light (no torch).
"""
from __future__ import annotations

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str):
    if name in __all__:
        from tools import offline
        return getattr(offline, name)
    raise AttributeError(f"module 'planserve' has no attribute {name!r}")
