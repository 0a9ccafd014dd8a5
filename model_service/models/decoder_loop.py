"""The decoder's layers in one native call per step (cython_ext/decoder.pyx over csrc/decoder.cpp).

The Python loop in models/llama.py makes nine native calls a layer, each behind a wrapper that
checks its tensors and allocates its output: on two cores a visible share of a bf16 decode step
(docs/benchmarks.md, "Figures behind the code's comments"). `NativeLayers` makes the same calls
in the same order on the same kernels from C++, into buffers allocated once per step, with the
GIL released for the whole step: the same bits as the Python loop by construction, so batch
invariance holds as it does there (tests/model_service/test_ms_decoder_loop.py checks the logits
bit for bit).

A step with LoRA adapters runs here too where their factors are stacked and packed
(model_service/lora/stacked.py, a bf16 model on the CPU): after each fused linear the C loop runs
each row against its own adapter's blocks of the stack only (csrc/lora_rows.h, rows grouped by
adapter, base rows skipped), in the bits of stacked.py's packed GEMMs, from a `LoraTable` of the
stack's addresses built once per stack (a stack is replaced, never changed, when an adapter is
loaded or evicted).

It applies where every kernel of a layer is native: a bfloat16 model on the CPU with its linears
packed (model_service/kernels/gemm.py), the native attention and layer-op paths, and no per-head
q/k norm or sliding window (Qwen3, Mistral with a window: those run the Python loop).
`unsupported_reason` says why a model runs the Python loop; the config's decoder_loop "python"
forces it (A/B checks).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cython_ext import decoder as native
from cython_ext import gemm as native_gemm
from cython_ext import layer_ops as native_layer_ops
from cython_ext import paged_attention as native_attention
from model_service.attention import paged
from model_service.attention.kv_cache import KVCache
from model_service.attention.paged import AttentionMetadata
from model_service.kernels import layer_ops
from model_service.kernels.gemm import PackedLinear

# A step's adapters as the native loop takes them: the stack (lora/stacked.py's LoadedStack, not
# imported: lora/ sits above models/ in the rooms), each row's lora_id (int64 [T], 0: base) and
# scale (float32 [T, 1]), as lora/grouping.py's LoraStep.stacked holds them.
LoadedStack = Any
StackedStep = tuple[LoadedStack, np.ndarray, torch.Tensor]

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _linears(layer: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ]


def decide(model: torch.nn.Module, requested: str) -> str | None:
    """The one decision of the loop `model` (a LlamaForCausalLM, its linears packed) runs, kept
    on it as decoder_loop_reason: None for the native loop, else why the Python loop runs.
    `requested` is the config's decoder_loop ("native" or "python")."""
    model.decoder_loop_reason = unsupported_reason(model, requested)
    return model.decoder_loop_reason


def unsupported_reason(model: torch.nn.Module, requested: str = "native") -> str | None:
    """Why `model` (a LlamaForCausalLM) runs the Python loop; None where the native loop applies."""
    if requested == "python":
        return "decoder_loop=python"
    arch = model.arch
    if arch.qk_norm:
        return "per-head q/k norm"
    if arch.sliding_window is not None:
        return "sliding-window attention"
    if paged.PATH.current == paged.TORCH_PATH:
        return "torch attention path"
    if layer_ops.PATH.current == layer_ops.TORCH_PATH:
        return "torch layer-ops path"
    layers = model.model.layers
    for layer in layers:
        if not all(isinstance(m, PackedLinear) for m in _linears(layer)):
            return "linears not packed (float32, tensor-parallel, or torch's GEMM path)"
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.bfloat16 or w.device.type != "cpu" for w in norms):
            return "norm weights not bfloat16 on the CPU"
    if len({m.isa for layer in layers for m in _linears(layer)}) > 1:
        return "linears packed for different GEMM paths"
    return None


def describe(model: torch.nn.Module) -> str:
    """The loop `model` runs, as Describe's compute map reports it: "native", "python (why)", or
    "none" for a model without decoder layers (the null model)."""
    if not hasattr(model, "decoder_loop_reason"):
        return "none"
    reason = model.decoder_loop_reason
    return "native" if reason is None else f"python ({reason})"


def _linear_spec(module: PackedLinear) -> tuple[int, int, int, int, bool]:
    bias = 0 if module.bias is None else module.bias.data_ptr()
    return (module.packed.data_ptr(), bias, module.out_features, module.in_features, module.int8)


