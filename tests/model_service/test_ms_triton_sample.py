"""The sampler's fused Triton kernel (model_service/kernels/triton_sample.py) and where
sampler.sample runs it.

Without a GPU the kernel's own code runs under Triton's interpreter (numpy, on CPU tensors), in a
child process started by test_the_kernel_under_tritons_interpreter: Triton reads TRITON_INTERPRET
when it is imported, so it cannot be switched on inside this process. The child runs this file's
`interpreted` tests; here they are skipped. The `gpu` tests run the compiled kernel on CUDA.

The check. A float64 numpy reference states the rule (`reference_row`: softmax at the row's
temperature, top-k, top-p, min-p, inverse CDF in vocab order) and, per row, its margin: how close
any decision that sums taken in another order could flip came to its bound (u * total to a CDF
step, relative to the total; a top-p prefix mass to top_p; a probability to min_p x the largest).
Every row's token must equal the reference's; a row may differ only where its margin is under
MARGIN, and such a row is returned by `check` and named by the test. Rows built to put u * total
on a CDF step (`on_a_step`) show the margin sees them; random rows, where a margin that small has
odds of about 1e-12 a row, must all match.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import numpy as np
import pytest
import torch
from interpreted_tests import INTERPRETED, run_interpreted

from model_service.kernels import triton_sample
from model_service.step import sampler
from model_service.step.sampler import SamplingBatch, kernel_params

HAS_CUDA = torch.cuda.is_available()
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the interpreter's child process (see the module docstring)"
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
MARGIN = 1e-12
INF = float("inf")


# The float64 reference.


def reference_row(x: np.ndarray, temperature, top_k, top_p, min_p, u) -> tuple[int, float]:
    """One row's token by the rule (sampler.py) in float64 numpy, and its margin (above)."""
    vocab = x.size
    if not temperature > 0:
        return int(np.argmax(x)), INF  # numpy's argmax: the first NaN, else the first largest
    if np.isnan(x).any() or np.isposinf(x).any() or np.isneginf(x).all():
        return vocab - 1, INF  # an undefined softmax: the torch path's arithmetic gives the last
    w, margin = kept_probs(x, temperature, top_k, top_p, min_p)
    cdf = np.cumsum(w)
    target = u * cdf[-1]
    kept = np.flatnonzero(w > 0)
    token = min(int(np.searchsorted(cdf, target, side="right")), int(kept[-1]))
    return token, min(margin, float(np.abs(cdf[kept] - target).min() / cdf[-1]))


def kept_probs(x: np.ndarray, temperature, top_k, top_p, min_p) -> tuple[np.ndarray, float]:
    """A row's probabilities, those that top-k, top-p and min-p drop zeroed, and the margin of
    its top-p and min-p decisions."""
    z = x.astype(np.float64) / np.float64(temperature)
    p = np.exp(z - z.max())
    p /= p.sum()
    ordered = np.sort(p)[::-1]
    threshold, margin = 0.0, INF
    if 0 < top_k < x.size:
        threshold = ordered[int(top_k) - 1]
    if not top_p >= 1.0:
        before = np.concatenate([[0.0], np.cumsum(ordered)[:-1]])  # the mass sorted before each
        kept = max(int((before < top_p).sum()), 1)
        threshold = max(threshold, ordered[kept - 1])
        margin = min(margin, float(np.abs(before - top_p).min()))
    if min_p > 0:
        threshold = max(threshold, min_p * p.max())
        margin = min(margin, float(np.abs(p - min_p * p.max()).min() / p.max()))
    return np.where(p >= threshold, p, 0.0), margin


