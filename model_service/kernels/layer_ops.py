"""The decoder's row-wise operations: residual add + RMSNorm, RoPE in place, SiLU x up.

Each runs as one native call on the CPU (cython_ext/layer_ops.pyx over cython_ext/csrc/layer_ops*),
in place of the 6-14 eager torch ops it replaces per layer, and as one Triton kernel on CUDA
(model_service/kernels/triton_ops.py); other devices, CUDA without Triton, and layer_ops_isa
"torch" (for A/B checks) run the same arithmetic in torch (`torch_*`). `_path` decides, for the
calls and for Describe (`device_path`).

Every operation computes each token row by itself, in a fixed order: a row's bits never depend on
the other rows of the step, so a row computes the same alone or in a batch of 64, and a prompt
row the same as a decode row (the batch-invariance rule, tests/model_service/test_ms_layer_ops.py).
Numerics follow Hugging Face's Llama: float32 arithmetic; in bfloat16 the residual sum, the
normalized row and the norm's weight product are each rounded, as transformers rounds them; RoPE
and SiLU x up round once at the end (transformers rounds their partial products too: ours are
closer to float32). The RoPE table holds float32 cos and sin per position, computed once per model
as transformers computes them (models/rope.py).

`linear` is how the decoder calls its GEMMs (torch's): with the few-row padding that keeps them
batch-invariant too (docs/design-notes.md, "Batch invariance").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cython_ext import layer_ops as native
from model_service.kernels import kernel_isa, triton_ops
from model_service.kernels.gemm import PackedLinear
from model_service.kernels.quant import Int8Linear, exact_blocks

TORCH_PATH = kernel_isa.TORCH_PATH
GEMM_MIN_ROWS = {torch.float32: 16, torch.bfloat16: 2}  # see linear()
_DTYPES = {
    torch.float32: native.DTYPES.index("float32"),
    torch.bfloat16: native.DTYPES.index("bfloat16"),
}


# The config's layer_ops_isa, selected at start.
PATH = kernel_isa.PathChoice(native, "layer_ops_isa")
resolve_isa = PATH.resolve


TRITON = "triton"
TRITON_DEVICE = "cuda"  # where the Triton kernels run (the interpreter's tests point it at "cpu")


def _path(x: torch.Tensor, isa: str | None) -> int | str:
    """The path the ops run on tensor x: the native path's index, TRITON, or TORCH_PATH."""
    isa = isa or PATH.current
    if _triton_unsupported(x, isa) is None:
        return TRITON
    if x.device.type != "cpu" or isa == TORCH_PATH or x.dtype not in _DTYPES:
        return TORCH_PATH
    return native.ISAS.index(isa)


def _triton_unsupported(x: torch.Tensor, isa: str) -> str | None:
    """Why the ops on x do not run the Triton kernels, or None where they do."""
    if x.device.type != TRITON_DEVICE:
        return f"device {x.device.type}"
    if isa == TORCH_PATH:
        return "layer_ops_isa=torch"
    return triton_ops.unsupported_reason(x)


def device_path(x: torch.Tensor) -> str:
    """The path a model whose activations are like x runs off the CPU, for Describe's `compute`:
    "triton", or "torch (why)"."""
    reason = _triton_unsupported(x, PATH.current)
    return TRITON if reason is None else f"{TORCH_PATH} ({reason})"


def add_rms_norm_(
    residual: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    isa: str | None = None,
) -> torch.Tensor:
    """residual [T, hidden] += delta (in place; none when delta is None), then return
    RMSNorm(residual) * weight as a new [T, hidden] tensor."""
    index = _path(residual, isa)
    if index == TRITON:
        return triton_ops.add_rms_norm_(residual, delta, weight, eps)
    if isinstance(index, str):  # TORCH_PATH
        return torch_add_rms_norm_(residual, delta, weight, eps)
    rows, hidden = residual.shape
    _check_dense("residual", residual, (rows, hidden))
    _check_dense("weight", weight, (hidden,), residual.dtype)
    if delta is not None:
        _check_dense("delta", delta, (rows, hidden), residual.dtype)
    out = torch.empty_like(residual)
    native.add_rms_norm(
        residual.data_ptr(),
        0 if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        hidden,
        eps,
        _DTYPES[residual.dtype],
        index,
        torch.get_num_threads(),
    )
    return out


