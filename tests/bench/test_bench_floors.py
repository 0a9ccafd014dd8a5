"""The floors the GPU benchmarks set beside their timings (bench/bench_forward.py): the serial
floor (the GEMMs at their bound, then attention at its own) against max(memory, FLOP)."""
import pytest

from bench.bench_forward import serial_floor_s, step_flops, step_flops_parts
from model_service.loading.shapes import DUMMY_SHAPES
from model_service.models.families import llama_arch

# An H200's probes as bench_cuda_forward measured them (bytes/s copied, bf16 FLOP/s).
BANDWIDTH, RATE = 4.16e12, 794e12
ARCH = llama_arch(DUMMY_SHAPES["llama-1b"])  # issue 32's 1B shape
# K and V of one token in every layer, bf16.
KV_ROW_BYTES = ARCH.num_hidden_layers * 2 * ARCH.num_key_value_heads * ARCH.head_dim * 2


def test_decode_at_batch_256_is_gemm_flops_then_kv_reads():
    """At decode batch 256 on the 1B shape the GEMMs are FLOP-bound and attention reads KV: the
    serial floor adds the two, where max(memory, FLOP) counts the memory alone."""
    seqs = [(300, 1)] * 256
    weights, kv = 2.15e9, 256 * 301 * KV_ROW_BYTES
    gemms, attention = step_flops_parts(ARCH, seqs)
    assert gemms + attention == step_flops(ARCH, seqs)
    assert gemms / RATE > weights / BANDWIDTH and attention / RATE < kv / BANDWIDTH
    serial = serial_floor_s(ARCH, seqs, weights, kv, BANDWIDTH, RATE)
    assert serial == pytest.approx(gemms / RATE + kv / BANDWIDTH)
    assert serial > max((weights + kv) / BANDWIDTH, step_flops(ARCH, seqs) / RATE) * 1.1


STEPS = [[(300, 1)], [(300, 1)] * 64, [(0, 2048)], [(0, 512)] + [(300, 1)] * 255]


@pytest.mark.parametrize("seqs", STEPS)
def test_the_serial_floor_is_never_under_the_whole_steps_bound(seqs):
    kv = sum(c + n for c, n in seqs) * KV_ROW_BYTES
    serial = serial_floor_s(ARCH, seqs, 2.15e9, kv, BANDWIDTH, RATE)
    whole = max((2.15e9 + kv) / BANDWIDTH, step_flops(ARCH, seqs) / RATE)
    assert serial >= whole * (1 - 1e-12)  # equal where both parts have the same bound (prefill)
