"""The stacked LoRA products (model_service/lora/stacked.py, a bfloat16 model on the CPU, the
default here): every adapter of a step in one shrink and one expand per fused module. Each row's
result is bit for bit its result alone, at every row count and whatever other adapters share the
step or their order in the stack; it agrees with the per-adapter products; evicting an adapter
rebuilds the stack without it, as loading one rebuilds it with it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_config
from lora_adapters import ALL_LINEAR, ATTENTION, save_adapter
from model_service.loading.loader import load_model
from model_service.lora import grouping
from model_service.start import build_runner

FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def runner(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("stacked")
    loaded = load_model(tiny_config(dtype="bfloat16"))
    runner = build_runner(loaded, tiny_config(dtype="bfloat16", enable_lora=True, max_loras=3,
                                                 max_cpu_loras=4))
    for lora_id, (rank, targets) in enumerate([(4, ALL_LINEAR), (16, ATTENTION), (7, ALL_LINEAR)], 1):
        save_adapter(tiny_hf, str(root / f"a{lora_id}"), rank, targets, seed=lora_id)
        runner.load_adapter(lora_id, f"a{lora_id}", str(root / f"a{lora_id}"))
    return runner


def _products(runner, row_lora, x, width):
    """Every fused module's y (random base output) after the step's LoRA products, layer 0."""
    step = grouping.group_rows(np.asarray(row_lora), *_view(runner))
    out = {}
    for fused in FUSED:
        y = torch.linspace(-1, 1, x[fused].shape[0] * width[fused]).reshape(-1, width[fused])
        out[fused] = step.layer(0).add_(fused, x[fused], y.to(torch.bfloat16))
    return step, out


def _view(runner):
    adapters, stack = runner.adapters.step_view()
    return adapters, runner.device, stack


def _inputs(runner, rows, seed):
    layer = runner.model.model.layers[0]
    width = {"qkv_proj": layer.self_attn.qkv_proj.out_features, "o_proj": layer.self_attn.o_proj.out_features,
             "gate_up_proj": layer.mlp.gate_up_proj.out_features, "down_proj": layer.mlp.down_proj.out_features}
    inner = {"qkv_proj": layer.self_attn.qkv_proj.in_features, "o_proj": layer.self_attn.o_proj.in_features,
             "gate_up_proj": layer.mlp.gate_up_proj.in_features, "down_proj": layer.mlp.down_proj.in_features}
    generator = torch.Generator().manual_seed(seed)
    x = {f: torch.randn(rows, inner[f], generator=generator).to(torch.bfloat16) for f in FUSED}
    return x, width


def test_the_default_dtype_runs_the_stacked_products(runner):
    assert runner.adapters.stacked and "stacked" in runner.compute["lora"]
    step = grouping.group_rows(np.array([0, 1, 2]), *_view(runner))
    assert step.stacked is not None and step.groups == []


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 13, 64])
def test_each_row_equals_itself_alone_bitwise(runner, rows):
    rng = np.random.default_rng(rows)
    row_lora = rng.integers(0, 4, size=rows)
    row_lora[0] = 3  # odd rank 7: blocks padded to even offsets
    x, width = _inputs(runner, rows, rows)
    _, together = _products(runner, row_lora, x, width)
    for r in np.flatnonzero(row_lora):  # alone, the row is row 0 of a step of its own
        for fused in FUSED:
            y0 = torch.linspace(-1, 1, rows * width[fused]).reshape(-1, width[fused]).to(torch.bfloat16)
            alone = _alone(runner, row_lora[r], x[fused][r : r + 1].clone(), y0[r : r + 1], fused)
            assert torch.equal(together[fused][r], alone[0]), (rows, r, fused)
    base = row_lora == 0
    for fused in FUSED:
        y0 = torch.linspace(-1, 1, rows * width[fused]).reshape(-1, width[fused]).to(torch.bfloat16)
        assert torch.equal(together[fused][torch.from_numpy(base)], y0[torch.from_numpy(base)])


def _alone(runner, lora_id, x, y, fused):
    step = grouping.group_rows(np.array([lora_id]), *_view(runner))
    return step.layer(0).add_(fused, x, y.clone())


def test_stacked_agrees_with_the_per_adapter_products(runner):
    row_lora = np.array([1, 2, 0, 3, 1, 2])
    x, width = _inputs(runner, len(row_lora), 5)
    _, stacked = _products(runner, row_lora, x, width)
    loop = grouping.group_rows(row_lora, runner.adapters.snapshot(), runner.device)  # no stacks
    assert loop.stacked is None
    for fused in FUSED:
        y = torch.linspace(-1, 1, len(row_lora) * width[fused]).reshape(-1, width[fused]).to(torch.bfloat16)
        reference = loop.layer(0).add_(fused, x[fused], y.clone()).float()
        assert (stacked[fused].float() - reference).abs().max() <= 0.02 * reference.abs().max(), fused
        assert not torch.equal(stacked[fused], y)  # the products did add something


def test_loading_and_evicting_rebuild_the_stack(runner, tiny_hf, tmp_path):
    assert runner.adapters.step_view()[1].ids == (1, 2, 3)
    x, width = _inputs(runner, 3, 9)
    _, before = _products(runner, [1, 0, 3], x, width)
    save_adapter(tiny_hf, str(tmp_path / "a4"), 4, ATTENTION, seed=4)
    runner.load_adapter(4, "a4", str(tmp_path / "a4"))
    assert runner.adapters.step_view()[1].ids == (1, 2, 3, 4)
    _, with_four = _products(runner, [1, 0, 3], x, width)
    runner.evict_adapter(4)
    assert runner.adapters.step_view()[1].ids == (1, 2, 3)
    for fused in FUSED:  # another adapter in the stack changes no row's bits
        assert torch.equal(before[fused], with_four[fused]), fused
