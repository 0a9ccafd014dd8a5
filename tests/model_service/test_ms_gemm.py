"""The native GEMMs on packed weights (model_service/kernels/gemm.py over cython_ext/gemm.pyx), on every
ISA path this machine runs, each forced (portable, avx2, avx512, avx512_bf16: an AVX512-BF16 CPU
runs the AVX2 path in CI too): bf16 against a float64 reference; int8 (x quantized to int16 per row
and block of 32, integer dot products, csrc/gemm.h) against a float64 model of that arithmetic and,
looser, against the eager dequantize-then-multiply path; packing exact (one-hot rows read a bf16
weight back bit for bit); batch invariance bitwise at every row count; the loader packing what
users run; errors that name the field; each path's vector registers only in its own code (the
build runs on a CPU without AVX-512).

Tolerance against float64: one bf16 rounding of the result (2^-8 relative) plus float32
accumulation error (far below it at these widths).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vector_registers

from cython_ext import gemm as native
from model_service.kernels import gemm
from model_service.kernels import layer_ops
from model_service.kernels.quant import Int8Linear, Int8Weight

SUPPORTED = [name for name in native.ISAS if native.isa_supported(name)]
# Invariance: each row count against the same rows inside TOTAL (the portable loop is slow: 300
# rows span 3 row blocks).
ROW_COUNTS = [*range(1, 18), 64, 100, 121, 250, 512]
TOTAL = {"portable": 300}
SHAPES = [(576, 960), (1536, 576), (64, 100), (50, 37), (576, 16), (576, 200)]  # (in, out): SmolLM2's qkv and down, the tiny model's, odd panels, 1-panel groups


def _randn(*shape, seed=0, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _linear(in_features, out_features, bias=False, seed=1):
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(_randn(out_features, in_features, seed=seed, dtype=torch.float32) * in_features**-0.5)
        if bias:
            layer.bias.copy_(_randn(out_features, seed=seed + 1, dtype=torch.float32))
    return layer.to(torch.bfloat16).requires_grad_(False)


def _int8(in_features, out_features, seed=1):
    weight = _randn(out_features, in_features, seed=seed, dtype=torch.float32) * in_features**-0.5
    layer = Int8Linear(Int8Weight(weight))
    return layer.to(torch.bfloat16)


def _assert_near_float64(out, x, weight, bias=None):
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-3 * float(expected.abs().max()))


def test_isa_paths_of_this_machine(capsys):
    assert "portable" in SUPPORTED
    expected_auto = next((name for name in native.FASTEST_FIRST if name in SUPPORTED), gemm.TORCH_PATH)
    assert gemm.resolve_isa("auto") == expected_auto
    with capsys.disabled():
        print(f"\nGEMM ISA paths run here: {', '.join(SUPPORTED)} (auto: {expected_auto})")


def test_unknown_isa_is_refused_by_name():
    with pytest.raises(ValueError, match=r"gemm_isa \(PLANSERVE_GEMM_ISA\): 'amx9' is not one of auto, torch, portable"):
        gemm.resolve_isa("amx9")


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("in_features, out_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_matches_float64(isa, in_features, out_features, bias):
    layer = _linear(in_features, out_features, bias)
    packed = gemm.PackedLinear(layer, isa)
    assert torch.equal(packed.weight, layer.weight)  # unpack(pack(w)) == w
    for rows in (1, 5, 16, 130):
        x = _randn(rows, in_features, seed=rows)
        _assert_near_float64(packed(x), x, layer.weight, layer.bias)


def _q8_reference(x, layer):
    """float64 model of the int8 kernel: x per row and block of 32 as d = max|x| / 32767 and int16
    q = round(x * (32767 / max|x|)) (float32, nearest even), exact integer block dots, then the
    sum over blocks of dot * d_x * d_w."""
    rows, k = x.shape
    blocks = x.float().view(rows, k // 32, 32)
    amax = blocks.abs().amax(-1)
    d_x = amax / 32767.0
    # tensor / tensor: an IEEE division, as the kernel's (torch computes 127.0 / t as 127 * (1 / t))
    inverse = torch.where(amax > 0, torch.full_like(amax, 32767.0) / amax, torch.zeros_like(amax))
    q_x = torch.round(blocks * inverse[..., None]).double()
    q_w = layer.w.qweight.view(-1, k // 32, 32).double()
    dots = torch.einsum("rbk,nbk->rnb", q_x, q_w)
    return (dots * d_x.double()[:, None, :] * layer.w.scale.float().double()[None]).sum(-1)


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("in_features, out_features", [(576, 960), (64, 100), (1536, 40)])
def test_int8_torch_path_is_the_native_arithmetic_bit_for_bit(isa, in_features, out_features):
    """Where the native GEMM does not run (gemm_isa torch, or a CPU without AVX512-BF16), an
    Int8Linear in bf16 computes as the kernel does (quant.int8_block_linear): the same bits as
    each native path, bf16 and float32 out, at every row count, and each row the same alone."""
    layer = _int8(in_features, out_features)
    packed = gemm.PackedLinear(layer, isa)
    x = _randn(130, in_features, seed=3)
    whole = layer_ops.linear(layer, x, float32_out=True)
    assert whole.dtype == torch.float32
    assert torch.equal(whole, layer_ops.linear(packed, x, float32_out=True))
    for rows in (*range(1, 18), 64):
        assert torch.equal(layer(x[:rows]), packed(x[:rows]))
        assert torch.equal(layer_ops.linear(layer, x[:rows], float32_out=True), whole[:rows])


def test_int8_torch_path_takes_a_step_without_rows():
    """A step can ask a layer for no rows (lm_head when no sequence samples): the torch path, what
    CPUs without AVX512-BF16 run, returns an empty [0, N] as the packed path does."""
    layer = _int8(64, 100)
    for out_dtype in (torch.bfloat16, torch.float32):
        out = layer(torch.zeros(0, 64, dtype=torch.bfloat16), out_dtype)
        assert out.shape == (0, 100) and out.dtype == out_dtype


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("in_features, out_features", [(576, 960), (64, 100), (1536, 40)])
def test_int8_matches_its_arithmetic_in_float64(isa, in_features, out_features):
    layer = _int8(in_features, out_features)
    packed = gemm.PackedLinear(layer, isa)
    for rows in (1, 4, 16, 130):
        x = _randn(rows, in_features, seed=rows)
        out = packed(x).double()
        expected = _q8_reference(x, layer)
        torch.testing.assert_close(out, expected, rtol=2**-8, atol=1e-4 * float(expected.abs().max()))
        # and near the eager path (bf16 x, the dequantized bf16 weight): x's int16 rounding is
        # ~2^-16 of its block's max, below the eager weight's own bf16 rounding
        eager = layer(x).double()
        torch.testing.assert_close(out, eager, rtol=2**-6, atol=2**-8 * float(eager.abs().max()))


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_float32_out_is_the_sum_the_bf16_out_rounds(isa, kind):
    """out_dtype=float32 (lm_head's logits) gives the kernel's float32 sums: within float32
    accumulation error of float64, and rounding them to bf16 gives the bf16 output bit for bit."""
    layer = _linear(576, 200, bias=True) if kind == "bf16" else _int8(576, 200)
    packed = gemm.PackedLinear(layer, isa)
    x = _randn(37, 576, seed=3)
    wide = packed(x, torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide.to(torch.bfloat16), packed(x))
    expected = F.linear(x.double(), layer.weight.double(), layer.bias.double()) if kind == "bf16" else _q8_reference(x, layer)
    torch.testing.assert_close(wide.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    with pytest.raises(ValueError, match="PackedLinear: out_dtype must be bfloat16 or float32"):
        packed(x, torch.float16)


@pytest.mark.parametrize("isa", SUPPORTED)
def test_one_hot_rows_read_the_weight_back_exactly(isa):
    """x = identity: out[k, n] = W[n, k], one exact product per element: the packed weight."""
    eye = torch.eye(576, dtype=torch.bfloat16)
    layer = _linear(576, 200)
    assert torch.equal(gemm.PackedLinear(layer, isa)(eye), layer.weight.t())


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("in_features, out_features", [(576, 960), (1536, 576)])  # SmolLM2's qkv_proj, down_proj
def test_batch_invariant_at_every_row_count(isa, kind, in_features, out_features):
    """A row's result is the same alone, in any small batch, and inside 2,048 rows, bit for bit:
    one kernel for every row count (row blocks, tile shapes and the thread split change no sum)."""
    layer = _linear(in_features, out_features) if kind == "bf16" else _int8(in_features, out_features)
    packed = gemm.PackedLinear(layer, isa)
    total = TOTAL.get(isa, 2048)
    x = _randn(total, in_features, seed=13)
    with torch.inference_mode():
        full = layer_ops.linear(packed, x)
        for first in range(0, 48, 5):
            for rows in (1, 2, 3, 5, 7, 11):
                assert torch.equal(layer_ops.linear(packed, x[first : first + rows]), full[first : first + rows]), (first, rows)
        for rows in (rows for rows in ROW_COUNTS if rows < total):
            assert torch.equal(layer_ops.linear(packed, x[:rows]), full[:rows]), rows


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_thread_count_changes_no_bit(isa, kind):
    """The panels are cut into as many near-equal slices per thread as it takes (csrc/gemm_driver.h):
    1..5 threads give the same bits, for a weight of 9 groups of panels (SmolLM2's 576 columns),
    odd panels, and fewer panels than threads (slices left empty)."""
    threads = torch.get_num_threads()
    for in_features, out_features in [(576, 576), (64, 200), (1536, 32)]:
        layer = _linear(in_features, out_features) if kind == "bf16" else _int8(in_features, out_features)
        packed = gemm.PackedLinear(layer, isa)
        x = _randn(130, in_features, seed=17)  # two row blocks
        outs = {}
        try:
            for n in range(1, 6):
                torch.set_num_threads(n)
                with torch.inference_mode():
                    outs[n] = (packed(x[:16]), packed(x))
        finally:
            torch.set_num_threads(threads)
        for n in range(2, 6):
            assert torch.equal(outs[n][0], outs[1][0]) and torch.equal(outs[n][1], outs[1][1]), (in_features, out_features, n)
        if kind == "bf16":  # and the bits are the right ones (int8's arithmetic has its own test above)
            _assert_near_float64(outs[1][1], x, layer.weight)


def test_paths_agree_within_rounding():
    """Every supported path gives results within one bf16 rounding of each other."""
    layer = _linear(576, 960)
    x = _randn(33, 576, seed=5)
    outs = {isa: gemm.PackedLinear(layer, isa)(x).double() for isa in SUPPORTED}
    outs["torch"] = layer(x).double()
    for isa, out in outs.items():
        torch.testing.assert_close(out, outs["portable"], rtol=2**-7, atol=1e-2, msg=isa)


def test_pack_linears_packs_bf16_cpu_layers_only():
    model = nn.Sequential(_linear(64, 32), _linear(33, 8), nn.Linear(64, 16), _int8(64, 16))
    reference = [m.weight.clone() if isinstance(m, nn.Linear) else None for m in model]
    packed = gemm.pack_linears_(model, torch.bfloat16, isa="portable")
    kinds = [type(m).__name__ for m in model]
    # odd input size: refused (kept on torch); float32 weight: kept; int8: packed
    assert kinds == ["PackedLinear", "Linear", "Linear", "PackedLinear"] and packed == 2
    assert torch.equal(model.state_dict()["0.weight"], reference[0])  # the dense weight, unpacked
    assert gemm.pack_linears_(nn.Sequential(_linear(64, 32)), torch.bfloat16, isa="torch") == 0
    assert gemm.pack_linears_(nn.Sequential(nn.Linear(64, 32)), torch.float32, isa="portable") == 0


def test_the_loader_packs_bf16_models_and_the_runner_says_so():
    """load_model packs every linear of a bf16 model (4 per layer and lm_head) on the path this CPU
    runs; the runner reports it in Describe's compute map (float32 models stay on torch's GEMM)."""
    from model_service.config import ModelServiceConfig
    from model_service.loading.loader import load_model
    from model_service.start import build_runner

    config = ModelServiceConfig(model="tiny", dtype="bfloat16", num_kv_blocks=64, max_num_slots=4)
    loaded = load_model(config)
    packed = [m for m in loaded.model.modules() if isinstance(m, gemm.PackedLinear)]
    auto = gemm.resolve_isa("auto")
    expected = 0 if auto == gemm.TORCH_PATH else 4 * loaded.arch.num_hidden_layers + 1
    assert len(packed) == expected and all(m.isa == auto for m in packed)
    assert build_runner(loaded, config).compute["gemm"] == auto


def test_a_tied_embedding_reads_the_packed_lm_head(tiny_loaded):
    """A tied embedding becomes a PackedEmbedding over lm_head's packed matrix: the same rows, no
    second copy of the matrix, the state dict unchanged."""
    import copy

    from model_service.kernels.quant import weight_bytes

    model = copy.deepcopy(tiny_loaded.model).to(torch.bfloat16)
    dense = model.model.embed_tokens.weight.detach().clone()
    before = weight_bytes(model)
    gemm.pack_linears_(model, torch.bfloat16, isa="portable")
    embedding = model.model.embed_tokens
    assert isinstance(embedding, gemm.PackedEmbedding)
    ids = torch.tensor([[0, 7, dense.shape[0] - 1], [3, 3, 15]])
    assert torch.equal(embedding(ids), dense[ids])
    assert torch.equal(embedding(ids.to(torch.int32)), dense[ids])
    assert weight_bytes(model) == before  # the tied matrix held once, packed (not a second, packed copy)
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], dense)
    with pytest.raises(ValueError, match="gather_rows_bf16: a row id outside the weight's rows"):
        embedding(torch.tensor([dense.shape[0]]))


def test_errors_name_the_field():
    packed = gemm.PackedLinear(_linear(64, 32), "portable")
    with pytest.raises(ValueError, match=r"PackedLinear: x must be bfloat16 \[T, 64\]"):
        packed(torch.zeros(2, 64))
    with pytest.raises(ValueError, match=r"PackedLinear: x must be bfloat16 \[T, 64\]"):
        packed(torch.zeros(2, 63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="linear_bf16: a row count, column count or row stride out of range"):
        native.linear_bf16(0, 1, 63, 0, 8, 63, 0, 0, 8, False, 0, 1)  # odd input columns, refused before any read
    with pytest.raises(ValueError, match="linear_int8: .*a multiple of 32 for int8"):
        native.linear_int8(0, 1, 48, 0, 8, 48, 0, 0, 8, False, 0, 1)


def test_vector_registers_only_in_their_paths():
    """zmm registers only in AVX-512 code, ymm only in AVX2 or AVX-512 code (setup.py builds each path
    with its own flags; gemm_driver.h keeps std:: templates out, whose one kept copy could carry
    another path's instructions): so the dispatcher and the portable path run on any x86-64 CPU."""
    if (
        not vector_registers.objdump_available()
        or "avx2" not in native.ISAS
        or not native.isa_supported("portable")
    ):
        pytest.skip("objdump or an x86-64 build needed")
    owners = vector_registers.owners(native.__file__)
    vector_registers.assert_only_in_their_paths(owners)
    assert any("planserve_gm_avx2" in f for f in owners["ymm"]), "the AVX2 path's code not found"
    assert not any("planserve_gm_avx2" in f for f in owners["zmm"])
