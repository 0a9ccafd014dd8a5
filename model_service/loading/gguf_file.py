"""Reading a llama-architecture GGUF: architecture facts, dequantized weights, tokenizer.

Four facts decide token parity with transformers:
- tensors mix Q4_1, Q8_0 and F32; each is dequantized to float32 with `gguf.quants.dequantize`
  when the loader asks for it (GGUFWeights: one tensor at a time, never the whole file);
- llama.cpp's converter permutes the rows of the Q and K projections for its interleaved RoPE;
  we use rotate-half RoPE, so the permutation is undone exactly as transformers' GGUF loader does;
- the token embedding doubles as the output projection when the file has no `output.weight`;
- RoPE: a `rope_freqs` tensor divides each frequency (llama.cpp's converter writes Llama 3.1's
  scaling that way), `{arch}.rope.scaling.type` linear divides them all; other scaling types are
  refused by name rather than loaded with the wrong positions.
The tokenizer is stored as vocab + merges + token types; it is rebuilt as a byte-level BPE with the
`tokenizers` library so the scheduler can get a plain tokenizer.json.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional

import numpy as np
import torch

from model_service.loading.weights import sliced
from model_service.models.arch import LlamaArchConfig
from model_service.models.rope import RopeScaling

# llama.cpp token types (gguf.TokenType).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")

# Pre-tokenizer split regexes by `tokenizer.ggml.pre` (the same table transformers uses); any
# other value gets byte-level BPE's default GPT-2 split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
}


@dataclasses.dataclass
class GGUFContents:
    arch: LlamaArchConfig
    weights: "GGUFWeights"
    metadata: dict


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_metadata(reader) -> dict:
    """Scalar and string metadata (the big token arrays are read separately)."""
    skip = {
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.scores",
    }
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if key not in skip and not key.startswith("GGUF.")
    }


# general.architecture values this reader knows: llama.cpp writes Llama 1-3 and Mistral as "llama".
GGUF_ARCHITECTURES = ("llama",)
_ROPE_FREQS = "rope_freqs.weight"


def arch_from_metadata(meta: dict, rope_freqs: Optional[np.ndarray] = None) -> LlamaArchConfig:
    """The architecture facts; ValueError naming the metadata key our forward cannot honour."""
    arch = meta["general.architecture"]
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"model: GGUF general.architecture {arch!r} is not supported (one of "
            f"{GGUF_ARCHITECTURES})"
        )
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rotated = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotated != head_dim:
        raise ValueError(
            f"model: GGUF {arch}.rope.dimension_count {rotated} != head dim {head_dim} (partial "
            "RoPE is "
            "not supported)"
        )
    if int(meta.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ValueError(
            f"model: GGUF {arch}.attention.value_length {meta[f'{arch}.attention.value_length']} "
            "!= "
            f"key_length {head_dim}"
        )
    return LlamaArchConfig(
        vocab_size=int(meta.get(f"{arch}.vocab_size", 0)),
        hidden_size=hidden,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_hidden_layers=int(meta[f"{arch}.block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(meta[f"{arch}.context_length"]),
        head_dim=head_dim,
        rope_scaling=_rope_scaling(meta, arch, rope_freqs),
    )


def _rope_scaling(meta: dict, arch: str, rope_freqs: Optional[np.ndarray]) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_freqs is not None:
        if kind not in ("none",):
            raise ValueError(
                f"model: GGUF has both a rope_freqs tensor and {arch}.rope.scaling.type {kind!r}"
            )
        return RopeScaling(
            rope_type="llama3", freq_factors=tuple(float(f) for f in rope_freqs.reshape(-1))
        )
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
    raise ValueError(
        f"model: GGUF {arch}.rope.scaling.type {kind!r} is not supported (only 'none', 'linear', "
        "or a "
        "rope_freqs tensor)"
    )


def reverse_rope_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves).

    llama.cpp wrote rows of each head as (dim/2, 2) -> (2, dim/2) swapped; swapping back gives
    the Hugging Face layout. Same arithmetic as transformers' `_reverse_permute_weights`.
    """
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