def reference(logits: torch.Tensor, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = [reference_row(x, *p) for x, p in zip(logits.cpu().numpy(), packed)]
    return np.array([t for t, _ in rows]), np.array([m for _, m in rows])


def check(tokens: torch.Tensor, logits: torch.Tensor, packed: np.ndarray) -> dict[int, float]:
    """Asserts tokens [R] are the reference's but where a row's margin is under MARGIN; returns
    the rows that differ there, with their margins."""
    expected, margins = reference(logits, packed)
    got = tokens.cpu().numpy()
    differ = {int(r): float(margins[r]) for r in np.flatnonzero(got != expected)}
    wrong = {r: (int(got[r]), int(expected[r]), m) for r, m in differ.items() if m >= MARGIN}
    assert not wrong, f"rows (token, reference's, margin) away from any bound: {wrong}"
    return differ


# Inputs.

# (temperature, top_k, top_p, min_p, what the row's logits get) per row; "V" stands for the vocab.
MIXED = [
    (0.0, 0, 1.0, 0.0, ""), (1.0, 0, 1.0, 0.0, ""), (0.7, 0, 1.0, 0.0, ""),
    (1.8, 0, 1.0, 0.0, ""), (1.0, 1, 1.0, 0.0, ""), (1.0, 5, 1.0, 0.0, ""),
    (0.8, 50, 1.0, 0.0, ""), (1.0, 0, 0.9, 0.0, ""), (1.0, 0, 0.5, 0.0, ""),
    (1.0, 0, 1e-6, 0.0, ""), (0.8, 40, 0.9, 0.0, ""), (1.0, 3, 0.95, 0.0, ""),
    (1.0, 500, 0.3, 0.0, ""), (1.0, 0, 1.0, 0.05, ""), (1.3, 20, 0.8, 0.1, ""),
    (1.0, "V", 1.0, 0.0, ""), (1.0, "V+7", 0.9, 0.0, ""), (1.0, "V-1", 1.0, 0.0, ""),
    (1.0, 7, 0.6, 0.0, "ties"), (0.0, 0, 1.0, 0.0, "ties"), (1.0, 3, 1.0, 0.0, "zeros"),
    (1.0, 10, 1.0, 0.0, "5 finite"), (0.9, 0, 0.9, 0.0, "-inf half"), (1.0, 0, 1.0, 0.0, "-inf"),
    (0.0, 0, 1.0, 0.0, "-inf"), (1.0, 0, 0.9, 0.0, "nan"), (0.0, 0, 1.0, 0.0, "nan"),
    (1.0, 0, 1.0, 0.0, "+inf"), (1.0, 0, 1.0, 0.0, "on a step"), (1.0, 0, 0.7, 0.0, "on a step"),
]  # fmt: skip


_OFFSET = {"V": 0, "V+7": 7, "V-1": -1}  # MIXED's top_k relative to the vocab


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows from flat to peaked: normal logits, each row its own scale."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * (1 + 5 * torch.rand(rows, 1, generator=g))


def _special(x: torch.Tensor, what: str) -> None:
    if what == "ties":  # nine values, many tokens each: ties at every threshold
        x.copy_((x / x.abs().max() * 4).round())
    elif what == "zeros":  # +0 and -0 alike: top-k keeps them all
        x.fill_(-1.0)
        x[::2], x[1::2][:10] = 0.0, -0.0
    elif what == "5 finite":
        x[5:] = -INF
    elif what == "-inf half":
        x[::2] = -INF
    elif what == "-inf":
        x.fill_(-INF)
    elif what == "nan":
        x[[7, 3]] = float("nan")
    elif what == "+inf":
        x[11] = INF


def mixed_case(vocab: int, seed: int = 0) -> tuple[torch.Tensor, SamplingBatch]:
    logits = _logits(len(MIXED), vocab, seed)
    for x, row in zip(logits, MIXED):
        _special(x, row[4])
    k = [vocab + _OFFSET[r[1]] if isinstance(r[1], str) else r[1] for r in MIXED]
    batch = SamplingBatch(
        temperature=np.array([r[0] for r in MIXED], dtype=np.float32),
        top_k=np.array(k, dtype=np.int64),
        top_p=np.array([r[2] for r in MIXED], dtype=np.float32),
        seed=np.arange(len(MIXED), dtype=np.uint64) + 1000 * seed,
        position=np.arange(len(MIXED), dtype=np.int64) + 7,
        min_p=np.array([r[3] for r in MIXED], dtype=np.float32),
    )
    return logits, batch


def on_a_step(logits: torch.Tensor, packed: np.ndarray, rows: list[int]) -> None:
    """Sets u on `rows` so that u * total lands on the reference's CDF step at its middle kept
    token (a draw that another order of sums may take either side of)."""
    for r in rows:
        w, _ = kept_probs(logits[r].numpy(), *packed[r, :4])
        cdf = np.cumsum(w)
        kept = np.flatnonzero(w > 0)
        packed[r, 4] = cdf[kept[kept.size // 2]] / cdf[-1]


def random_case(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Random logits and parameters: each filter on in about half the rows."""
    rng = np.random.default_rng(seed)
    packed = np.zeros((rows, len(triton_sample.PARAMS)))
    packed[:, 0] = np.where(rng.random(rows) < 0.15, 0.0, rng.uniform(0.3, 1.5, rows))
    packed[:, 1] = np.where(rng.random(rows) < 0.5, rng.integers(1, 200, rows), 0)
    packed[:, 2] = np.where(rng.random(rows) < 0.5, rng.uniform(0.2, 0.99, rows), 1.0)
    packed[:, 3] = np.where(rng.random(rows) < 0.3, rng.uniform(0.0, 0.2, rows), 0.0)
    packed[:, :4] = packed[:, :4].astype(np.float32)  # the values a SamplingBatch holds
    packed[:, 4] = rng.random(rows)
    return _logits(rows, vocab, seed), packed


def run(logits: torch.Tensor, packed: np.ndarray, device: str) -> torch.Tensor:
    return triton_sample.sample(logits.to(device), torch.from_numpy(packed).to(device))


# Under the interpreter (the child process), then on CUDA.


def check_mixed(vocab: int, device: str) -> None:
    logits, batch = mixed_case(vocab)
    packed = kernel_params(batch, vocab)
    steps = [r for r, row in enumerate(MIXED) if row[4] == "on a step"]
    on_a_step(logits, packed, steps)
    _, margins = reference(logits, packed)
    assert (margins[steps] < MARGIN).all(), f"u * total should sit on a step: {margins[steps]}"
    differ = check(run(logits, packed, device), logits, packed)
    assert set(differ) <= set(steps), f"rows away from the built steps differ: {differ}"


def check_random(rows: int, vocab: int, seed: int, device: str) -> None:
    logits, packed = random_case(rows, vocab, seed)
    differ = check(run(logits, packed, device), logits, packed)
    assert not differ, f"random rows within {MARGIN} of a bound differ (odds ~1e-12): {differ}"


def check_batch_invariance(device: str) -> None:
    """A row alone equals the same row among 37 others, these lying apart (a row stride wider
    than the vocabulary)."""
    logits, packed = random_case(37, 1000, seed=5)
    packed[8:, 2] = 1.0  # top-p on in a few rows only: the interpreter's time
    wide = torch.full((37, 1100), 50.0, device=device)
    wide[:, :1000] = logits
    params = torch.from_numpy(packed).to(device)
    batch = triton_sample.sample(wide[:, :1000], params)
    for r in (0, 5, 17, 36):
        alone = triton_sample.sample(logits[r : r + 1].to(device), params[r : r + 1])
        assert torch.equal(alone, batch[r : r + 1])


def check_the_torch_path(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """sampler.sample (the kernel, on the logits' device) and sampler.torch_sample: row by row
    the same tokens, the reference's, but where its margin says the orders of sums may part."""
    assert sampler.device_path(logits.device) == "triton"
    ours, theirs = sampler.sample(logits, batch), sampler.torch_sample(logits, batch)
    packed = kernel_params(batch, logits.shape[1])
    assert not check(theirs, logits, packed) and not check(ours, logits, packed)
    _, margins = reference(logits, packed)
    differ = {int(r): float(margins[r]) for r in torch.nonzero(ours != theirs).flatten()}
    assert not differ, f"rows (and their margins) where the two paths differ: {differ}"


@interpreted
def test_mixed_rows_interpreted():
    check_mixed(1000, "cpu")


@interpreted
@pytest.mark.parametrize("rows, vocab, seed", [(16, 1000, 1), (12, 5000, 2), (3, 49152, 3)])
def test_random_rows_interpreted(rows, vocab, seed):
    check_random(rows, vocab, seed, "cpu")


@interpreted
def test_batch_invariance_interpreted():
    check_batch_invariance("cpu")


@interpreted
def test_the_gpus_block_sizes_interpreted(monkeypatch):
    """The radix passes in the GPU's small blocks (triton_sample.block_sizes), several a row."""
    sizes = triton_sample.block_sizes
    monkeypatch.setattr(triton_sample, "block_sizes", lambda vocab, on_gpu: sizes(vocab, True))
    check_mixed(1000, "cpu")


@interpreted
def test_the_torch_path_and_the_kernel_agree_interpreted(monkeypatch):
    monkeypatch.setattr(sampler, "TRITON_DEVICE", "cpu")
    check_the_torch_path(*mixed_case(2500, seed=9))


def test_the_kernel_under_tritons_interpreter():
    run_interpreted(__file__, " passed", 600, "-m", "not gpu")


# Where sample() runs it, and what it is given (no kernel runs here).


def test_kernel_params_are_the_torch_paths_values():
    logits, batch = mixed_case(1000)
    packed = kernel_params(batch, 1000)
    assert packed.dtype == np.float64 and packed.shape == (len(MIXED), len(triton_sample.PARAMS))
    assert np.array_equal(packed[:, 0], batch.temperature.astype(np.float64))
    assert np.array_equal(packed[:, 2], batch.top_p.astype(np.float64))
    assert np.array_equal(packed[:, 3], batch.min_p.astype(np.float64))
    k_off = (batch.top_k <= 0) | (batch.top_k >= 1000)  # "V" and "V+7" rows: off
    assert np.array_equal(packed[:, 1], np.where(k_off, 0, batch.top_k)) and k_off.sum() == 19
    assert np.array_equal(packed[:, 4], sampler.uniform_for(batch.seed, batch.position))
    batch.min_p = None
    assert not kernel_params(batch, 1000)[:, 3].any()


def test_sample_runs_the_kernel_on_its_device_only(monkeypatch):
    """The decider: the kernel's device (pointed at the CPU here), Triton present, float32
    logits with dense rows; else the torch path. Describe's compute["sampler"] says which."""
    calls = []

    def recorder(logits, params):
        calls.append(params)
        return torch.zeros(logits.shape[0], dtype=torch.int64)

    monkeypatch.setattr(triton_sample, "sample", recorder)
    monkeypatch.setattr(triton_sample, "triton", triton_sample.triton or object())
    logits, batch = mixed_case(100)
    sampler.sample(logits, batch)
    assert calls == [] and sampler.device_path(torch.device("cpu")) == "torch (device cpu)"
    monkeypatch.setattr(sampler, "TRITON_DEVICE", "cpu")
    sampler.sample(logits, batch)
    assert len(calls) == 1 and torch.equal(calls[0], torch.from_numpy(kernel_params(batch, 100)))
    assert sampler.device_path(torch.device("cpu")) == "triton"
    sampler.sample(logits.to(torch.bfloat16), batch)
    sampler.sample(logits.t().contiguous().t(), batch)  # columns apart
    greedy = np.flatnonzero(batch.temperature == 0)  # every row greedy: an argmax, no kernel
    greedy_ids = sampler.sample(logits[greedy], batch.rows(greedy))
    assert torch.equal(greedy_ids, logits[greedy].argmax(-1))
    assert len(calls) == 1
    monkeypatch.setattr(triton_sample, "triton", None)
    assert sampler.device_path(torch.device("cpu")) == "torch (triton is not installed)"


def test_the_kernel_compiles_for_hopper_without_spills():
    """Triton's compiler and ptxas for sm_90 (as a GPU's first call runs them): the float64 exp
    is libdevice's, not the float32 approximation; the radix passes' masks fit in registers."""
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    from test_ms_triton_compile import HOPPER
    from triton.compiler import ASTSource

    block, radix_block = triton_sample.block_sizes(151936, on_gpu=True)
    signature = dict(logits_ptr="*fp32", params_ptr="*fp64", out_ptr="*i64", row_stride="i32",
                     vocab="i32", NUM_PARAMS="constexpr", BLOCK="constexpr",
                     RADIX_BLOCK="constexpr")  # fmt: skip
    constexprs = dict(NUM_PARAMS=len(triton_sample.PARAMS), BLOCK=block, RADIX_BLOCK=radix_block)
    source = ASTSource(fn=triton_sample._sample_kernel, signature=signature, constexprs=constexprs)
    options = dict(num_warps=triton_sample.NUM_WARPS, **triton_sample.COMPILE_OPTIONS)
    compiled = triton.compile(source, target=HOPPER, options=options)
    assert "ex2.approx" not in compiled.asm["ptx"]
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("no cuobjdump beside Triton's ptxas")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert " LOCAL:0 " in usage, usage


# On a GPU: the compiled kernel.


@gpu
@needs_cuda
def test_cuda_kernel_matches_float64_and_the_torch_path():
    for vocab in (1000, 32000, 151936):
        check_mixed(vocab, "cuda")
    check_random(64, 32000, 1, "cuda")
    check_random(16, 151936, 2, "cuda")
    check_batch_invariance("cuda")
    logits, batch = mixed_case(32000, seed=9)
    check_the_torch_path(logits.cuda(), batch)


@gpu
@needs_cuda
def test_cuda_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed on new logits and parameters: the eager call's tokens."""
    logits, packed = random_case(16, 32000, seed=3)
    static_logits, static_params = logits.cuda(), torch.from_numpy(packed).cuda()
    triton_sample.sample(static_logits, static_params)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = triton_sample.sample(static_logits, static_params)
    new_logits, new_packed = random_case(16, 32000, seed=4)
    static_logits.copy_(new_logits.cuda())
    static_params.copy_(torch.from_numpy(new_packed).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(tokens, run(new_logits, new_packed, "cuda"))
    assert not check(tokens, new_logits, new_packed)
