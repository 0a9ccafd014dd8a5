"""Reading a llama-architecture GGUF: architecture facts, dequantized weights, tokenizer.

Three facts decide token parity with transformers:
- tensors mix Q4_1, Q8_0 and F32; all are dequantized to float32 with `gguf.quants.dequantize`;
- llama.cpp's converter permutes the rows of the Q and K projections for its interleaved RoPE;
  we use rotate-half RoPE, so the permutation is undone exactly as transformers' GGUF loader does;
- the token embedding doubles as the output projection when the file has no `output.weight`.
The tokenizer is stored as vocab + merges + token types; it is rebuilt as a byte-level BPE with the
`tokenizers` library so the scheduler can get a plain tokenizer.json.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import torch

from model_service.models.llama import LlamaArchConfig

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
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT}


@dataclasses.dataclass
class GGUFContents:
    arch: LlamaArchConfig
    state_dict: dict[str, torch.Tensor]
    metadata: dict


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_metadata(reader) -> dict:
    """Scalar and string metadata (the big token arrays are read separately)."""
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
    return {key: field.contents() for key, field in reader.fields.items() if key not in skip and not key.startswith("GGUF.")}


def arch_from_metadata(meta: dict) -> LlamaArchConfig:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported (only 'llama')")
    return LlamaArchConfig(
        vocab_size=int(meta.get("llama.vocab_size", 0)),
        hidden_size=int(meta["llama.embedding_length"]),
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_hidden_layers=int(meta["llama.block_count"]),
        num_attention_heads=int(meta["llama.attention.head_count"]),
        num_key_value_heads=int(meta.get("llama.attention.head_count_kv", meta["llama.attention.head_count"])),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(meta["llama.context_length"]),
    )


def reverse_rope_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves).

    llama.cpp wrote rows of each head as (dim/2, 2) -> (2, dim/2) swapped; swapping back gives
    the Hugging Face layout. Same arithmetic as transformers' `_reverse_permute_weights`.
    """
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def load_gguf(path: str) -> GGUFContents:
    import gguf

    reader = gguf.GGUFReader(path)
    meta = read_metadata(reader)
    arch = arch_from_metadata(meta)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        # np.array copies: F32 tensors come back as read-only views of the memory-mapped file.
        weights = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        match = _BLOCK.match(tensor.name)
        if match:
            layer, kind = match.groups()
            if kind == "attn_q":
                weights = reverse_rope_permute(weights, arch.num_attention_heads)
            elif kind == "attn_k":
                weights = reverse_rope_permute(weights, arch.num_key_value_heads)
            name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"
        elif tensor.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[tensor.name]
        else:
            continue  # e.g. rope_freqs: the forward computes its own
        state[name] = torch.from_numpy(np.ascontiguousarray(weights))
    tied = "lm_head.weight" not in state
    vocab = state["model.embed_tokens.weight"].shape[0]
    arch = dataclasses.replace(arch, vocab_size=vocab, tie_word_embeddings=tied)
    return GGUFContents(arch=arch, state_dict=state, metadata=meta)


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
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


@functools.lru_cache(maxsize=4)
def load_gguf_tokenizer(path: str) -> GGUFTokenizer:
    """Rebuild the file's byte-level BPE tokenizer; ids match transformers' GGUF tokenizer."""
    import gguf
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    reader = gguf.GGUFReader(path)
    model_type = _field(reader, "tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(f"model: GGUF tokenizer type {model_type!r} is not supported (only byte-level 'gpt2')")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges: list[str] = _field(reader, "tokenizer.ggml.merges")
    types = list(_field(reader, "tokenizer.ggml.token_type", []))

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # Tokens written outside the byte alphabet (rare) are respelled byte by byte, as transformers does.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)
    }
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    split = _PRE_SPLITS.get(_field(reader, "tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match whole in text, as special added tokens. A
    # "control" token outside the byte alphabet is a llama.cpp mislabel and is skipped.
    control = [t for t, k in zip(tokens, types) if k == _TOKEN_CONTROL and set(t) <= alphabet]
    user = [t for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED and t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    def token_at(key: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{key}")
        return None if index is None else tokens[int(index)]

    special = {
        name: value
        for name, value in (
            ("bos_token", token_at("bos_token_id")),
            ("eos_token", token_at("eos_token_id")),
            ("pad_token", token_at("padding_token_id")),
            ("unk_token", token_at("unknown_token_id")),
        )
        if value is not None
    }
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