class NativeLayers:
    """One model's layer table for the native loop; `run` is one step (see the module docstring).
    Holds the model, so every address it handed over stays valid."""

    def __init__(self, model: torch.nn.Module, rope: torch.Tensor) -> None:
        arch, layers = model.arch, model.model.layers
        first = layers[0].self_attn
        self.model, self.rope = model, rope
        self.num_heads, self.num_kv_heads, self.head_dim = (
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
        )
        self.intermediate = layers[0].mlp.down_proj.in_features
        self.hidden = arch.hidden_size
        isa = first.qkv_proj.isa
        self.table = native.DecoderLayers(
            len(layers),
            hidden=self.hidden,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate=self.intermediate,
            eps=layers[0].input_layernorm.eps,
            rope=rope.data_ptr(),
            rope_rows=rope.shape[0],
            gemm_isa=native_gemm.ISAS.index(isa),
            layer_ops_isa=native_layer_ops.ISAS.index(layer_ops.PATH.current),
            attention_isa=native_attention.ISAS.index(paged.PATH.current),
        )
        # The tensors whose addresses the table holds, kept alive here even if a module were
        # replaced later (a stale weight, never a dangling pointer).
        self._tensors: list[torch.Tensor] = [rope]
        for index, layer in enumerate(layers):
            linears = _linears(layer)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            self._tensors += [*norms, *(m.packed for m in linears)]
            self._tensors += [m.bias for m in linears if m.bias is not None]
            qkv, o, gate_up, down = (_linear_spec(m) for m in linears)
            self.table.set_layer(
                index,
                norms[0].data_ptr(),
                norms[1].data_ptr(),
                qkv,
                o,
                gate_up,
                down,
            )
        self._caches: tuple[int, int] | None = None
        self._lora: tuple[LoadedStack, native.LoraTable] | None = None

    def _set_caches(self, kv_cache: KVCache) -> None:
        k, v = kv_cache.k, kv_cache.v
        expected = (len(self.model.model.layers), self.num_kv_heads, self.head_dim)
        shape = (k.shape[0], k.shape[2], k.shape[4])
        if shape != expected or k.dtype != torch.bfloat16 or not k.is_contiguous():
            raise ValueError(
                f"native decoder loop: KV cache [layers, blocks, kv_heads, block, head_dim] "
                f"{list(k.shape)} {k.dtype}, expected layers/kv_heads/head_dim {list(expected)} "
                "contiguous bfloat16"
            )
        if self._caches != (k.data_ptr(), v.data_ptr()):
            self.table.set_caches(k.data_ptr(), v.data_ptr(), k.stride(0) * k.element_size())
            self._caches = (k.data_ptr(), v.data_ptr())

    def _lora_table(self, stack: LoadedStack) -> native.LoraTable:
        """The native table of `stack`'s addresses, made when the stack is new (the stack it was
        made from is kept with it: it owns the tensors the addresses point into)."""
        if self._lora is not None and self._lora[0] is stack:
            return self._lora[1]
        modules = [(i, f, m) for i, layer in enumerate(stack.layers) for f, m in layer.items()]
        table = native.LoraTable(
            len(self.model.model.layers), sum(len(m.parts) for *_, m in modules)
        )
        for index, fused, module in modules:
            targets = []
            for (k0, k1, b, start, end), blocks in zip(module.parts, module.blocks):
                assert blocks.dtype == np.int64 and blocks.flags.c_contiguous
                targets.append(
                    (b.packed.data_ptr(), k0, k1, start, end, blocks.ctypes.data, len(blocks))
                )
            table.set_module(
                index, fused, module.a.packed.data_ptr(), module.a.out_features, targets
            )
        self._lora = (stack, table)
        return table

    def run(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        lora: StackedStep | None = None,
    ) -> torch.Tensor:
        """Every layer over residual [T, hidden] (bfloat16, updated in place); returns the last
        layer's output (to be added by the final norm), as the Python loop does. `lora`: the
        step's stacked adapters, None when no row runs one."""
        rows = residual.shape[0]
        if residual.dtype != torch.bfloat16 or not residual.is_contiguous():
            raise ValueError("native decoder loop: residual must be contiguous bfloat16")
        if (
            positions.dtype != torch.int64
            or not positions.is_contiguous()
            or positions.shape != (rows,)
        ):
            raise ValueError(f"native decoder loop: positions must be contiguous int64 [{rows}]")
        self._set_caches(kv_cache)
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim

        def buffer(width: int) -> torch.Tensor:
            return residual.new_empty((rows, width))

        delta, x = buffer(self.hidden), buffer(self.hidden)
        qkv, attn = buffer((h + 2 * kvh) * d), buffer(h * d)
        gate_up, act = buffer(2 * self.intermediate), buffer(self.intermediate)
        adapters, _alive = self._lora_arguments(lora, rows)
        self.table.run(
            meta.native_step.args_address,
            kv_cache.block_size,
            kv_cache.num_blocks,
            paged.split_positions(kv_cache.block_size),
            rows,
            positions.data_ptr(),
            residual.data_ptr(),
            delta.data_ptr(),
            x.data_ptr(),
            qkv.data_ptr(),
            attn.data_ptr(),
            gate_up.data_ptr(),
            act.data_ptr(),
            meta.num_threads,
            **adapters,
        )
        return delta

    def _lora_arguments(self, lora: StackedStep | None, rows: int) -> tuple[dict, tuple]:
        """run()'s keyword arguments for the step's adapters (the table, the rows by adapter,
        each row's scale, the u scratch buffer), and the arrays their addresses point into, which
        the caller holds until the call returns."""
        if lora is None:
            return {}, ()
        stack, row_owner, scale = lora
        table = self._lora_table(stack)
        if row_owner.dtype != np.int64 or row_owner.shape != (rows,):
            raise ValueError(f"native decoder loop: LoRA row owners must be int64 [{rows}]")
        order, groups = rows_by_adapter(row_owner)
        scale = scale.reshape(rows).to(torch.float32).contiguous()
        u = torch.empty((rows, table.max_rank), dtype=torch.bfloat16)
        arguments = {
            "lora": table,
            "order": order.ctypes.data,
            "groups": groups.ctypes.data,
            "num_groups": len(groups),
            "row_scale": scale.data_ptr(),
            "lora_u": u.data_ptr(),
        }
        return arguments, (order, groups, scale, u)


def rows_by_adapter(row_owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows grouped by adapter as csrc/lora_rows.h takes them: order int64 [rows] (each
    group's rows ascending) and groups int64 [groups, 3] of (lora_id, begin, end) into order,
    base rows (lora_id 0) in none."""
    order = np.argsort(row_owner, kind="stable").astype(np.int64)
    owners = row_owner[order]
    starts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])[: len(owners)]
    ends = np.r_[starts[1:], len(order)][: len(starts)]
    groups = np.stack([owners[starts], starts, ends], axis=1).astype(np.int64)
    return order, np.ascontiguousarray(groups[groups[:, 0] != 0])
