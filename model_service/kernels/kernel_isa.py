"""Which ISA path a native kernel module runs: one rule for the attention kernel and the layer ops.

A kernel module (cython_ext.paged_attention, cython_ext.layer_ops) lists its paths in ISAS, says
which this CPU and build run (isa_supported) and which is fastest (best_isa). The path comes from
the caller, else the module's environment variable, else "auto" (the fastest); "torch" selects the
plain-torch implementation beside it, for comparisons. Anything else is refused naming the variable.
"""

from __future__ import annotations

import os

TORCH_PATH = "torch"


def resolve_isa(native, env: str, name: str | None = None) -> str:
    name = name or os.environ.get(env, "auto")
    if name == "auto":
        return native.best_isa()
    if name == TORCH_PATH:
        return name
    if name not in native.ISAS:
        raise ValueError(
            f"{env}: {name!r} is not one of auto, {TORCH_PATH}, {', '.join(native.ISAS)}"
        )
    if not native.isa_supported(name):
        raise ValueError(
            f"{env}: {name!r} is not supported by this CPU or build (best: {native.best_isa()})"
        )
    return name
