"""Which ISA path a native kernel module runs: one rule for the attention kernel and the layer ops.

A kernel module (cython_ext.paged_attention, cython_ext.layer_ops, cython_ext.gemm) lists its paths
in ISAS, says which this CPU and build run (isa_supported) and which is fastest (best_isa). The path
is a config field (attention_isa, layer_ops_isa, gemm_isa: model_service/config.py): "auto" (the
fastest), "torch" (the plain-torch implementation beside the kernel, for comparisons) or one of
ISAS. Anything else is refused naming the field and its environment alias.
"""

from __future__ import annotations

from model_service.config import COMPUTE_ENV_ALIASES

TORCH_PATH = "torch"


def resolve_isa(native, field: str, name: str) -> str:
    """The path `name` (the value of config field `field`) runs on this CPU."""
    env = f"{field} ({COMPUTE_ENV_ALIASES[field]})"
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


class PathChoice:
    """The path one kernel module runs in this process: the one the start-up selected from the
    config (model_service/start.py), else the best this CPU runs, resolved on first use (never
    at import). One per process, as the process serves one model; a runner built later selects
    again."""

    def __init__(self, native, field: str) -> None:
        self.native, self.field = native, field
        self._path: str | None = None

    def resolve(self, name: str = "auto") -> str:
        """The path `name` runs here ("auto": the best), without selecting it."""
        return resolve_isa(self.native, self.field, name)

    def select(self, name: str) -> str:
        """Selects `name` (resolved) for the calls that name no path; returns it."""
        self._path = self.resolve(name)
        return self._path

    @property
    def current(self) -> str:
        if self._path is None:
            self._path = self.resolve()
        return self._path
