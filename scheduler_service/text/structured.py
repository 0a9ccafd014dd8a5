"""Structured output: a JSON schema, a regex or a list of choices constrains decoding.

Two grammar engines (`--grammar-engine`): llguidance (the default; text/grammar_llg.py: an
Earley parser that computes each step's mask from the grammar, compiled in about a millisecond;
it needs a vocabulary that spells every byte, which the word-level vocabularies of the
scheduler's unit tests do not) and outlines-core (a grammar becomes a regex, a JSON schema
through its schema-to-regex builder, the regex an `Index` over the model's vocabulary: a DFA
whose every state knows its allowed tokens, 0.05 s to seconds to build). Both accept the same
JSON documents for a schema: an object that declares properties gets only those unless it sets
additionalProperties (grammar_llg.closed).
Each request walks the grammar (text/guides.py).

Where each part runs:
- intake (event loop, cheap): `spec_from_pb` checks the request's StructuredOutput and parses a
  schema as JSON; errors name `structured_output.<field>`.
- compilation (`GrammarCompiler.compile`, about 1 ms with llguidance, 10 ms to seconds with
  outlines-core): off the event loop, in an executor, before the request is admitted; cached by
  (kind, text) in an LRU, so a repeated schema costs nothing. The vocabulary (the tokenizer's
  tokens as the bytes they stand for) is built once, on the first compile.
- every step (`fill_plan_masks`, event loop): each constrained sequence that samples in the
  step gets its allowed-token bitmask written straight from its guide into one numpy block,
  sent as BatchPlan.masked_slots + allowed_token_bitmask; the model side masks its logits.
- every result (`GuideState.accept`, in OutputProcessor.take_tokens): the guide advances by the
  sampled token. With a reasoning parser the grammar applies after the think block
  (text/guides.py).
End-of-sequence tokens are allowed only in the grammar's final states. Preemption needs no
special care: a preempted sequence keeps its generated tokens and its guide, which has already
consumed exactly those tokens.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import re
import threading
from typing import Callable, Iterable, Optional

import numpy as np

from scheduler_service.text.grammar_llg import LlgEngine
from scheduler_service.text.guides import Grammar, OpeningMasks, OutlinesWalk, Walk
from scheduler_service.text.token_bytes import token_bytes

KINDS = ("json_schema", "regex", "choice", "json_object")
ENGINES = ("llguidance", "outlines")  # --grammar-engine
DEFAULT_ENGINE = "llguidance"  # compiles a tool's schema in ~1 ms (docs/benchmarks.md)
MAX_GRAMMAR_CHARS = 65536
MAX_CHOICES = 1024
DEFAULT_CACHE_SIZE = 128


def _any_object_regex() -> str:
    """Any JSON object (StructuredOutput.json_object) whose values nest at most two deep
    (an object of primitives, flat objects and flat arrays). outlines-core's regex for the
    schema {"type": "object"} nests three deep and takes ~13 s to index over a 49k vocabulary;
    this one ~0.8 s."""
    from outlines_core.json_schema import NUMBER, STRING, WHITESPACE

    primitive = rf"({STRING}|{NUMBER}|true|false|null)"

    def obj(value: str) -> str:
        member = rf"{STRING}{WHITESPACE}:{WHITESPACE}{value}"
        return rf"\{{{WHITESPACE}({member}({WHITESPACE},{WHITESPACE}{member})*)?{WHITESPACE}\}}"

    def array(value: str) -> str:
        return rf"\[{WHITESPACE}({value}({WHITESPACE},{WHITESPACE}{value})*)?{WHITESPACE}\]"

    return obj(rf"({primitive}|{obj(primitive)}|{array(primitive)})")


class StructuredOutputError(ValueError):
    """A bad StructuredOutput, naming its field (intake turns it into INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True)
class StructuredSpec:
    """A request's grammar, as the cache key: kind (one of KINDS) and its text (the schema,
    the regex, the choices as a JSON list, "" for json_object)."""

    kind: str
    text: str


