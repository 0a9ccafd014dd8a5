"""Building a model from a checkpoint, tensor by tensor, straight into the serving dtype.

The module tree is made on the meta device (no memory, no init), then each module's weights are
read from the `WeightSource` (model_service/loading/weights.py): only this rank's rows and columns
(parallel.RankShare), cast to the serving dtype (or, for int8, quantized from the stored values
4,096 rows at a time),
fused where our layers are fused, and put in place; the read tensor is dropped before the next.
So the host never holds the checkpoint in float32, nor a whole unsplit matrix of another rank:
the peak is the final weights plus about one layer's worth in flight (bench/bench_load.py
measures it).

    checkpoint (Hugging Face names)            our module              what this rank reads
    model.embed_tokens.weight                  model.embed_tokens      its vocab rows
    layers.N.self_attn.{q,k,v}_proj.weight     self_attn.qkv_proj      rows [q | k | v] of its heads
    layers.N.self_attn.{q,k,v}_proj.bias       self_attn.qkv_proj      (attention_bias: Qwen2)
    layers.N.self_attn.o_proj.weight           self_attn.o_proj        columns of its heads
    layers.N.self_attn.{q,k}_norm.weight       self_attn.{q,k}_norm    all (qk_norm: Qwen3)
    layers.N.mlp.{gate,up}_proj.weight         mlp.gate_up_proj        rows [gate | up], its share
    layers.N.mlp.down_proj.weight              mlp.down_proj           columns, its share
    layers.N.{input,post_attention}_layernorm  the same                all
    model.norm.weight                          the same                all
    lm_head.weight                             the same                its vocab rows (or the
                                                                       embedding's, when tied)
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch import nn

from model_service.kernels import gemm
from model_service.kernels.quant import BLOCK as QUANT_BLOCK
from model_service.kernels.quant import Int8Embedding, Int8Linear, Int8Weight, quantize_blocks
from model_service.loading.weights import WeightSource
from model_service.models.arch import LlamaArchConfig
from model_service.models.llama import LlamaForCausalLM
from model_service.models.parallel import RankShare, check_divisible, wrap_parallel_

INT8_ROWS = 4096  # rows read and quantized at a time (a 2048-column bf16 chunk: 16 MiB)


def checkpoint_shapes(arch: LlamaArchConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor names and shapes a checkpoint of this architecture holds."""
    with torch.device("meta"):
        shapes = {
            name: tuple(t.shape) for name, t in LlamaForCausalLM(arch).hf_state_dict().items()
        }
    if arch.tie_word_embeddings:
        del shapes["lm_head.weight"]
    return shapes


def check_checkpoint(arch: LlamaArchConfig, weights: WeightSource) -> None:
    """ValueError listing the tensors the architecture needs and the checkpoint lacks, those it has
    that the architecture would not use (a tied model's extra lm_head.weight is allowed), and the
    first tensor whose shape differs from the architecture's."""
    expected, present = checkpoint_shapes(arch), weights.names()
    missing = sorted(set(expected) - present)
    unexpected = sorted(
        present - set(expected) - ({"lm_head.weight"} if arch.tie_word_embeddings else set())
    )
    if missing or unexpected:
        raise ValueError(
            f"model: weights do not match the architecture (missing {missing}, unexpected "
            f"{unexpected})"
        )
    for name, shape in sorted(expected.items()):
        if weights.shape(name) != shape:
            raise ValueError(
                f"model: tensor {name!r} has shape {list(weights.shape(name))}, the architecture's "
                "is "
                f"{list(shape)} (check config.json's sizes)"
            )