class GGUFWeights:
    """A GGUF's tensors under Hugging Face names, each dequantized to float32 when read."""

    def __init__(self, reader, arch: LlamaArchConfig) -> None:
        self._arch = arch
        self._last: Optional[tuple[str, torch.Tensor]] = None
        self._tensors = {}
        for tensor in reader.tensors:
            match = _BLOCK.match(tensor.name)
            if match:
                layer, kind = match.groups()
                if kind not in _LAYER_NAMES:
                    raise ValueError(
                        f"model: GGUF tensor {tensor.name!r} is not one our forward uses"
                    )
                self._tensors[f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"] = tensor
            elif tensor.name in _GLOBAL_NAMES:
                self._tensors[_GLOBAL_NAMES[tensor.name]] = tensor
            elif tensor.name != _ROPE_FREQS:  # read into the architecture's rope scaling
                raise ValueError(f"model: GGUF tensor {tensor.name!r} is not one our forward uses")

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(
            int(n) for n in reversed(self._tensors[name].shape)
        )  # GGML writes the row count last

    def read(
        self, name: str, rows: Optional[slice] = None, columns: Optional[slice] = None
    ) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = None  # dropped before the next one is made
            self._last = (name, self._dequantized(name))
        whole = self._last[1]
        # A slice is copied: a view would keep the whole dequantized tensor alive in the model.
        return whole if rows is None and columns is None else sliced(whole, rows, columns).clone()

    def _dequantized(self, name: str) -> torch.Tensor:
        """The whole tensor in float32 (kept: the loader may read it in chunks)."""
        import gguf

        tensor = self._tensors[name]
        # np.array copies: F32 tensors come back as read-only views of the memory-mapped file.
        weights = np.array(
            gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32
        )
        if name.endswith("self_attn.q_proj.weight"):
            weights = reverse_rope_permute(weights, self._arch.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            weights = reverse_rope_permute(weights, self._arch.num_key_value_heads)
        return torch.from_numpy(np.ascontiguousarray(weights))


def load_gguf(path: str) -> GGUFContents:
    """The architecture and a lazy view of the weights (nothing dequantized yet)."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = read_metadata(reader)
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    arch = arch_from_metadata(
        meta, None if freqs is None else np.array(freqs.data, dtype=np.float32)
    )
    weights = GGUFWeights(reader, arch)
    tied = "lm_head.weight" not in weights.names()
    arch = dataclasses.replace(
        arch, vocab_size=weights.shape("model.embed_tokens.weight")[0], tie_word_embeddings=tied
    )
    return GGUFContents(arch=arch, weights=weights, metadata=meta)


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


@dataclasses.dataclass(frozen=True)
class GGUFTokenizer:
    tokenizer_json: str
    chat_template: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    special_tokens: dict
    vocab_size: int


def _special_tokens(reader, tokens: list[str]) -> dict[str, str]:
    """The bos / eos / pad / unk token strings the file names by id."""
    special = {}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("pad_token", "padding_token_id"),
        ("unk_token", "unknown_token_id"),
    ):
        index = _field(reader, f"tokenizer.ggml.{key}")
        if index is not None:
            special[name] = tokens[int(index)]
    return special


@functools.lru_cache(maxsize=4)
def load_gguf_tokenizer(path: str) -> GGUFTokenizer:
    """Rebuild the file's byte-level BPE tokenizer; ids match transformers' GGUF tokenizer."""
    import gguf

    reader = gguf.GGUFReader(path)
    model_type = _field(reader, "tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(
            f"model: GGUF tokenizer type {model_type!r} is not supported (only byte-level 'gpt2')"
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges: list[str] = _field(reader, "tokenizer.ggml.merges")
    types = list(_field(reader, "tokenizer.ggml.token_type", []))

    tokenizer = _byte_level_bpe(reader, tokens, merges, types)

    special = _special_tokens(reader, tokens)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    # DescribeResponse.bos_token_id means "prepended to text prompts", which only holds when the
    # file says add_bos_token (llama.cpp's default for byte-level vocabularies is false).
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    return GGUFTokenizer(
        tokenizer_json=tokenizer.to_str(),
        chat_template=_field(reader, "tokenizer.chat_template", "") or "",
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token_id=int(bos) if (bos is not None and add_bos) else None,
        special_tokens=special,
        vocab_size=len(tokens),
    )


def _byte_level_bpe(reader, tokens: list[str], merges: list[str], types: list):
    """The tokenizers.Tokenizer the file describes: BPE over the byte alphabet, its
    pre-tokenizer split, and its control and user-defined tokens as added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # Tokens written outside the byte alphabet (rare) are respelled byte by byte, as transformers
    # does.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    bpe = models.BPE(
        vocab=vocab,
        merges=[_merge_pair(m) for m in merges],
        fuse_unk=False,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(bpe)
    split = _PRE_SPLITS.get(_field(reader, "tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match whole in text, as special added tokens. A
    # "control" token outside the byte alphabet is a llama.cpp mislabel and is skipped.
    control = [t for t, k in zip(tokens, types) if k == _TOKEN_CONTROL and set(t) <= alphabet]
    user = [t for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED and t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tokenizer


def _merge_pair(merge: str) -> tuple[str, str]:
    """A GGUF merge "a b" as the pair BPE takes."""
    first, _, second = merge.partition(" ")
    return first, second