def spec_from_pb(pb) -> Optional[StructuredSpec]:
    """A planserve.v1.StructuredOutput (or None when unset) -> its checked spec. Cheap: the
    schema is parsed as JSON here, compiled later."""
    kind = pb.WhichOneof("kind")
    if kind is None:
        raise StructuredOutputError(
            "structured_output", "one of json_schema, regex, choice or json_object must be set"
        )
    field = f"structured_output.{kind}"
    if kind == "json_object":
        if not pb.json_object:
            raise StructuredOutputError(field, "must be true when set")
        return StructuredSpec("json_object", "")
    if kind == "choice":
        choices = list(pb.choice.choices)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise StructuredOutputError(
                f"{field}.choices", f"must hold 1 to {MAX_CHOICES} strings, got {len(choices)}"
            )
        for index, choice in enumerate(choices):
            if not choice:
                raise StructuredOutputError(f"{field}.choices[{index}]", "must not be empty")
        text = json.dumps(choices, ensure_ascii=False)
        if len(text) > MAX_GRAMMAR_CHARS:
            raise StructuredOutputError(
                f"{field}.choices", f"at most {MAX_GRAMMAR_CHARS} characters in all"
            )
        return StructuredSpec("choice", text)
    text = getattr(pb, kind)
    if not text:
        raise StructuredOutputError(field, "must not be empty")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise StructuredOutputError(
            field, f"at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}"
        )
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as error:
            raise StructuredOutputError(field, f"not valid JSON ({error})") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError(field, "must be a JSON object (a schema)")
    return StructuredSpec(kind, text)


def to_regex(spec: StructuredSpec) -> str:
    """The regex the whole output must match."""
    if spec.kind == "regex":
        return spec.text
    if spec.kind == "json_object":
        return _any_object_regex()
    if spec.kind == "choice":
        return "(" + "|".join(re.escape(choice) for choice in json.loads(spec.text)) + ")"
    from outlines_core.json_schema import build_regex_from_schema

    return build_regex_from_schema(spec.text)


# ---- compiled grammars and guides -----------------------------------------------------------


