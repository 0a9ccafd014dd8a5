"""One PEFT LoRA folder read and checked: adapter_config.json, then adapter_model.safetensors
tensor by tensor (safetensors' safe_open: every name and shape is checked from the header before
any tensor is read). Nothing is kept unless the whole adapter is: the caller gets a complete
`Adapter` or an AdapterError, never part of one.

What is refused, each naming the config key or tensor: a pickled adapter_model.bin (only
safetensors are read), r above --max-lora-rank, targets the model lacks (embed_tokens and lm_head
included), and the PEFT features the computation does not implement (DoRA, modules_to_save,
per-module rank/alpha patterns, biases). use_rslora is honoured: scale = alpha / sqrt(r), else
alpha / r; lora_dropout does nothing at inference.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Optional, cast

import torch
from torch import nn
from torch.nn import functional as F

from model_service.kernels.gemm import PackedLinear
from model_service.lora.targets import (
    FUSED_MODULES,
    REFUSED_MODULES,
    TARGET_MODULES,
    ModelTargets,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILE = "adapter_model.bin"

# PEFT settings the computation does not implement: each must be unset, false or empty.
_NOT_SERVED = {
    "use_dora": "DoRA adapters are not served",
    "modules_to_save": "full copies of modules are not served",
    "rank_pattern": "per-module ranks are not served",
    "alpha_pattern": "per-module alphas are not served",
    "lora_bias": "LoRA biases are not served",
    "fan_in_fan_out": "transposed (Conv1D) weights are not served",
    "layer_replication": "replicated layers are not served",
    "target_parameters": "adapted parameters (not modules) are not served",
    "trainable_token_indices": "trained token embeddings are not served",
    "alora_invocation_tokens": "activated LoRA is not served",
    "use_qalora": "QA-LoRA is not served",
}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_PARENT = {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class AdapterError(Exception):
    """A refused load or evict; `code` is the gRPC status's name (the server maps it)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class WeightLinear(nn.Module):
    """x @ weight.T: one LoRA factor, a module so that its GEMM goes through layer_ops.linear
    (which keeps torch's GEMMs batch-invariant)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


@dataclasses.dataclass
class LoraPair:
    """One target of one layer: output columns [start, end) of its fused module get
    scale * B(A(x))."""

    target: str
    start: int
    end: int
    a: nn.Module  # [r, in]: a WeightLinear, or a PackedLinear where the model's GEMMs are packed
    b: nn.Module  # [out, r]


@dataclasses.dataclass
class Adapter:
    """A loaded adapter. `layers[i][fused]` lists the pairs of layer i's fused module (empty
    where it is not adapted); `layers` is empty where the model holds no weights (null model)."""

    lora_id: int
    name: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    num_bytes: int
    layers: list[dict[str, list[LoraPair]]]


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scale: float


def read_adapter(
    lora_id: int,
    name: str,
    folder: str,
    max_rank: int,
    targets: Optional[ModelTargets],
    dtype: torch.dtype,
    device: torch.device,
    gemm_isa: Optional[str] = None,
) -> Adapter:
    """The adapter in `folder`, its weights in `dtype` on `device`; AdapterError names what is
    refused. `targets` None: check the folder, keep no weights (a model without layers).
    `gemm_isa`: the path the model's packed linears run (bf16 on the CPU), for which the factors
    are packed too (the native GEMM: fast for these few-row products, batch-invariant by
    construction); None keeps them dense for torch's GEMM."""
    if not os.path.isdir(folder):
        raise AdapterError("NOT_FOUND", f"lora_path: {folder!r} is not a folder")
    config = read_config(os.path.join(folder, CONFIG_FILE), max_rank)
    weights = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(folder, PICKLED_FILE)):
            raise AdapterError(
                "INVALID_ARGUMENT",
                f"{PICKLED_FILE}: pickled weights are not read; save the adapter as "
                f"{WEIGHTS_FILE} (PEFT's save_pretrained with safe_serialization=True)",
            )
        raise AdapterError("NOT_FOUND", f"lora_path: {folder!r} holds no {WEIGHTS_FILE}")
    layers, found, num_bytes = _read_weights(weights, config.rank, targets, dtype, device, gemm_isa)
    ordered = tuple(t for t in TARGET_MODULES if t in found)
    return Adapter(lora_id, name, config.rank, config.scale, ordered, num_bytes, layers)


