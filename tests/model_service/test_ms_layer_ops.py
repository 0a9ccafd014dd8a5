"""The decoder's row-wise layer operations (model_service/kernels/layer_ops.py over cython_ext/layer_ops.pyx)
on every ISA path this machine runs: against float64 references, against the torch path, batch
invariance bitwise (each op, one decoder layer, the whole model's logits) in bf16 and float32,
errors that name the field; and the fused checkpoint layout (q/k/v, gate/up) round-tripping.

Tolerances against float64: float32 results within a few float32 ulps of the reference (2e-6
relative + 1e-6); bf16 ones within one bf16 rounding of it (2^-8 relative) plus what the bf16
rounding of the norm's intermediate adds (another 2^-8).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import measure
from cython_ext import layer_ops as native
from model_service.kernels import layer_ops
from model_service.loading.build import build_model
from model_service.models.llama import LlamaDecoderLayer
from model_service.loading.weights import TensorDictWeights
from model_service.models.rope import rope_table

SUPPORTED = [name for name in native.ISAS if native.isa_supported(name)]
DTYPES = (torch.bfloat16, torch.float32)
EPS = 1e-5


def _tolerance(dtype):
    return dict(rtol=2**-7, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=2e-6, atol=1e-6)


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_isa_paths_of_this_machine(capsys):
    assert "portable" in SUPPORTED
    assert layer_ops.resolve_isa("auto") == SUPPORTED[-1]
    with capsys.disabled():
        print(f"\nlayer ops ISA paths run here: {', '.join(SUPPORTED)} (auto: {layer_ops.resolve_isa('auto')})")


def test_unknown_isa_is_refused_by_name():
    with pytest.raises(ValueError, match=r"layer_ops_isa \(PLANSERVE_LAYER_OPS_ISA\): 'sse9' is not one of auto, torch, portable"):
        layer_ops.resolve_isa("sse9")


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 64, 23])  # SmolLM2's, the tiny model's, and a width with a scalar tail
def test_add_rms_norm_matches_float64(isa, dtype, hidden):
    residual, delta = _randn(9, hidden, dtype=dtype, seed=1) * 3, _randn(9, hidden, dtype=dtype, seed=2)
    weight = 1 + _randn(hidden, dtype=dtype, seed=3) * 0.1
    summed = (residual.double() + delta.double()).to(dtype)  # the residual add rounds to the dtype first
    x = summed.double()
    expected = weight.double() * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS))
    out = layer_ops.add_rms_norm_(residual, delta, weight, EPS, isa=isa)
    assert torch.equal(residual, summed)
    torch.testing.assert_close(out.double(), expected, **_tolerance(dtype))
    torch.testing.assert_close(layer_ops.add_rms_norm_(summed.clone(), None, weight, EPS, isa=isa), out, rtol=0, atol=0)


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 10])
def test_rope_matches_float64_and_leaves_v_alone(isa, dtype, head_dim):
    heads, kv_heads, rows = 4, 2, 7
    table = rope_table(4096, head_dim, 10000.0)
    positions = torch.tensor([0, 1, 5, 300, 301, 2047, 4095])
    qkv = _randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    half = head_dim // 2
    heads_in = qkv[:, : (heads + kv_heads) * head_dim].double().unflatten(1, (heads + kv_heads, head_dim))
    cos, sin = table[positions, None, :half].double(), table[positions, None, half:].double()
    x1, x2 = heads_in[..., :half], heads_in[..., half:]
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(1)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    layer_ops.rope_(qkv, positions, table, heads + kv_heads, head_dim, isa=isa)
    torch.testing.assert_close(qkv[:, : (heads + kv_heads) * head_dim].double(), expected, **_tolerance(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("isa", SUPPORTED)
def test_rope_float32_rounds_as_torch_eager(isa):
    """Built with -ffp-contract=off: each product rounds before the sum, so float32 RoPE gives the
    bits of transformers' eager `q * cos + rotate_half(q) * sin`."""
    table = rope_table(2048, 64, 10000.0)
    positions = torch.arange(0, 2048, 97)
    x = _randn(len(positions), 12 * 64, dtype=torch.float32)
    eager = x.clone().unflatten(1, (12, 64))
    cos = torch.cat((table[positions, :32],) * 2, -1)[:, None]
    sin = torch.cat((table[positions, 32:],) * 2, -1)[:, None]
    eager = eager * cos + torch.cat((-eager[..., 32:], eager[..., :32]), -1) * sin
    layer_ops.rope_(x, positions, table, 12, 64, isa=isa)
    assert torch.equal(x, eager.flatten(1))


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 128, 37])
def test_silu_mul_matches_float64(isa, dtype, width):
    gate_up = _randn(5, 2 * width, dtype=dtype) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # the exp's clamps, and silu(0) = 0
    g, u = gate_up[:, :width].double(), gate_up[:, width:].double()
    expected = g * torch.sigmoid(g) * u
    torch.testing.assert_close(layer_ops.silu_mul(gate_up, isa=isa).double(), expected, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_and_torch_paths_agree(dtype):
    """The torch path (other devices, PLANSERVE_LAYER_OPS_ISA=torch) computes the same operations."""
    hidden, width = 576, 1536
    residual, delta = _randn(6, hidden, dtype=dtype, seed=4), _randn(6, hidden, dtype=dtype, seed=5)
    weight = 1 + _randn(hidden, dtype=dtype, seed=6) * 0.1
    ours = layer_ops.add_rms_norm_(residual.clone(), delta, weight, EPS)
    theirs = layer_ops.add_rms_norm_(residual.clone(), delta, weight, EPS, isa="torch")
    torch.testing.assert_close(ours, theirs, **_tolerance(dtype))
    table, positions = rope_table(512, 64, 10000.0), torch.tensor([3, 9, 100, 200, 300, 511])
    a, b = _randn(6, 15 * 64, dtype=dtype), _randn(6, 15 * 64, dtype=dtype)
    layer_ops.rope_(a, positions, table, 12, 64)
    layer_ops.rope_(b, positions, table, 12, 64, isa="torch")
    torch.testing.assert_close(a, b, **_tolerance(dtype))
    gate_up = _randn(6, 2 * width, dtype=dtype, seed=7)
    torch.testing.assert_close(layer_ops.silu_mul(gate_up), layer_ops.silu_mul(gate_up, isa="torch"), **_tolerance(dtype))


@pytest.mark.parametrize("isa", SUPPORTED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_op_is_batch_invariant(isa, dtype):
    """Row r of a 64-row call equals the same row computed alone, bit for bit."""
    rows, hidden, width = 64, 576, 1536
    residual, delta = _randn(rows, hidden, dtype=dtype, seed=8), _randn(rows, hidden, dtype=dtype, seed=9)
    weight = 1 + _randn(hidden, dtype=dtype, seed=10) * 0.1
    table, positions = rope_table(4096, 64, 10000.0), torch.randint(0, 4096, (rows,))
    qkv, gate_up = _randn(rows, 15 * 64, dtype=dtype, seed=11), _randn(rows, 2 * width, dtype=dtype, seed=12)
    batch_residual = residual.clone()
    batch_norm = layer_ops.add_rms_norm_(batch_residual, delta, weight, EPS, isa=isa)
    batch_qkv = qkv.clone()
    layer_ops.rope_(batch_qkv, positions, table, 12, 64, isa=isa)
    batch_silu = layer_ops.silu_mul(gate_up, isa=isa)
    for r in (0, 17, 63):
        one_residual = residual[r : r + 1].clone()
        assert torch.equal(layer_ops.add_rms_norm_(one_residual, delta[r : r + 1], weight, EPS, isa=isa), batch_norm[r : r + 1])
        assert torch.equal(one_residual, batch_residual[r : r + 1])
        one_qkv = qkv[r : r + 1].clone()
        layer_ops.rope_(one_qkv, positions[r : r + 1], table, 12, 64, isa=isa)
        assert torch.equal(one_qkv, batch_qkv[r : r + 1])
        assert torch.equal(layer_ops.silu_mul(gate_up[r : r + 1], isa=isa), batch_silu[r : r + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features, out_features", [(576, 960), (1536, 576)])  # SmolLM2's qkv_proj, down_proj
def test_linear_is_batch_invariant(dtype, in_features, out_features):
    """layer_ops.linear: a row's GEMM result is the same at 1..17 rows and inside 2,048, for many
    different rows (the library's few-row kernels differ only for some values: bf16's one-row
    path at 1,536 inputs rounds ~10% of rows differently; padding keeps every one)."""
    layer = torch.nn.Linear(in_features, out_features, bias=False).to(dtype)
    x = _randn(2048, in_features, dtype=dtype, seed=13)
    with torch.inference_mode():
        full = layer_ops.linear(layer, x)
        for first in range(0, 96, 3):
            for rows in (1, 2, 3, 5, 7, 11):
                assert torch.equal(layer_ops.linear(layer, x[first : first + rows]), full[first : first + rows]), (first, rows)
        for rows in list(range(1, 18)) + [100, 512]:
            assert torch.equal(layer_ops.linear(layer, x[:rows]), full[:rows]), rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_decoder_layer_and_logits_are_batch_invariant(tiny_loaded, dtype):
    """One decoder layer of the tiny model (GEMMs, norms, RoPE, paged attention, SiLU x up), and
    the whole model's logits: each decode row computed at batch 1 equals the same row at batch 16,
    bit for bit, in bf16 and float32."""
    arch = tiny_loaded.arch
    model = tiny_loaded.model if dtype == torch.float32 else _tiny_in(tiny_loaded, dtype)
    rng = np.random.default_rng(3)
    seqs = [(int(c), 1) for c in rng.integers(20, 300, size=16)]
    batch = measure.Step(seqs, dtype, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, seed=1)
    layer = model.model.layers[0]
    hidden = _randn(16, arch.hidden_size, dtype=dtype, seed=14)
    with torch.inference_mode():
        batch_layer, batch_logits = _layer_out(model, layer, hidden, batch), model(*batch.args())
        for b in (0, 7, 15):
            alone = measure.Step([seqs[b]], dtype, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, seed=1)
            _copy_kv(batch, b, alone)
            alone.input_ids = batch.input_ids[b : b + 1]
            assert torch.equal(_layer_out(model, layer, hidden[b : b + 1], alone), batch_layer[b : b + 1])
            _copy_kv(batch, b, alone)  # the layer call wrote its K/V row: start the model from the same cache
            assert torch.equal(model(*alone.args()), batch_logits[b : b + 1])


def _tiny_in(loaded, dtype):
    """The float32 tiny model in dtype, its linears packed as the loader packs them."""
    import copy

    from model_service.kernels import gemm

    model = copy.deepcopy(loaded.model).to(dtype)
    gemm.pack_linears_(model, dtype, gemm.resolve_isa())
    return model


def _layer_out(model, layer, hidden, step):
    input_ids, positions, meta, kv, _ = step.args()
    k_cache, v_cache = kv.layer(0)
    residual = hidden.clone()
    return layer(None, residual, positions, model.rope_table(hidden.device), k_cache, v_cache, meta)


def _copy_kv(batch, b, alone):
    """Sequence b's cached K/V (every layer) into the lone step's blocks, block by block."""
    table_b = batch.meta.block_tables[b] if batch.meta is not None else batch.build().block_tables[b]
    meta = alone.args()[2]
    for column in range(meta.block_tables.shape[1]):
        src, dst = int(table_b[column]), int(meta.block_tables[0, column])
        alone.kv.k[:, dst] = batch.kv.k[:, src]
        alone.kv.v[:, dst] = batch.kv.v[:, src]


def test_errors_name_the_field():
    x = torch.zeros(4, 64)
    with pytest.raises(ValueError, match=r"delta: expected a contiguous CPU tensor \[4, 64\]"):
        layer_ops.add_rms_norm_(x, torch.zeros(3, 64), torch.ones(64), EPS)
    with pytest.raises(ValueError, match=r"weight: expected a contiguous CPU tensor \[64\] of torch.float32"):
        layer_ops.add_rms_norm_(x, None, torch.ones(64, dtype=torch.bfloat16), EPS)
    table = rope_table(16, 64, 10000.0)
    with pytest.raises(ValueError, match="rope: a position outside the RoPE table"):
        layer_ops.rope_(torch.zeros(2, 128), torch.tensor([3, 16]), table, 2, 64)
    with pytest.raises(ValueError, match=r"rope: x must be \[T, >= 192\]"):
        layer_ops.rope_(torch.zeros(2, 128), torch.tensor([3, 4]), table, 3, 64)
    with pytest.raises(ValueError, match=r"gate_up: expected a contiguous CPU tensor"):
        layer_ops.silu_mul(torch.zeros(4, 64).t())


def test_fused_state_dict_round_trips(tiny_loaded):
    """HF names -> our fused layers (model_service/loading/build.py: q|k|v and gate|up rows) -> HF names
    (hf_state_dict, split by the head counts) gives the same tensors."""
    hf = tiny_loaded.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in hf and "model.layers.0.mlp.up_proj.weight" in hf
    rebuilt = build_model(tiny_loaded.arch, TensorDictWeights(hf), torch.float32, "cpu")
    fused = rebuilt.state_dict()
    assert "model.layers.0.self_attn.qkv_proj.weight" in fused and "model.layers.0.self_attn.q_proj.weight" not in fused
    back = rebuilt.hf_state_dict()
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[name], hf[name]) for name in hf)
    assert isinstance(rebuilt.model.layers[0], LlamaDecoderLayer)
