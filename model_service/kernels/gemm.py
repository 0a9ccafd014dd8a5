"""The decoder's GEMMs on prepacked weights (cython_ext/gemm.pyx over cython_ext/csrc/gemm*).

torch's bfloat16 GEMM (oneDNN) reads a weight at a third of the memory bandwidth when a decode step
has few rows (bench/bench_forward.py), and picks other kernels, with another summation order, for
other row counts. `PackedLinear` packs each weight once at load into 16-column panels of column
pairs and multiplies it with one native kernel for every row count: each output element is one
float32 sum from zero over the input pairs in order, rounded once (csrc/gemm.h). That makes a row's
bits independent of the rows beside it by construction (the batch-invariance rule) and reads the
weight once per step, whatever the batch. int8 (quant.py's blocks of 32) keeps its int8 values
and scales; the kernel quantizes each row of x per block of 32 to int16 and takes exact integer
block dot products (VPDPWSSD, or vpmaddwd), so the weight is never widened to bf16 in memory
(csrc/gemm.h).

The paths (cython_ext.gemm.ISAS): avx512_bf16 (VDPBF16PS); avx512 and avx2, which widen the bf16
weight to float32 in registers and multiply with FMA (csrc/gemm_vec_impl.h: half the bytes of a
float32 weight read); portable (scalar, for checks). The path is the config's gemm_isa (auto,
torch, or one of ISAS), applied when the loader packs a bfloat16 model; auto takes the fastest the
CPU runs (avx512_bf16, then avx512, then avx2: docs/benchmarks.md) and torch's GEMM on CPUs with
none of them. float32 models, other devices and tensor-parallel layers stay on torch, with
layer_ops.linear's padding.
"""

from __future__ import annotations

import torch
from torch import nn

from cython_ext import gemm as native
from model_service.kernels import kernel_isa
from model_service.kernels.quant import Int8Linear

TORCH_PATH = kernel_isa.TORCH_PATH


def resolve_isa(name: str = "auto") -> str:
    """The path gemm_isa `name` runs on this CPU ("auto": the best)."""
    return kernel_isa.resolve_isa(native, "gemm_isa", name)


class PackedLinear(nn.Module):
    """A bfloat16 or int8 linear layer (no float weight kept) whose weight is packed for the native
    kernel. `weight` unpacks a dense copy (for checks); the state dict carries the dense weight."""

    packed: torch.Tensor  # buffers, declared for the type checker (nn.Module's getattr is untyped)
    bias: torch.Tensor | None

    def __init__(self, source: nn.Linear | Int8Linear, isa: str) -> None:
        super().__init__()
        self.isa, self._isa_index = isa, native.ISAS.index(isa)
        if isinstance(source, Int8Linear):
            q, scale = source.w.qweight, source.w.scale.to(torch.float32).contiguous()
            n, k = int(q.shape[0]), int(q.shape[1])
            self.int8 = True
            packed = torch.empty(native.packed_int8_bytes(n, k), dtype=torch.uint8)
            native.pack_int8(q.contiguous().data_ptr(), scale.data_ptr(), n, k, packed.data_ptr())
        else:
            weight = source.weight.detach()
            n, k = int(weight.shape[0]), int(weight.shape[1])
            self.int8 = False
            packed = torch.empty(native.packed_bf16_elems(n, k), dtype=torch.bfloat16)
            native.pack_bf16(weight.data_ptr(), n, k, weight.stride(0), packed.data_ptr())
        self.out_features, self.in_features = n, k
        self.register_buffer("packed", packed)
        bias = getattr(source, "bias", None)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(torch.bfloat16).contiguous()
        )

    @property
    def weight(self) -> torch.Tensor:
        """The dense bfloat16 weight [out, in], unpacked (bf16 only: int8 keeps no dense form)."""
        if self.int8:
            raise AttributeError("an int8 PackedLinear has no dense weight")
        dense = torch.empty((self.out_features, self.in_features), dtype=torch.bfloat16)
        native.unpack_bf16(
            self.packed.data_ptr(), self.out_features, self.in_features, dense.data_ptr()
        )
        return dense

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # What a plain nn.Linear would save, so hf_state_dict and the parity checks see HF weights.
        if not self.int8:
            destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def forward(
        self,
        x: torch.Tensor,
        out_dtype: torch.dtype = torch.bfloat16,
        threads: int | None = None,
    ) -> torch.Tensor:
        """x @ W^T in bf16, or in float32 (the kernel's sums unrounded: lm_head's logits).
        threads: how many run it (torch's count by default; the split changes no element)."""
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(
                f"PackedLinear: out_dtype must be bfloat16 or float32, got {out_dtype}"
            )
        if (
            x.dtype != torch.bfloat16
            or x.dim() != 2
            or x.shape[1] != self.in_features
            or x.stride(1) != 1
        ):
            raise ValueError(
                f"PackedLinear: x must be bfloat16 [T, {self.in_features}] with dense rows, got "
                f"{x.dtype} {tuple(x.shape)} strides {x.stride()}"
            )
        rows = x.shape[0]
        out = x.new_empty((rows, self.out_features), dtype=out_dtype)
        if rows:
            call = native.linear_int8 if self.int8 else native.linear_bf16
            call(
                x.data_ptr(),
                rows,
                x.stride(0),
                self.packed.data_ptr(),
                self.out_features,
                self.in_features,
                0 if self.bias is None else self.bias.data_ptr(),
                out.data_ptr(),
                self.out_features,
                out_dtype == torch.float32,
                self._isa_index,
                torch.get_num_threads() if threads is None else threads,
            )
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int8={self.int8}, isa={self.isa}"
        )