def read_config(path: str, max_rank: int) -> AdapterConfig:
    """adapter_config.json's rank and scale, once every key the computation depends on passed."""
    if not os.path.isfile(path):
        raise AdapterError(
            "NOT_FOUND", f"lora_path: {os.path.dirname(path)!r} holds no {CONFIG_FILE}"
        )
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as error:
        raise AdapterError("INVALID_ARGUMENT", f"{CONFIG_FILE}: unreadable ({error})") from None
    if not isinstance(config, dict):
        raise AdapterError("INVALID_ARGUMENT", f"{CONFIG_FILE}: not a JSON object")
    invalid = _config_refusal(config, max_rank)
    if invalid is not None:
        raise AdapterError("INVALID_ARGUMENT", invalid)
    rank, alpha = config["r"], config.get("lora_alpha", 8)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, scale)


def _config_refusal(config: dict[str, Any], max_rank: int) -> Optional[str]:
    """Why the config is refused ("key: reason"), or None."""
    if config.get("peft_type", "LORA") != "LORA":
        return f"peft_type: {config['peft_type']!r} is not LORA"
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        return f"r: {rank!r} must be an integer >= 1"
    if rank > max_rank:
        return f"r: {rank} exceeds --max-lora-rank {max_rank}"
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        return f"lora_alpha: {alpha!r} must be a number"
    for key, why in _NOT_SERVED.items():
        if config.get(key):
            return f"{key}: {config[key]!r}: {why}"
    if config.get("bias", "none") != "none":
        return f"bias: {config['bias']!r}: only 'none' is served (biases are not)"
    listed = config.get("target_modules")
    names = ", ".join(TARGET_MODULES)
    if isinstance(listed, list):
        for module in listed:
            if module in REFUSED_MODULES:
                return f"target_modules: {module!r} is not adapted (only {names})"
            if module not in TARGET_MODULES:
                return f"target_modules: {module!r} is not a module of the model ({names})"
    return None


def _read_weights(
    path: str,
    rank: int,
    targets: Optional[ModelTargets],
    dtype: torch.dtype,
    device: torch.device,
    gemm_isa: Optional[str] = None,
) -> tuple[list[dict[str, list[LoraPair]]], set[str], int]:
    """Every A/B pair of the file: names and shapes checked from the header first, then each
    tensor read by itself."""
    from safetensors import safe_open

    try:
        handle = safe_open(path, framework="pt")
    except Exception as error:  # a truncated or foreign file: safetensors' own error types
        raise AdapterError("INVALID_ARGUMENT", f"{WEIGHTS_FILE}: unreadable ({error})") from None
    with handle as f:
        pairs = _check_header(f, rank, targets)
        if targets is None:
            return [], {target for _, target in pairs}, 0
        layers: list[dict[str, list[LoraPair]]] = [
            {m: [] for m in FUSED_MODULES} for _ in range(targets.num_layers)
        ]
        num_bytes = 0
        order = sorted(pairs, key=lambda place: (place[0], TARGET_MODULES.index(place[1])))
        for layer, target in order:  # each fused module's pairs in column order
            key_a, key_b = pairs[(layer, target)]
            a = f.get_tensor(key_a).to(device=device, dtype=dtype).contiguous()
            b = f.get_tensor(key_b).to(device=device, dtype=dtype).contiguous()
            place = targets.slices[target]
            layers[layer][place.fused].append(
                LoraPair(target, place.start, place.end, WeightLinear(a), WeightLinear(b))
            )
    for modules in layers:
        for fused, module_pairs in modules.items():
            modules[fused] = [_packed(p, gemm_isa) for p in fuse_pairs(module_pairs)]
            num_bytes += sum(_stored_bytes(p.a) + _stored_bytes(p.b) for p in modules[fused])
    return layers, {target for _, target in pairs}, num_bytes


