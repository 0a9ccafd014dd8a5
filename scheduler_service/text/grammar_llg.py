"""llguidance as the grammar engine (`--grammar-engine llguidance`): vLLM's default, a Rust
Earley parser that computes each step's mask lazily from the grammar instead of precomputing a
DFA over the vocabulary, so a grammar compiles in about a millisecond where outlines-core's index
takes 0.05 s to seconds (docs/benchmarks.md). Each sequence walks a copy of the grammar's
matcher; its mask is written straight into the plan's bitmask row."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable, Iterable, Optional

import numpy as np

from scheduler_service.text.guides import Walk

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Separators as outlines-core writes them, and no free whitespace, so that both engines give the
# same documents.
_JSON_DEFAULTS: "JsonCompileOptions" = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


# Keywords whose value is one subschema, or a list or map of them, that may hold objects.
_ONE = ("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else")
_LISTS = ("items", "prefixItems", "anyOf", "oneOf")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def closed(schema):
    """`schema` (parsed JSON) with `"additionalProperties": false` given to every object schema
    that declares `properties` and does not set it, at any depth: outlines-core writes only the
    declared properties, llguidance reads JSON Schema's default (any more allowed), and a model
    left free to add keys may write them until max_tokens. An object without `properties`
    stays open, as outlines-core leaves it (any keys). allOf's members are not closed
    themselves (only what they hold): their intersection would refuse every property another
    member declares."""
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed_under(key, value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _closed_under(key: str, value):
    if key == "allOf" and isinstance(value, list):
        return [_closed_members(member) for member in value]
    if key in _LISTS and isinstance(value, list):
        return [closed(item) for item in value]
    if key in _MAPS and isinstance(value, dict):
        return {name: closed(item) for name, item in value.items()}
    if key in _ONE:
        return closed(value)
    return value


def _closed_members(member):
    """An allOf member: what it holds is closed, the member itself is left as written."""
    if not isinstance(member, dict):
        return member
    return {key: _closed_under(key, value) for key, value in member.items()}


class LlgWalk:
    """One sequence's llguidance matcher."""

    __slots__ = ("matcher",)

    def __init__(self, matcher):
        self.matcher = matcher

    def advance(self, token_id: int) -> bool:
        # Checked first: a refused token would put the matcher in its error state for good.
        if self.matcher.validate_tokens([token_id]) != 1:
            return False
        return bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()

    def write(self, row: np.ndarray) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def is_final(self) -> bool:
        return bool(self.matcher.is_accepting())


class _Vocabulary:
    """The served vocabulary as llguidance's TokenizerWrapper reads it: every token's bytes as
    planserve spells them (text/token_bytes.py, the same as outlines-core gets, whatever the
    tokenizer's decoder), and the tokenizer for text llguidance tokenizes itself."""

    def __init__(
        self,
        tokenizer_json: str,
        by_id: dict[int, bytes],
        special: set[int],
        eos_token_ids: list[int],
        vocab_size: int,
    ):
        import tokenizers

        self._tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
        self.tokens = [by_id.get(token_id, b"") for token_id in range(vocab_size)]
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = None
        self.special_token_ids = sorted(i for i in special | set(eos_token_ids) if i < vocab_size)
        self._by_bytes: Optional[dict[bytes, int]] = None  # for _longest_first, built on use
        self._longest = 1

    def __call__(self, text) -> list[int]:
        """Token ids spelling `text` (llguidance tokenizes the text a grammar forces): the
        tokenizer's, when they spell it back, else the longest tokens first (a tokenizer that
        maps text it cannot split to an unknown token)."""
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = self._tokenizer.encode(
            data.decode("utf-8", errors="replace"), add_special_tokens=False
        ).ids
        if b"".join(self.tokens[i] for i in ids if i < len(self.tokens)) == data:
            return ids
        return self._longest_first(data)

    def _longest_first(self, data: bytes) -> list[int]:
        if self._by_bytes is None:
            self._by_bytes = {}
            for token_id, spelled in enumerate(self.tokens):
                if spelled and token_id not in self.special_token_ids:
                    self._by_bytes.setdefault(spelled, token_id)
            self._longest = max(map(len, self._by_bytes), default=1)
        ids, at = [], 0
        while at < len(data):
            for size in range(min(self._longest, len(data) - at), 0, -1):
                found = self._by_bytes.get(data[at : at + size])
                if found is not None:
                    ids.append(found)
                    at += size
                    break
            else:
                at += 1  # a byte no token spells: nothing can be forced there
        return ids


class LlgEngine:
    """Grammars over the served vocabulary; `compile` raises ValueError with llguidance's
    message when a grammar is refused."""

    def __init__(
        self,
        tokenizer_json: str,
        by_id: dict[int, bytes],
        special: set[int],
        eos_token_ids: Iterable[int],
        vocab_size: int,
    ):
        import llguidance

        self._llguidance = llguidance
        eos = list(eos_token_ids)
        vocabulary = _Vocabulary(tokenizer_json, by_id, special, eos, vocab_size)
        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(vocabulary), n_vocab=vocab_size, eos_token=eos
        )

    def grammar(self, kind: str, text: str, regex: Callable[[], str]) -> str:
        """The llguidance grammar of a spec (`regex`: its regex, for choice)."""
        matcher = self._llguidance.LLMatcher
        if kind == "json_schema":
            schema = closed(json.loads(text))
            return matcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        if kind == "json_object":
            schema = json.dumps({"type": "object"})
            return matcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        return matcher.grammar_from_regex(text if kind == "regex" else regex())

    def compile(self, grammar: str) -> Callable[[], Walk]:
        """The walk factory of a grammar, checked now (a bad one raises ValueError)."""
        template = self._llguidance.LLMatcher(self.tokenizer, grammar)
        if template.is_error():
            raise ValueError(template.get_error())
        return lambda: LlgWalk(template.deep_copy())