class GrammarCompiler:
    """Compiles specs into Grammars over the served model's vocabulary, with an LRU cache.
    Thread-safe: `compile` runs in executor threads."""

    def __init__(
        self,
        tokenizer_json: str,
        eos_token_ids: Iterable[int],
        vocab_size: int,
        cache_size: int = DEFAULT_CACHE_SIZE,
        engine: str = DEFAULT_ENGINE,
    ):
        if engine not in ENGINES:
            raise ValueError(f"grammar engine {engine!r}: must be one of {', '.join(ENGINES)}")
        self.engine = engine
        self._llg: Optional[LlgEngine] = None  # built on the first llguidance compile
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = tuple(sorted(eos_token_ids))
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._cache_size = cache_size
        self._cache: collections.OrderedDict[StructuredSpec, Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        # Specs being compiled right now -> the grammar's future, for concurrent callers.
        self._compiling: dict[StructuredSpec, concurrent.futures.Future[Grammar]] = {}
        self._vocabulary = None
        self._token_bytes: dict[int, bytes] = {}  # every token's bytes, with the vocabulary
        self._special: set[int] = set()
        self._openings: Optional[OpeningMasks] = None
        self._vocabulary_lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and logs

    def _check_eos(self) -> None:
        if not self._eos_token_ids:
            raise StructuredOutputError(
                "structured_output", "the served model has no end-of-sequence token"
            )

    def _spelled(self) -> tuple[dict[int, bytes], set[int]]:
        """(every token's bytes, the special ids), read once; the opening masks with them."""
        with self._vocabulary_lock:
            if self._openings is None:
                by_id, special = token_bytes(self._tokenizer_json)
                self._token_bytes, self._special = by_id, special
                self._openings = OpeningMasks(by_id, self.num_words)
            return self._token_bytes, self._special

    def _get_vocabulary(self):
        self._check_eos()
        by_id, special = self._spelled()
        with self._vocabulary_lock:
            if self._vocabulary is None:
                from outlines_core import Vocabulary

                eos = set(self._eos_token_ids)
                by_bytes: dict[bytes, list[int]] = {}
                for token_id, spelled in by_id.items():
                    # Special and end-of-sequence tokens never match text; EOS is added to the
                    # masks of final states instead.
                    if (
                        token_id in special
                        or token_id in eos
                        or not spelled
                        or token_id >= self.vocab_size
                    ):
                        continue
                    by_bytes.setdefault(spelled, []).append(token_id)
                self._vocabulary = Vocabulary(self._eos_token_ids[0], by_bytes)
            return self._vocabulary

    def _get_llg(self) -> LlgEngine:
        self._check_eos()
        by_id, special = self._spelled()
        with self._vocabulary_lock:
            if self._llg is None:
                self._llg = LlgEngine(
                    self._tokenizer_json, by_id, special, self._eos_token_ids, self.vocab_size
                )
            return self._llg

    def compile(self, spec: StructuredSpec) -> Grammar:
        """The grammar of `spec`, from the cache or compiled now (slow: call off the event
        loop). Concurrent calls for one spec compile it once (the others wait for it).
        StructuredOutputError names the field when the grammar cannot be compiled."""
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                return grammar
            owners = self._compiling.get(spec)
            if owners is None:  # this call compiles it
                compiling: concurrent.futures.Future[Grammar] = concurrent.futures.Future()
                self._compiling[spec] = compiling
        if owners is not None:
            return owners.result()  # the owner's grammar, or its error
        try:
            grammar = self._compile(spec)
        except BaseException as error:
            with self._lock:
                del self._compiling[spec]
            compiling.set_exception(error)
            raise
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            del self._compiling[spec]
        compiling.set_result(grammar)
        return grammar

    def _compile(self, spec: StructuredSpec) -> Grammar:
        field = f"structured_output.{spec.kind}"
        if spec.kind == "choice":
            field += ".choices"
        try:
            walk = self._walk_factory(spec)
        except (ValueError, TypeError) as error:
            raise StructuredOutputError(field, f"cannot be compiled ({error})") from None
        return Grammar(walk, self._eos_token_ids, self.num_words, self._token_bytes, self._openings)

    def _walk_factory(self, spec: StructuredSpec) -> Callable[[], Walk]:
        """The engine's compiled grammar, as the maker of one sequence's walk."""
        if self.engine == "llguidance":
            llg = self._get_llg()
            return llg.compile(llg.grammar(spec.kind, spec.text, lambda: to_regex(spec)))
        from outlines_core import Index

        regex = to_regex(spec)
        index = Index(regex, self._get_vocabulary())
        return lambda: OutlinesWalk(index)


def fill_plan_masks(plan) -> None:
    """Puts every constrained sequence whose grammar applies and that samples in this step (a
    decode, or a prefill chunk reaching the end of its known tokens) into plan.masked_slots,
    with its allowed tokens in plan.allowed_token_bitmask."""
    rows = [
        (slot, request.guide)
        for request, slot, num_scheduled in zip(
            plan.requests, plan.slots, plan.num_scheduled_tokens
        )
        if request.guide is not None
        and request.guide.masked  # a guide waiting for the end of thinking leaves it free
        and request.num_computed_tokens + num_scheduled >= request.num_tokens
    ]
    if not rows:
        return
    masks = np.zeros((len(rows), rows[0][1].grammar.num_words), dtype="<u4")
    for row, (_, guide) in zip(masks, rows):
        guide.write_mask(row)
    plan.masked_slots = [slot for slot, _ in rows]
    plan.allowed_token_bitmask = masks.tobytes()