class _Builder:
    def __init__(
        self,
        arch,
        weights: WeightSource,
        dtype: torch.dtype,
        device: str,
        int8: bool,
        share: RankShare,
    ):
        self.arch, self.weights, self.dtype, self.device, self.int8, self.share = (
            arch,
            weights,
            dtype,
            device,
            int8,
            share,
        )

    def read(
        self, name: str, rows: Optional[slice] = None, columns: Optional[slice] = None
    ) -> torch.Tensor:
        """One tensor (or its slice) in the serving dtype."""
        return self.weights.read(name, rows, columns).to(self.dtype)

    def quantized(
        self, names: list[str], rows: list[Optional[slice]], columns: Optional[slice]
    ) -> Int8Weight:
        """The named tensors' rows, concatenated, as int8 blocks: read and quantized INT8_ROWS rows
        at a time from the stored values, so no whole matrix is ever held in float or as stored."""
        spans = [(name, r or slice(0, self.weights.shape(name)[0])) for name, r in zip(names, rows)]
        width = self.weights.shape(names[0])[1] if columns is None else columns.stop - columns.start
        q = torch.empty((sum(r.stop - r.start for _, r in spans), width), dtype=torch.int8)
        scale = torch.empty((q.shape[0], width // QUANT_BLOCK), dtype=torch.float32)
        at = 0
        for name, span in spans:
            for first in range(span.start, span.stop, INT8_ROWS):
                chunk = slice(first, min(span.stop, first + INT8_ROWS))
                count = chunk.stop - chunk.start
                q[at : at + count], scale[at : at + count] = quantize_blocks(
                    self.weights.read(name, chunk, columns)
                )
                at += count
        return Int8Weight(quantized=(q, scale))

    def parameter(self, name: str) -> nn.Parameter:
        return nn.Parameter(self.read(name).to(self.device), requires_grad=False)

    def linear(
        self,
        names: list[str],
        rows: Optional[list[Optional[slice]]] = None,
        columns: Optional[slice] = None,
        bias: bool = False,
    ) -> nn.Module:
        """A linear layer whose weight is the named tensors' rows, concatenated in order."""
        rows = rows or [None] * len(names)
        bias_tensor = None
        if bias:
            bias_tensor = torch.cat(
                [self.read(n.removesuffix(".weight") + ".bias", r) for n, r in zip(names, rows)]
            )
        if self.int8:
            return Int8Linear(self.quantized(names, rows, columns), bias_tensor).to(
                device=self.device, dtype=self.dtype
            )
        weight = torch.cat([self.read(n, r, columns) for n, r in zip(names, rows)])
        with torch.device("meta"):
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
        layer.weight = nn.Parameter(weight.to(self.device), requires_grad=False)
        if bias_tensor is not None:
            layer.bias = nn.Parameter(bias_tensor.to(self.device), requires_grad=False)
        return layer

    def embeddings_(self, model: LlamaForCausalLM) -> None:
        arch, rows = self.arch, self.share.vocab_rows(self.arch)
        if self.int8:
            shared = self.quantized(["model.embed_tokens.weight"], [rows], None)
            model.model.embed_tokens = Int8Embedding(shared).to(
                device=self.device, dtype=self.dtype
            )
            model.lm_head = (
                Int8Linear(shared)
                if arch.tie_word_embeddings
                else self.linear(["lm_head.weight"], [rows])
            ).to(device=self.device, dtype=self.dtype)
            return
        embed = self.read("model.embed_tokens.weight", rows)
        model.model.embed_tokens.weight = nn.Parameter(embed.to(self.device), requires_grad=False)
        if arch.tie_word_embeddings:
            model.tie_weights()
        else:
            model.lm_head = self.linear(["lm_head.weight"], [rows])

    def layer_(self, index: int, layer) -> None:
        arch, share, prefix = self.arch, self.share, f"model.layers.{index}."
        attn, mlp = layer.self_attn, layer.mlp
        q_rows, kv_rows, mlp_rows = share.q_rows(arch), share.kv_rows(arch), share.mlp_rows(arch)
        projections = [f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"]
        attn.qkv_proj = self.linear(
            projections, [q_rows, kv_rows, kv_rows], bias=arch.attention_bias
        )
        attn.o_proj = self.linear([f"{prefix}self_attn.o_proj.weight"], columns=q_rows)
        attn.num_heads = arch.num_attention_heads // share.world_size
        attn.num_kv_heads = arch.num_key_value_heads // share.world_size
        if arch.qk_norm:
            attn.q_norm.weight = self.parameter(f"{prefix}self_attn.q_norm.weight")
            attn.k_norm.weight = self.parameter(f"{prefix}self_attn.k_norm.weight")
        mlp.gate_up_proj = self.linear(
            [f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"], [mlp_rows, mlp_rows]
        )
        mlp.down_proj = self.linear([f"{prefix}mlp.down_proj.weight"], columns=mlp_rows)
        layer.input_layernorm.weight = self.parameter(f"{prefix}input_layernorm.weight")
        layer.post_attention_layernorm.weight = self.parameter(
            f"{prefix}post_attention_layernorm.weight"
        )


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS. The chunks a layer's reads and casts free are
    1-32 MiB: once glibc has raised its mmap threshold past them they come from the heap, and
    freed they stay in the process, so the load's peak would grow by what the allocator keeps
    rather than by what is live (int8, tensor parallel 1: 1.25x the weights without this, 1.15x
    with it; bench/bench_load.py)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def build_model(
    arch: LlamaArchConfig,
    weights: WeightSource,
    dtype: torch.dtype,
    device: str,
    quantization: str = "none",
    share: Optional[RankShare] = None,
    gemm_isa: str = "auto",
) -> LlamaForCausalLM:
    """The model (this rank's share of it) with the checkpoint's weights, ready to serve; its
    bfloat16 linears packed for the config's gemm_isa path (kernels/gemm.py)."""
    share = share or RankShare()
    check_checkpoint(arch, weights)
    if share.world_size > 1:
        check_divisible(arch, share.world_size)
    # Built on the meta device, so no time goes into an init that the checkpoint overwrites.
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    builder = _Builder(arch, weights, dtype, device, quantization == "int8", share)
    gemm_path = gemm.resolve_isa(gemm_isa)
    builder.embeddings_(model)
    for index, layer in enumerate(model.model.layers):
        builder.layer_(index, layer)
        gemm.pack_linears_(layer, dtype, gemm_path)  # one layer's packing in flight at a time
        _return_freed_memory()
    model.model.norm.weight = builder.parameter("model.norm.weight")
    left = [
        name
        for name, t in list(model.named_parameters()) + list(model.named_buffers())
        if t.is_meta
    ]
    if left:
        raise ValueError(f"model: no checkpoint tensor filled {left}")
    model = model.eval().requires_grad_(False)
    if share.world_size > 1:
        wrap_parallel_(model, share)
    gemm.pack_linears_(
        model, dtype, gemm_path
    )  # bfloat16 on the CPU: the native GEMMs' packed weights
    _return_freed_memory()
    return model
