"""Batched sampling on the model's device: greedy, temperature, top-k, top-p; seeded.

Reproducibility rule (common.proto SamplingParams.seed): the draw for a token depends only on
(seed, position). Each row gets ONE uniform u in [0, 1), computed on the host by a counter-based
hash (splitmix64 of the seed, mixed with the position, splitmix64 again), and the token is picked
by inverse CDF over the filtered, renormalized probabilities taken in vocab order. Nothing depends
on which other rows share the batch, on a stateful RNG, or on how often a sequence was preempted.

Rows carry their own parameters; everything is vectorized over rows:
    temperature == 0    greedy (argmax), u unused
    top_k == 0          top-k off
    top_p == 1.0        top-p off
    min_p == 0.0        min-p off (keep tokens with probability >= min_p * the largest)
Penalties, logit bias, min-token suppression and grammar masks change the logits before this
(model_service/step/logits.py).

Where: float32 logits on CUDA with Triton present go to one fused kernel
(model_service/kernels/triton_sample.py: the same rule, sums in another order, no host sync);
everywhere else, and as that kernel's reference, the torch path below (`torch_sample`).
`device_path` says which for Describe's compute["sampler"].
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from model_service.kernels import triton_sample

TRITON = "triton"
TORCH = "torch"
TRITON_DEVICE = "cuda"  # where the kernel runs (the interpreter's tests point it at "cpu")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def on_device(device: torch.device, array: np.ndarray) -> torch.Tensor:
    """A small host array on `device`. On CUDA through pinned memory (torch's caching host
    allocator keeps it until the copy is done): a copy from pageable memory may wait for the
    stream, and a step launched ahead (step/launch_ahead.py) samples while another runs."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 step applied elementwise to a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def uniform_for(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One float64 uniform in [0, 1) per (seed, position), from the top 53 bits of the hash."""
    h = splitmix64(splitmix64(seeds.astype(np.uint64)) ^ positions.astype(np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclasses.dataclass
class SamplingBatch:
    """Per-row parameters, host arrays of length R."""

    temperature: np.ndarray  # float32
    top_k: np.ndarray  # int64, 0 = off
    top_p: np.ndarray  # float32, 1.0 = off
    seed: np.ndarray  # uint64
    position: np.ndarray  # int64, position of the token being drawn
    min_p: np.ndarray | None = None  # float32, 0 = off; None = off for every row

    def rows(self, index: np.ndarray) -> "SamplingBatch":
        """The parameters of rows `index` only."""
        return SamplingBatch(
            temperature=self.temperature[index],
            top_k=self.top_k[index],
            top_p=self.top_p[index],
            seed=self.seed[index],
            position=self.position[index],
            min_p=None if self.min_p is None else self.min_p[index],
        )


def sample(logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """logits [R, V] float32 -> token ids [R] int64 (on the logits' device)."""
    if not (params.temperature > 0).any():  # every row greedy: one argmax, no parameters to copy
        return argmax_rows(logits)
    if _kernel_unsupported(logits) is None:
        packed = on_device(logits.device, kernel_params(params, logits.shape[-1]))
        return triton_sample.sample(logits, packed)
    return torch_sample(logits, params)


def device_path(device: torch.device) -> str:
    """The path sample() takes for a model's float32 logits on `device`, for Describe's
    `compute`: "triton", or "torch (why)"."""
    reason = _kernel_unsupported(torch.empty((0, 1), dtype=torch.float32, device=device))
    return TRITON if reason is None else f"{TORCH} ({reason})"


def _kernel_unsupported(logits: torch.Tensor) -> str | None:
    """Why sample() runs the torch path on these logits, or None where it runs the kernel."""
    if logits.device.type != TRITON_DEVICE:
        return f"device {logits.device.type}"
    return triton_sample.unsupported_reason(logits)


def kernel_params(params: SamplingBatch, vocab: int) -> np.ndarray:
    """The kernel's per-row parameters, [R, 5] float64 (triton_sample.PARAMS): every value the
    torch path reads, exactly (float32 and the clipped top_k are float64 values), and each row's
    uniform, so that one copy takes them to the device."""
    packed = np.empty((params.temperature.shape[0], len(triton_sample.PARAMS)), dtype=np.float64)
    packed[:, 0] = params.temperature
    packed[:, 1] = np.where((params.top_k > 0) & (params.top_k < vocab), params.top_k, 0)
    packed[:, 2] = params.top_p
    packed[:, 3] = 0.0 if params.min_p is None else params.min_p
    packed[:, 4] = uniform_for(params.seed, params.position)
    return packed


def torch_sample(logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """sample() in torch ops: any device, and the kernel's reference."""
    device = logits.device
    greedy_ids = argmax_rows(logits)
    random_rows = (params.temperature > 0).nonzero()[0]
    if not random_rows.size:
        return greedy_ids
    # Only the rows that draw compute a distribution (each row's by itself: batch-invariant).
    index = on_device(device, random_rows)
    drawing = params.rows(random_rows)
    filtered = filtered_probs(logits.index_select(0, index), drawing)
    drawn = draw(filtered, uniform_for(drawing.seed, drawing.position))
    return greedy_ids.index_copy(0, index, drawn)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest logit, the first of equal ones (a NaN counts as largest),
    int64. Float32 logits on the CPU go through numpy's argmax: the same index, and several times
    less host time than torch's CPU reduction over a vocabulary row (docs/benchmarks.md)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def filtered_probs(logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """The distribution each row samples from, float64 [R, V], unnormalized: softmax at the row's
    temperature (greedy rows at 1.0), then top-k, top-p and min-p zero what they drop."""
    device = logits.device
    random_rows = params.temperature > 0
    temperature = on_device(
        device, np.where(random_rows, params.temperature, 1.0).astype(np.float32)
    )
    # float64 from here: the filtered CDF must be the same function of one row's logits whatever
    # the batch, and accurate enough that u * total never lands on a zero-probability step.
    probs = torch.softmax(logits.double() / temperature[:, None].double(), dim=-1)
    vocab = probs.shape[-1]
    # Rows without top-k or top-p keep every token (threshold 0, whatever the other rows ask):
    # when no row filters, the vocabulary sort, most of a sampled step's cost, is skipped.
    k_off = (params.top_k <= 0) | (params.top_k >= vocab)
    p_off = params.top_p >= 1.0
    if (k_off & p_off).all():
        threshold = torch.zeros((probs.shape[0], 1), dtype=probs.dtype, device=device)
        return _min_p_filter(probs, threshold, params, probs.amax(dim=-1))

    sorted_probs = _sorted_head(probs, params, k_off, p_off)
    # top-k: keep probabilities >= the k-th largest (k = vocab when off: 1 is gathered, unused).
    k = np.where(~k_off, np.minimum(params.top_k, vocab), 1).astype(np.int64)
    kth = sorted_probs.gather(1, on_device(device, k - 1)[:, None])
    kth = torch.where(on_device(device, k_off)[:, None], 0.0, kth)
    # top-p: keep the smallest prefix of the sorted list whose mass reaches top_p, i.e. every token
    # whose preceding mass is still below top_p; its smallest member is the threshold.
    top_p = on_device(device, params.top_p.astype(np.float64))
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    num_kept = (before < top_p[:, None]).sum(dim=-1).clamp(min=1)
    pth = sorted_probs.gather(1, (num_kept - 1)[:, None])
    pth = torch.where(on_device(device, p_off)[:, None], 0.0, pth)
    return _min_p_filter(probs, torch.maximum(kth, pth), params, sorted_probs[:, 0])


# Tokens the thresholds are first looked for among: the largest probabilities, by topk instead
# of a sort of the whole vocabulary (most of a sampled step's cost on a CPU: docs/benchmarks.md).
_HEAD = 1024


def _sorted_head(
    probs: torch.Tensor, params: SamplingBatch, k_off: np.ndarray, p_off: np.ndarray
) -> torch.Tensor:
    """The leading columns of probs sorted descending, enough of them for every row's top-k and
    top-p threshold: the same values, bit for bit, as those columns of the full sort, so the
    thresholds are too (topk's values are the sort's; cumsum is a running sum, the same for a
    prefix). Enough means k within the head where top-k is on, and where top-p is on a head mass
    at least top_p + 1e-9: every later token's preceding mass is then at least the head's less a
    few ulps, never under top_p, so none of them counts. Else the whole vocabulary is sorted."""
    vocab = probs.shape[-1]
    head = min(vocab, max(_HEAD, int(np.max(np.where(k_off, 0, params.top_k)))))
    if head < vocab and probs.device.type == "cpu":  # a GPU sorts fast; no host sync there
        values = probs.topk(head, dim=-1).values
        mass = values.sum(dim=-1).cpu().numpy()  # a bound check only: the thresholds use cumsum
        covered = p_off | (mass >= params.top_p.astype(np.float64) + 1e-9)
        if covered.all():
            return values
    return probs.sort(dim=-1, descending=True).values


def _min_p_filter(
    probs: torch.Tensor, threshold: torch.Tensor, params: SamplingBatch, top: torch.Tensor
) -> torch.Tensor:
    """probs with everything below the row's threshold (raised to min_p x its largest
    probability `top`, where min_p is set) zeroed."""
    if params.min_p is not None and params.min_p.any():
        min_p = on_device(probs.device, params.min_p.astype(np.float64))
        threshold = torch.maximum(threshold, (min_p * top)[:, None])
    return torch.where(probs >= threshold, probs, 0.0)


def draw(weights: torch.Tensor, u: np.ndarray) -> torch.Tensor:
    """Inverse CDF in vocab order: one token per row of nonnegative weights [R, V] (unnormalized,
    float64) for uniforms u [R] in [0, 1); never a zero-weight token."""
    vocab = weights.shape[-1]
    cdf = weights.cumsum(dim=-1)
    target = on_device(weights.device, u)[:, None] * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # If rounding made target reach the total, searchsorted runs off the end; the last kept token
    # is the right answer then (never a filtered-out one).
    last_kept = vocab - 1 - (weights > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(drawn, last_kept)