def _packed(pair: LoraPair, gemm_isa: Optional[str]) -> LoraPair:
    """The pair with each factor packed for the native GEMM where it takes it (as
    gemm.packable: bfloat16 on the CPU, an even input size)."""
    if gemm_isa is None:
        return pair
    factors = []
    for factor in (pair.a, pair.b):
        weight = _weight(factor)
        native = (
            weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
            and weight.shape[1] % 2 == 0
        )
        # PackedLinear reads weight (and a bias, none here) off its source, as off an nn.Linear.
        factors.append(PackedLinear(cast(nn.Linear, factor), gemm_isa) if native else factor)
    return dataclasses.replace(pair, a=factors[0], b=factors[1])


def _weight(factor: nn.Module) -> torch.Tensor:
    """A factor's dense weight [out, in] (a PackedLinear unpacks a copy)."""
    weight = factor.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _stored_bytes(factor: nn.Module) -> int:
    packed = getattr(factor, "packed", None)
    return int(packed.nbytes) if packed is not None else int(_weight(factor).nbytes)


def fuse_pairs(pairs: list[LoraPair]) -> list[LoraPair]:
    """The targets of one fused module (in column order) as one pair: A stacked [sum r, in], B
    block-diagonal over their columns [end - start, sum r] (zeros elsewhere, which add exact
    zeros), so a group pays one shrink, one expand and one indexed add per fused module instead
    of one per target."""
    if len(pairs) < 2:
        return pairs
    start, end = pairs[0].start, pairs[-1].end
    a = torch.cat([_weight(p.a) for p in pairs])
    b = a.new_zeros((end - start, a.shape[0]))
    column = 0
    for p in pairs:
        rank = _weight(p.a).shape[0]
        b[p.start - start : p.end - start, column : column + rank] = _weight(p.b)
        column += rank
    target = "+".join(p.target for p in pairs)
    return [LoraPair(target, start, end, WeightLinear(a), WeightLinear(b))]


def _check_header(
    f, rank: int, targets: Optional[ModelTargets]
) -> dict[tuple[int, str], tuple[str, str]]:
    """{(layer, target): (A's key, B's key)}, every key and shape checked (no tensor read)."""
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for key in f.keys():
        layer, target, half = _parse_key(key, targets)
        shape = list(f.get_slice(key).get_shape())
        expected = _expected_shape(half, rank, target, targets, shape)
        if shape != expected:
            raise AdapterError(
                "INVALID_ARGUMENT", f"{key}: shape {shape} does not match the model's {expected}"
            )
        halves.setdefault((layer, target), {})[half] = key
    if not halves:
        raise AdapterError("INVALID_ARGUMENT", f"{WEIGHTS_FILE}: holds no LoRA weights")
    for found in halves.values():
        if len(found) != 2:
            key = next(iter(found.values()))
            missing = "lora_B" if "A" in found else "lora_A"
            raise AdapterError("INVALID_ARGUMENT", f"{key}: its {missing} weight is missing")
    return {place: (found["A"], found["B"]) for place, found in halves.items()}


def _parse_key(key: str, targets: Optional[ModelTargets]) -> tuple[int, str, str]:
    match = _KEY.match(key)
    if match is None:
        refused = next((m for m in REFUSED_MODULES if f".{m}." in key), None)
        why = f"targets {refused}, which is not adapted" if refused else "not a LoRA A/B weight"
        raise AdapterError(
            "INVALID_ARGUMENT",
            f"{key}: {why} (adapters may target {', '.join(TARGET_MODULES)} of the layers)",
        )
    layer, parent, target, half = int(match[1]), match[2], match[3], match[4]
    if target not in TARGET_MODULES or _PARENT.get(target, "self_attn") != parent:
        raise AdapterError(
            "INVALID_ARGUMENT",
            f"{key}: {parent}.{target} is not a module of the model ({', '.join(TARGET_MODULES)})",
        )
    if targets is not None and layer >= targets.num_layers:
        raise AdapterError(
            "INVALID_ARGUMENT", f"{key}: layer {layer} is beyond the model's {targets.num_layers}"
        )
    return layer, target, half


def _expected_shape(
    half: str, rank: int, target: str, targets: Optional[ModelTargets], shape: list[int]
) -> list[int]:
    """[r, in] for A, [out, r] for B; a model without layers checks the rank only."""
    if targets is None:
        return (
            [rank, shape[1] if len(shape) == 2 else -1]
            if half == "A"
            else [shape[0] if shape else -1, rank]
        )
    place = targets.slices[target]
    return [rank, place.in_features] if half == "A" else [place.out_features, rank]