class PackedEmbedding(nn.Module):
    """The token embedding of a model whose lm_head is tied to it, read from the lm_head's packed
    weight: the model keeps one copy of the matrix (SmolLM2: 56 MB; a tied 128k-vocab 1B model:
    ~0.5 GB). The same bf16 values as the dense embedding, row for row."""

    def __init__(self, lm_head: PackedLinear) -> None:
        super().__init__()
        self.lm_head = [
            lm_head
        ]  # a list: not a submodule, so its weight is not saved twice under this name

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.lm_head[0].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.lm_head[0]
        ids = ids.to(torch.int64).contiguous()  # as nn.Embedding, int32 ids too
        out = torch.empty((*ids.shape, head.in_features), dtype=torch.bfloat16)
        native.gather_rows_bf16(
            head.packed.data_ptr(),
            head.out_features,
            head.in_features,
            ids.data_ptr(),
            ids.numel(),
            out.data_ptr(),
        )
        return out


def packable(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the native kernel takes this layer: bfloat16 compute on the CPU, an nn.Linear with
    an even input size or an Int8Linear with a multiple of 32."""
    if dtype != torch.bfloat16:
        return False
    if isinstance(module, Int8Linear):
        q = module.w.qweight
        return q.device.type == "cpu" and q.shape[1] % 32 == 0
    return (
        type(module) is nn.Linear
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.bfloat16
        and module.in_features % 2 == 0
    )


def pack_linears_(model: nn.Module, dtype: torch.dtype, isa: str) -> int:
    """Replace, in place, every nn.Linear / Int8Linear the kernel takes by a PackedLinear for
    path `isa` (resolved: resolve_isa). Returns how many were packed (0 where the path is
    torch's)."""
    if isa == TORCH_PATH:
        return 0
    # Names, not module objects: a list of the modules would keep every unpacked weight alive until
    # the loop ends (twice the model's weights at the peak); this way each is freed once replaced.
    embeddings = {
        id(m.weight): name for name, m in model.named_modules() if type(m) is nn.Embedding
    }
    names = [name for name, module in model.named_modules() if packable(module, dtype)]
    count = 0
    for name in names:
        module = model.get_submodule(name)
        assert isinstance(module, (nn.Linear, Int8Linear))  # packable() said so
        tied = embeddings.get(id(getattr(module, "weight", None)))
        packed = PackedLinear(module, isa)
        model.set_submodule(name, packed)
        del module
        count += 1
        if tied is not None and not packed.int8:
            model.set_submodule(tied, PackedEmbedding(packed))  # one copy of a tied matrix
    return count
