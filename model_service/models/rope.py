"""Rotary position embeddings: the frequencies of each rope type, as transformers computes them.

A checkpoint's RoPE is a base `theta` plus, optionally, a scaling that stretches it past the
length the model was pretrained at. The forward only ever needs the float32 table of cos and sin
per position (layer_ops.rope_table's layout); this module turns the config's facts into it:

    default    inv_freq[i] = 1 / theta ** (2i / d)                      (d = head_dim, i < d / 2)
    linear     inv_freq / factor                                         (position interpolation)
    dynamic    default up to max_position_embeddings (see below)
    llama3     low frequencies / factor, high kept, a smooth blend between (Llama 3.1+)
    yarn       per-frequency blend of interpolation and extrapolation, and cos/sin scaled by an
               attention factor (YaRN; Qwen, DeepSeek long-context configs)
    freq_factors  inv_freq / factor[i], one factor per frequency (a GGUF's `rope_freqs` tensor:
               llama.cpp's converter writes the llama3 scaling that way)

"dynamic" NTK scaling re-derives theta from the current sequence length once it passes
max_position_embeddings; transformers then rotates new keys with other frequencies than the
cached ones, so no fixed table reproduces it. Up to max_position_embeddings it is exactly the
default, so the loader caps a dynamic model's max_model_len there (hf_folder.py says so).

Reading the config: Llama 3.x and older files write `rope_scaling` with a top-level `rope_theta`;
transformers 5 writes `rope_parameters` holding `rope_theta` and the scaling keys together.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """The facts of one rope type (Hugging Face names); only those of `rope_type` are used."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: Optional[float] = None  # yarn: None derives it from factor (and mscale)
    mscale: Optional[float] = None  # yarn
    mscale_all_dim: Optional[float] = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    freq_factors: Optional[tuple[float, ...]] = None  # a GGUF's rope_freqs, one per frequency


def rope_from_config(
    config: dict[str, Any], max_position_embeddings: int
) -> tuple[float, RopeScaling]:
    """(theta, scaling) from a config.json; ValueError naming the key and value we cannot honour."""
    scaling_key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    if config.get("rope_parameters") and config.get("rope_scaling"):
        legacy = {k: v for k, v in config["rope_scaling"].items() if k != "rope_theta"}
        if legacy != {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}:
            raise ValueError(
                "model: config.json has both rope_parameters and rope_scaling, and they differ"
            )
    options = dict(config.get(scaling_key) or {})
    theta = float(options.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = options.pop("rope_type", options.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"model: config.json {scaling_key} rope_type {rope_type!r} is not supported (one of "
            f"{ROPE_TYPES})"
        )
    if float(options.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(
            f"model: config.json partial_rotary_factor {config.get('partial_rotary_factor')!r} is "
            "not "
            "supported (only 1.0: every dimension rotated)"
        )
    if rope_type == "default":
        return theta, RopeScaling()
    fields = {f.name for f in dataclasses.fields(RopeScaling)} - {"rope_type", "freq_factors"}
    values = {key: value for key, value in options.items() if key in fields and value is not None}
    if rope_type in ("llama3", "yarn"):
        # transformers falls back to max_position_embeddings when the file does not say
        values.setdefault(
            "original_max_position_embeddings",
            config.get("original_max_position_embeddings", max_position_embeddings),
        )
    if rope_type == "yarn" and "factor" not in values:
        values["factor"] = max_position_embeddings / values["original_max_position_embeddings"]
    if "factor" not in values:
        raise ValueError(f"model: config.json {scaling_key} rope_type {rope_type!r} needs a factor")
    try:
        scaling = RopeScaling(rope_type=rope_type, **{k: _typed(k, v) for k, v in values.items()})
    except (TypeError, ValueError) as error:
        raise ValueError(f"model: config.json {scaling_key}: {error}") from None
    if scaling.factor <= 0:
        raise ValueError(f"model: config.json {scaling_key} factor {scaling.factor} must be > 0")
    return theta, scaling


def _typed(key: str, value: Any) -> Any:
    if key in ("original_max_position_embeddings",):
        return int(value)
    if key == "truncate":
        return bool(value)
    return float(value)


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling
) -> tuple[torch.Tensor, float]:
    """float32 inv_freq [head_dim / 2] and the factor cos and sin are multiplied by."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    kind = scaling.rope_type
    if scaling.freq_factors is not None:
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"model: rope_freqs has {factors.numel()} factors, head_dim {head_dim} needs "
                f"{inv_freq.numel()}"
            )
        return inv_freq / factors, 1.0
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise ValueError(f"model: rope_type {kind!r} is not one of {ROPE_TYPES}")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Wavelengths longer than original / low_freq_factor are divided by factor, shorter than
    original / high_freq_factor kept, and those between blended linearly in original /
    wavelength."""
    original = s.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    between = (wavelength >= original / s.high_freq_factor) & (
        wavelength <= original / s.low_freq_factor
    )
    return torch.where(between, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """Frequencies that rotate fewer than beta_slow times over the original length are
    interpolated (/ factor), more than beta_fast times extrapolated (kept), a linear ramp
    between."""
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention = _yarn_mscale(s.factor)

    def dimension_of(rotations: float) -> float:
        return (
            dim
            * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = dimension_of(s.beta_fast), dimension_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    positions = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolated, interpolated = 1.0 / positions, 1.0 / (s.factor * positions)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def rope_table(
    positions: int,
    head_dim: int,
    theta: float,
    scaling: RopeScaling = RopeScaling(),
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """float32 [positions, head_dim]: cos of each position's head_dim / 2 frequencies, then sin
    (each times the rope type's attention factor), as transformers computes them."""
    inv_freq, attention = inverse_frequencies(head_dim, theta, scaling)
    freqs = (
        torch.arange(positions, dtype=torch.int64).to(torch.float32)[:, None] * inv_freq[None, :]
    )
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    if attention != 1.0:
        table = table * attention
    return table.contiguous().to(device)
