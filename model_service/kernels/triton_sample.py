"""The sampler's common path on CUDA as one Triton kernel: greedy, temperature, top-k, top-p and
min-p, each row drawing with its own host-computed uniform. model_service/step/sampler.py decides
where it runs (logits on CUDA, Triton present) and keeps the torch path beside it, the reference.

Why: the torch path launches a few dozen kernels a step (a float64 softmax, a vocabulary sort for
top-k / top-p, a cumsum, searchsorted, gathers, wheres) over [R, V] float64 tensors; here one
program per row reads its float32 logits a few times and writes one int64 token.

Layouts (R rows, vocabulary V; logits rows may lie apart: the row stride is passed):

    logits   [R, V] float32, dense rows
    params   [R, 5] float64, contiguous, per row (PARAMS names the columns):
             temperature (<= 0: greedy), top_k (0: off; 1 .. V-1), top_p (>= 1: off),
             min_p (<= 0: off), u (the row's uniform in [0, 1): sampler.uniform_for)
    out      [R] int64 token ids

The rule is the torch path's (sampler.py), in another order of work. Softmax is monotone, so the
k-th largest probability is the k-th largest logit: thresholds are found among the float32 logits
by radix select over order-preserving integer keys (the IEEE bits, negatives' all flipped,
positives' sign bit set, -0 taken as +0), one hex digit a pass from the top, never by sorting:

    pass          what                                                   rows
    scan          max, its first index, the first NaN, least/largest key  every row
    top-k   x 8   per digit, how many tokens: the k-th largest key         top_k on (k = 1: the max)
    top-p   x 10  the whole mass S, the mass above top-k's threshold,      top_p on
                  then per digit, the tokens' mass: the least present key
                  c with mass(key > c) < top_p * S
    kept          total kept mass, last kept token                         sampled rows
    draw          first kept token whose running mass > u * total          sampled rows, until found

Counting is exact, so top-k's key is too; the masses are float64 sums. A top-p row without top-k
skips the second of its passes; one whose top-k threshold already keeps less than top_p's mass
stops after it.

Numerics: each row's weights are e = exp(x / t - max / t) in float64 (x as float64 divided by the
float32 temperature as float64, as torch's .double() gives), left unnormalized: the draw is
invariant to the common factor 1 / S, and min-p compares e >= min_p (the largest e is exactly 1).
Sums run in float64 by blocks in a fixed order, so they differ from torch's (a sequential cumsum on
the CPU, a tree scan on CUDA) by a few float64 ulps: a draw can differ only when u * total lies
within that of a CDF step, a top-p or min-p decision only when the mass is that close to its bound
(tests/model_service/test_ms_triton_sample.py checks both are all that differs). Ties are kept
whole, as the torch path keeps every probability >= the threshold; the one place the two can part
is where distinct logits round to the same float64 probability (logits within a float64 ulp of
each other after the shift, near zero), which the keys still tell apart. Rows whose softmax is
undefined (a NaN or +inf logit, every logit -inf) draw the last token, as the torch path's
arithmetic gives; greedy rows take argmax_rows' answer (the first of the largest, NaN largest).

Not here: penalties, logit bias, min-token suppression and grammar masks (step/logits.py). They
run only for the rows that ask, in place on those rows before this kernel; fusing them would need
each such row's token history and bias map on the device as ragged arrays, a kernel of its own.

Batch invariance by construction: one program per row, block sizes and warp count from V (and
whether a GPU runs it: block_sizes), never from R, so a row draws the same alone or in a batch.
CUDA graphs: a call allocates only its output and launches one kernel, with no host sync.

Speed: unmeasured (written without a GPU at hand). The passes above are the cost model: each reads
the row's float32 logits once, the top-p passes and the last two computing a float64 exp per
logit. The radix passes' blocks are small (RADIX_BLOCK) to keep their [block, 16] digit masks in
registers: ptxas spills none for sm_90 (tests/model_service/test_ms_triton_sample.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's CPU wheel does not bring Triton
    triton = None

PARAMS = ("temperature", "top_k", "top_p", "min_p", "u")  # the columns of `params`
VOCAB_BLOCK = 2048  # logits per block of a row's passes (fewer where the vocabulary is smaller)
RADIX_BLOCK = 256  # per block of the radix passes, which hold [block, 16] digit masks
NUM_WARPS = 8
# Products rounded before sums, as in model_service/kernels/triton_ops.py.
COMPILE_OPTIONS = dict(enable_fp_fusion=False)


def unsupported_reason(logits: torch.Tensor) -> str | None:
    """Why the kernel cannot sample from these logits (the caller runs the torch path), or None."""
    if triton is None:
        return "triton is not installed"
    if logits.dtype != torch.float32:
        return f"dtype {logits.dtype}"
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        return f"logits {tuple(logits.shape)} strides {logits.stride()}, not dense rows"
    return None


def sample(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float32 and params [R, len(PARAMS)] float64 (the module docstring) on one
    device -> token ids [R] int64 there."""
    rows, vocab = logits.shape
    if params.shape != (rows, len(PARAMS)) or params.dtype != torch.float64:
        raise ValueError(f"params: expected [{rows}, {len(PARAMS)}] float64, got "
                         f"{tuple(params.shape)} {params.dtype}")  # fmt: skip
    if not params.is_contiguous() or params.device != logits.device:
        raise ValueError("params: expected a contiguous tensor on the logits' device")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    block, radix_block = block_sizes(vocab, logits.device.type == "cuda")
    _sample_kernel[(rows,)](
        logits, params, out, logits.stride(0), vocab,
        NUM_PARAMS=len(PARAMS), BLOCK=block, RADIX_BLOCK=radix_block,
        num_warps=NUM_WARPS, **COMPILE_OPTIONS,
    )  # fmt: skip
    return out