def rope_(
    x: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    num_heads: int,
    head_dim: int,
    isa: str | None = None,
) -> None:
    """Rotate-half RoPE in place on the first num_heads heads (head_dim each) of x's rows [T, >=
    num_heads * head_dim], rows may lie apart; positions [T] int64 index the table's rows."""
    index = _path(x, isa)
    if index == TRITON:
        return triton_ops.rope_(x, positions, table, num_heads, head_dim)
    if isinstance(index, str):  # TORCH_PATH
        return torch_rope_(x, positions, table, num_heads, head_dim)
    rows = x.shape[0]
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < num_heads * head_dim:
        raise ValueError(
            f"rope: x must be [T, >= {num_heads * head_dim}] with dense rows, got {tuple(x.shape)} "
            f"strides {x.stride()}"
        )
    _check_dense("positions", positions, (rows,), torch.int64)
    _check_dense("table", table, (table.shape[0], head_dim), torch.float32)
    native.rope(
        x.data_ptr(),
        rows,
        x.stride(0),
        num_heads,
        head_dim,
        positions.data_ptr(),
        table.data_ptr(),
        table.shape[0],
        _DTYPES[x.dtype],
        index,
        torch.get_num_threads(),
    )


def rope_and_cache_kv_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    isa: str | None = None,
) -> bool:
    """rope_ on the q and k heads of qkv [T, (H + 2 KVH) * D]. Where the Triton kernel runs (and
    the caches [NB, KVH, BS, D] are contiguous, of qkv's dtype), the same kernel also writes the
    rotated K rows and the V rows into the caches at slot_mapping, and True says so: the
    attention call then skips its own write. Elsewhere only the rotation, and False."""
    fused = (
        _path(qkv, isa) == TRITON
        and k_cache.dtype == v_cache.dtype == qkv.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )
    if not fused:
        rope_(qkv, positions, table, num_heads + num_kv_heads, head_dim, isa)
        return False
    kv = triton_ops.KVWrite(k_cache, v_cache, slot_mapping, num_kv_heads)
    triton_ops.rope_(qkv, positions, table, num_heads + num_kv_heads, head_dim, kv)
    return True


def silu_mul(gate_up: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """[T, 2 * I] (gate columns, then up columns) -> silu(gate) * up, [T, I]."""
    index = _path(gate_up, isa)
    if index == TRITON:
        return triton_ops.silu_mul(gate_up)
    if isinstance(index, str):  # TORCH_PATH
        return torch_silu_mul(gate_up)
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    _check_dense("gate_up", gate_up, (rows, 2 * width))
    out = gate_up.new_empty((rows, width))
    native.silu_mul(
        gate_up.data_ptr(),
        out.data_ptr(),
        rows,
        width,
        _DTYPES[gate_up.dtype],
        index,
        torch.get_num_threads(),
    )
    return out


def linear(module: torch.nn.Module, x: torch.Tensor, float32_out: bool = False) -> torch.Tensor:
    """module(x) for a linear layer (float32_out: as float32, e.g. logits; a PackedLinear then
    returns its float32 sums unrounded), batch-invariant. A PackedLinear
    (model_service/kernels/gemm.py) is by construction and runs as it is. torch's CPU GEMMs pick
    other kernels, with another summation order, for few rows, so fewer than GEMM_MIN_ROWS rows are
    padded with zero rows up to it: the row counts where bits changed, and what the padding costs,
    are in docs/benchmarks.md ("Figures behind the code's comments")."""
    if isinstance(
        module, PackedLinear
    ):  # no hooks on these: forward skips nn.Module.__call__ (~1.5 us x 121 a step)
        return module.forward(x, torch.float32 if float32_out else torch.bfloat16)
    if isinstance(module, Int8Linear) and exact_blocks(x):  # row by row already: no padding
        return module.forward(x, torch.float32 if float32_out else torch.bfloat16)
    rows = x.shape[0]
    minimum = GEMM_MIN_ROWS.get(x.dtype, 0)
    if x.device.type == "cpu" and 0 < rows < minimum:
        out = module(F.pad(x, (0, 0, 0, minimum - rows)))[:rows]
    else:
        out = module(x)
    return out.float() if float32_out else out


def _check_dense(
    name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None = None
) -> None:
    if (
        tuple(t.shape) != tuple(shape)
        or not t.is_contiguous()
        or (dtype is not None and t.dtype != dtype)
        or t.device.type != "cpu"
    ):
        raise ValueError(
            f"{name}: expected a contiguous CPU tensor {list(shape)}"
            f"{f' of {dtype}' if dtype is not None else ''}, got {list(t.shape)} {t.dtype} on "
            f"{t.device}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}"
        )


# The same operations in torch: other devices, CUDA without Triton, and
# PLANSERVE_LAYER_OPS_ISA=torch.


def torch_add_rms_norm_(residual, delta, weight, eps):
    if delta is not None:
        residual.add_(delta)
    x = residual.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(residual.dtype)


def torch_rope_(x, positions, table, num_heads, head_dim):
    half = head_dim // 2
    heads = x[:, : num_heads * head_dim].unflatten(1, (num_heads, head_dim))
    cos, sin = table[positions, None, :half], table[positions, None, half:]
    x1, x2 = heads[..., :half].to(torch.float32), heads[..., half:].to(torch.float32)
    heads.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def torch_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.to(torch.float32)) * up.to(torch.float32)).to(gate_up.dtype)
