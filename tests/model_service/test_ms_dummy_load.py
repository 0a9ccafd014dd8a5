"""`--load-format dummy`: seeded random weights of a named shape or a config.json, built on the
device at their fused shapes; no checkpoint read, nothing written."""
from __future__ import annotations

import builtins
import json
import os

import pytest
import torch

from model_service.config import DUMMY_SHAPE_NAMES, ModelServiceConfig
from model_service.loading.build import checkpoint_shapes
from model_service.loading.dummy import STD, build_dummy_model
from model_service.loading.hf_folder import arch_from_config
from model_service.loading.loader import load_model
from model_service.loading.shapes import DUMMY_SHAPES, dummy_config
from model_service.models.llama import LlamaForCausalLM
from model_service.start import build_runner
from tools.cli import build_parser, check_model_flags


def dummy(model: str = "tiny", **overrides) -> ModelServiceConfig:
    values = dict(model=model, load_format="dummy", dtype="float32", device="cpu",
                  num_kv_blocks=64, max_num_slots=8)
    values.update(overrides)
    return ModelServiceConfig(**values)


@pytest.mark.parametrize("name, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, tied", [
    ("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, True),
    ("llama-1b", 16, 2048, 32, 8, 64, 8192, 49152, True),
    ("llama-8b", 32, 4096, 32, 8, 128, 14336, 128256, False),
])
def test_named_shapes(name, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, tied):
    arch = arch_from_config(dummy_config(name)[0])
    assert (arch.num_hidden_layers, arch.hidden_size, arch.num_attention_heads,
            arch.num_key_value_heads, arch.head_dim, arch.intermediate_size, arch.vocab_size,
            arch.tie_word_embeddings) == (layers, hidden, heads, kv_heads, head_dim, ffn, vocab,
                                          tied)
    with torch.device("meta"):  # the 8B shape's parameter count, without its memory
        count = sum(p.numel() for p in LlamaForCausalLM(arch).parameters())
    expected = {"smollm2-135m": 134.5e6, "llama-1b": 1.074e9, "llama-8b": 8.03e9}[name]
    assert count == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_weights_at_their_shapes_in_the_dtype(dtype):
    arch = arch_from_config(DUMMY_SHAPES["smollm2-135m"])
    model = build_dummy_model(arch, dtype, "cpu", seed=0, gemm_isa="torch")
    state = model.state_dict()
    with torch.device("meta"):
        expected = LlamaForCausalLM(arch).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        k: tuple(v.shape) for k, v in expected.items()}
    assert state["model.layers.0.self_attn.qkv_proj.weight"].shape == (576 + 2 * 192, 576)
    assert state["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 1536, 576)
    assert all(t.dtype == dtype and t.device.type == "cpu" for t in state.values())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as SmolLM2
    assert torch.all(state["model.norm.weight"] == 1)
    qkv = state["model.layers.3.self_attn.qkv_proj.weight"].float()
    assert abs(qkv.std().item() - STD) < 0.002 and abs(qkv.mean().item()) < 0.001
    # checkpoint_shapes is what a checkpoint of this shape would hold: the split is the same.
    assert set(model.hf_state_dict()) - {"lm_head.weight"} == set(checkpoint_shapes(arch))


def test_untied_shape_gets_its_own_lm_head():
    arch = arch_from_config({**DUMMY_SHAPES["tiny"], "tie_word_embeddings": False})
    model = build_dummy_model(arch, torch.float32, "cpu")
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_same_seed_same_weights_other_seed_other_weights():
    arch = arch_from_config(DUMMY_SHAPES["tiny"])
    first, again, other = (build_dummy_model(arch, torch.bfloat16, "cpu", seed=s).state_dict()
                           for s in (7, 7, 8))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.layers.1.mlp.down_proj.weight"],
                           other["model.layers.1.mlp.down_proj.weight"])


def test_no_checkpoint_read_nothing_written(tmp_path, monkeypatch):
    """The shape comes from a config.json in a read-only folder; the only files opened are that
    config.json and the tokenizer (SmolLM2's GGUF), and only for reading."""
    folder = tmp_path / "shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DUMMY_SHAPES["tiny"]))
    folder.chmod(0o555)
    opened = []
    real_open = builtins.open

    def recording_open(file, mode="r", *args, **kwargs):
        opened.append((str(file), mode))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", recording_open)
    monkeypatch.chdir(folder)
    loaded = load_model(dummy(str(folder)))
    monkeypatch.undo()
    assert loaded.name == "dummy-shape" and loaded.weights.startswith("dummy")
    assert os.listdir(folder) == ["config.json"]
    assert all("w" not in mode and "a" not in mode and "+" not in mode for _, mode in opened)
    weight_files = [f for f, _ in opened if f.endswith((".safetensors", ".bin", ".pt"))]
    assert weight_files == []
    assert {f for f, _ in opened if f.endswith((".json", ".gguf"))} <= {
        str(folder / "config.json"), *(f for f, _ in opened if f.endswith("Q4_1.gguf"))}


def test_a_folder_tokenizer_or_the_flag_serves(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder = tmp_path / "with-tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DUMMY_SHAPES["tiny"]))
    Tokenizer(WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>")).save(
        str(folder / "tokenizer.json"))
    assert json.loads(load_model(dummy(str(folder))).tokenizer_json)["model"]["type"] == "WordLevel"
    by_flag = load_model(dummy("tiny", tokenizer=str(folder)))
    assert json.loads(by_flag.tokenizer_json)["model"]["type"] == "WordLevel"


def test_describe_says_the_weights_are_dummy():
    runner = build_runner(load_model(dummy(dummy_seed=3)), dummy(dummy_seed=3))
    facts = runner.describe_facts()
    assert facts.compute["weights"] == "dummy (seed 3, normal std 0.02)"
    assert facts.model_name == "dummy-tiny"


def test_the_config_knows_every_shape_by_name():
    assert tuple(DUMMY_SHAPES) == DUMMY_SHAPE_NAMES


def test_bad_names_and_combinations_are_refused_in_one_line():
    with pytest.raises(ValueError) as error:
        dummy("llama-70b").validate()
    assert str(error.value) == (
        "model: 'llama-70b' is not a dummy shape (tiny, smollm2-135m, llama-1b, llama-8b), a "
        "config.json file nor a folder holding one")
    with pytest.raises(ValueError, match="load_format: dummy"):
        dummy(quantization="int8").validate()
    with pytest.raises(ValueError, match="tokenizer:"):
        dummy(tokenizer="/nonexistent").validate()
    with pytest.raises(ValueError, match="load_format"):
        dummy(load_format="pt").validate()


def test_planserve_serve_takes_the_flags():
    args = build_parser().parse_args(
        ["serve", "--load-format", "dummy", "--model", "llama-8b", "--dummy-seed", "2"])
    check_model_flags(args)
    assert (args.load_format, args.model, args.dummy_seed) == ("dummy", "llama-8b", 2)
