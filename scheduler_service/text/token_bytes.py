"""What each token of a Hugging Face tokenizer spells, as bytes: the grammar engine matches token
bytes against its grammar (text/structured.py), and a guide waiting for a reasoning marker reads
them too."""

from __future__ import annotations

import json
import re
from typing import Optional


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spelling: the printable character standing for each byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    spelled = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return {char: b for b, char in spelled.items()}


_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_types(decoder: Optional[dict]) -> set[str]:
    if not decoder:
        return set()
    types = {decoder.get("type", "")}
    for inner in decoder.get("decoders", []) or []:
        types |= _decoder_types(inner)
    return types


def token_bytes(tokenizer_json: str) -> tuple[dict[int, bytes], set[int]]:
    """(id -> the bytes a token stands for, ids of special tokens), from a Hugging Face
    tokenizer.json. outlines-core matches token *bytes* against the regex, so a byte-level BPE
    token's spelling ("Ġthe") must be turned back into its bytes (b" the"); a SentencePiece
    token's "▁" is a space and "<0x0A>" a raw byte."""
    document = json.loads(tokenizer_json)
    model_vocab = document.get("model", {}).get("vocab") or {}
    if isinstance(model_vocab, list):  # Unigram: [[piece, score], ...], ids by position
        model_vocab = {piece: index for index, (piece, _score) in enumerate(model_vocab)}
    vocab: dict[str, int] = dict(model_vocab)
    special = set()
    for added in document.get("added_tokens", []) or []:
        vocab.setdefault(added["content"], added["id"])
        if added.get("special", False):
            special.add(added["id"])
    decoders = _decoder_types(document.get("decoder"))
    out: dict[int, bytes] = {}
    if "ByteLevel" in decoders:
        alphabet = _byte_level_alphabet()
        for token, token_id in vocab.items():
            try:
                out[token_id] = bytes(alphabet[char] for char in token)
            except KeyError:  # an added token spelled in plain text
                out[token_id] = token.encode("utf-8")
    else:
        for token, token_id in vocab.items():
            match = _BYTE_TOKEN.match(token)
            out[token_id] = (
                bytes([int(match.group(1), 16)])
                if match
                else token.replace("▁", " ").encode("utf-8")
            )
    return out, special