def block_sizes(vocab: int, on_gpu: bool) -> tuple[int, int]:
    """The passes' block and the radix passes' block, from the vocabulary alone. Under Triton's
    interpreter (CPU tensors), where each operation costs far more than its arithmetic, the radix
    passes take blocks as large as the others': the same code, its float64 sums grouped
    otherwise (tests/model_service/test_ms_triton_sample.py runs the GPU's sizes there too)."""
    block = min(VOCAB_BLOCK, 1 << max(vocab - 1, 0).bit_length())
    return block, min(RADIX_BLOCK, block) if on_gpu else block


# Defined only where Triton is (a CPU-only install imports this module for unsupported_reason).
if triton is not None:

    @triton.jit
    def _block(base, start, vocab, BLOCK: tl.constexpr):
        """A block of a row's logits (-inf past its end) and their keys: the order-preserving
        key of float32 x (not NaN) as an int64 in [0, 2^32) is its bits, negatives' all flipped,
        positives' sign bit set; -0 and +0 the same key. (Computed here, where a block is loaded:
        under the interpreter a call of a jit function costs more than a block's arithmetic.)"""
        cols = start + tl.arange(0, BLOCK)
        live = cols < vocab
        x = tl.load(base + cols, mask=live, other=float("-inf"))
        bits = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
        key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000).to(tl.int64)
        return cols, live, x, key

    @triton.jit
    def _sample_kernel(
        logits_ptr, params_ptr, out_ptr, row_stride, vocab,
        NUM_PARAMS: tl.constexpr, BLOCK: tl.constexpr, RADIX_BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        params = params_ptr + row * NUM_PARAMS
        temperature = tl.load(params)
        x_max, argmax, first_nan, key_min, key_max = _scan(base, vocab, BLOCK)
        token = tl.where(first_nan < vocab, first_nan, argmax).to(tl.int64)
        if temperature > 0:
            # An undefined softmax (a NaN, +inf, every logit -inf): the torch path's answer.
            token = (vocab - 1).to(tl.int64)
            if (first_nan == vocab) & (x_max < float("inf")) & (x_max > float("-inf")):
                top_k = tl.load(params + 1).to(tl.int64)
                top_p, min_p, u = tl.load(params + 2), tl.load(params + 3), tl.load(params + 4)
                z_max = x_max.to(tl.float64) / temperature
                threshold = key_min
                if top_k == 1:
                    threshold = key_max
                elif top_k > 1:
                    threshold = _kth_key(base, vocab, top_k, RADIX_BLOCK)
                if not (top_p >= 1.0):  # NaN counts as on, as in the torch path
                    threshold = _top_p_key(base, vocab, top_p, threshold, key_min, key_max,
                                           z_max, temperature, BLOCK, RADIX_BLOCK)  # fmt: skip
                total, last_kept = _kept(base, vocab, threshold, min_p, z_max, temperature, BLOCK)
                token = _draw(base, vocab, threshold, min_p, z_max, temperature, u * total,
                              last_kept, BLOCK).to(tl.int64)  # fmt: skip
        tl.store(out_ptr + row, token)

    @triton.jit
    def _scan(base, vocab, BLOCK: tl.constexpr):
        """The row's largest logit (NaNs aside), its first index, the first NaN's index (vocab if
        none), the least and the largest key."""
        x_max = float("-inf")
        argmax = 0
        first_nan = vocab
        key_min = tl.full((), 0xFFFFFFFF, tl.int64)
        key_max = tl.zeros((), tl.int64)
        for start in range(0, vocab, BLOCK):
            cols, live, x, key = _block(base, start, vocab, BLOCK)
            nan = x != x
            first_nan = tl.minimum(first_nan, tl.min(tl.where(nan, cols, vocab)))
            x = tl.where(nan, float("-inf"), x)
            block_max = tl.max(x)
            block_arg = tl.min(tl.where(x == block_max, cols, vocab))  # dead lanes come last
            argmax = tl.where(block_max > x_max, block_arg, argmax)
            x_max = tl.maximum(x_max, block_max)
            key_min = tl.minimum(key_min, tl.min(tl.where(live, key, 0xFFFFFFFF)))
            key_max = tl.maximum(key_max, tl.max(tl.where(live & ~nan, key, 0)))
        return x_max, argmax, first_nan, key_min, key_max

    @triton.jit
    def _digit_sums(
        base, vocab, prefix, shift, z_max, temperature, WEIGHTED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Over the tokens whose key >> (shift + 4) is `prefix`, per value d of the next digit,
        (key >> shift) & 15: how many have it, or (WEIGHTED) their float64 weight."""
        digits = tl.arange(0, 16)
        if WEIGHTED:
            sums = tl.zeros((16,), tl.float64)
        else:
            sums = tl.zeros((16,), tl.int32)
        for start in range(0, vocab, BLOCK):
            cols, live, x, key = _block(base, start, vocab, BLOCK)
            inside = live & ((key >> (shift + 4)) == prefix)
            hit = inside[:, None] & (((key >> shift) & 15)[:, None] == digits[None, :])
            if WEIGHTED:
                e = tl.exp(x.to(tl.float64) / temperature - z_max)
                sums += tl.sum(tl.where(hit, e[:, None], 0.0), axis=0)
            else:
                sums += tl.sum(hit.to(tl.int32), axis=0)
        return sums

    @triton.jit
    def _kth_key(base, vocab, k, BLOCK: tl.constexpr):
        """The k-th largest key, one hex digit a pass from the top (radix select), exact: the
        digit taken is the largest whose tokens, with those of higher digits, reach `rank`, the
        k-th largest's rank among the tokens under the digits taken so far."""
        digits = tl.arange(0, 16)
        prefix = tl.zeros((), tl.int64)
        rank = k
        for level in range(8):
            shift = 28 - 4 * level
            counts = _digit_sums(base, vocab, prefix, shift, 0.0, 1.0, False, BLOCK)
            # at_or_above[d]: the tokens whose digit is d or higher
            higher_or_same = digits[None, :] >= digits[:, None]
            at_or_above = tl.sum(tl.where(higher_or_same, counts[None, :], 0), axis=1)
            digit = tl.max(tl.where(at_or_above >= rank, digits, -1))
            rank -= tl.sum(tl.where(digits > digit, counts, 0))
            prefix = prefix * 16 + digit
        return prefix

    @triton.jit
    def _mass_above(base, vocab, c, z_max, temperature, BLOCK: tl.constexpr):
        """The float64 weight of the tokens whose key is above c."""
        mass = tl.zeros((), tl.float64)
        for start in range(0, vocab, BLOCK):
            cols, live, x, key = _block(base, start, vocab, BLOCK)
            e = tl.exp(x.to(tl.float64) / temperature - z_max)
            mass += tl.sum(tl.where(live & (key > c), e, 0.0))
        return mass

    @triton.jit
    def _top_p_key(
        base, vocab, top_p, threshold, key_min, key_max, z_max, temperature,
        BLOCK: tl.constexpr, RADIX_BLOCK: tl.constexpr,
    ):  # fmt: skip
        """The threshold raised by top-p: the least present key c with mass(key > c) < top_p * S
        (the torch path's rule: every token whose preceding sorted mass is under top_p is kept),
        or `threshold` (top-k's) where that is higher."""
        bound = top_p.to(tl.float64) * _mass_above(base, vocab, -1, z_max, temperature, BLOCK)
        answer = key_max  # top_p <= 0: the torch path keeps one sorted token, the largest
        if top_p > 0:
            answer = threshold
            enough = threshold > key_min  # top-k's keeps less than top_p's mass already?
            if enough:
                enough = _mass_above(base, vocab, threshold - 1, z_max, temperature, BLOCK) < bound
            if not enough:
                answer = _top_p_descent(base, vocab, bound, z_max, temperature, RADIX_BLOCK)
        return tl.maximum(answer, threshold)

    @triton.jit
    def _top_p_descent(base, vocab, bound, z_max, temperature, BLOCK: tl.constexpr):
        """The least key c with mass(key > c) < bound, one hex digit a pass from the top: the digit
        taken is the least whose higher digits' weight, with `above` (the weight above the
        digits taken so far), is under bound; its own is at least bound less that, by the pass
        before. Present: the weight moves only at present keys."""
        digits = tl.arange(0, 16)
        prefix = tl.zeros((), tl.int64)
        above = tl.zeros((), tl.float64)
        for level in range(8):
            shift = 28 - 4 * level
            mass = _digit_sums(base, vocab, prefix, shift, z_max, temperature, True, BLOCK)
            higher = digits[None, :] > digits[:, None]
            over = above + tl.sum(tl.where(higher, mass[None, :], 0.0), axis=1)
            digit = tl.min(tl.where(over < bound, digits, 16))  # over[15] is above: < bound
            above = tl.sum(tl.where(digits == digit, over, 0.0))
            prefix = prefix * 16 + digit
        return prefix

    @triton.jit
    def _kept(base, vocab, threshold, min_p, z_max, temperature, BLOCK: tl.constexpr):
        """The kept tokens' total weight (block sums added in order, as _draw adds them) and the
        last kept token's index (-1: none)."""
        total = tl.zeros((), tl.float64)
        last_kept = -1
        for start in range(0, vocab, BLOCK):
            cols, live, x, key = _block(base, start, vocab, BLOCK)
            e = tl.exp(x.to(tl.float64) / temperature - z_max)
            w = tl.where(live & (key >= threshold) & (e >= min_p), e, 0.0)
            total += tl.sum(w)
            last_kept = tl.maximum(last_kept, tl.max(tl.where(w > 0, cols, -1)))
        return total, last_kept

    @triton.jit
    def _draw(
        base, vocab, threshold, min_p, z_max, temperature, target, last_kept, BLOCK: tl.constexpr
    ):
        """Inverse CDF in vocab order: the first kept token whose running weight exceeds target,
        or the last kept one where rounding left target at the total (vocab - 1 if none kept, the
        torch path's answer). A zero weight is never drawn: a scan's rounding may lift a running
        sum at one, so hits count only at kept tokens."""
        carry = tl.zeros((), tl.float64)
        token = tl.where(last_kept < 0, vocab - 1, last_kept)
        found = False
        start = 0
        while (start < vocab) & (not found):
            cols, live, x, key = _block(base, start, vocab, BLOCK)
            e = tl.exp(x.to(tl.float64) / temperature - z_max)
            w = tl.where(live & (key >= threshold) & (e >= min_p), e, 0.0)
            cdf = carry + tl.cumsum(w, axis=0)
            hit = tl.min(tl.where((cdf > target) & (w > 0), cols, vocab))
            found = hit < vocab
            token = tl.where(found, hit, token)
            carry += tl.sum(w)
            start += BLOCK
        return token
