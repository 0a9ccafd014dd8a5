"""Structured output on the scheduler side, without a model: the vocabulary outlines-core sees,
the masks the scheduler puts into plans (checked against brute force), and guides that stay
right through chunked prefills, preemption and parallel samples. A fake engine samples the
lowest allowed token of each masked slot, as a model service applying the mask would."""
from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models

from factories import EOS, WORDS, fake_result, make_request, make_scheduler, run_step
from scheduler_service.core.request import FinishReason
from scheduler_service.text.structured import (GrammarCompiler, StructuredSpec, fill_plan_masks,
                                          token_bytes)


def _word_level_json() -> str:
    from factories import make_tokenizer  # noqa: F401  (same vocabulary as the scheduler's)
    vocab = {word: i for i, word in enumerate(WORDS)}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens(["<eos>"])
    return tokenizer.to_str()


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    # outlines-core: llguidance needs a vocabulary that spells every byte, these words do not.
    return GrammarCompiler(_word_level_json(), [EOS], len(WORDS), engine="outlines")


@pytest.fixture(scope="module")
def smollm2_vocab():
    from model_service.loading.gguf_file import load_gguf_tokenizer
    from model_service.loading.loader import smollm2_path
    tokenizer = load_gguf_tokenizer(smollm2_path())
    return tokenizer.tokenizer_json, tuple(tokenizer.eos_token_ids), tokenizer.vocab_size


def _allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.astype("<u4").view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def _plan_masks(plan) -> dict[int, set[int]]:
    if not plan.masked_slots:
        return {}
    words = len(plan.allowed_token_bitmask) // 4 // len(plan.masked_slots)
    rows = np.frombuffer(plan.allowed_token_bitmask, dtype="<u4").reshape(-1, words)
    return {slot: _allowed(row) for slot, row in zip(plan.masked_slots, rows)}


def _masked_step(scheduler):
    """One step through a fake engine that samples the lowest allowed token of masked slots
    (token 50 elsewhere)."""
    plan = scheduler.schedule()
    masks = _plan_masks(plan)
    result = fake_result(plan, lambda request: min(masks[request.slot])
                         if request.slot in masks else 50)
    outputs = scheduler.take_early_outputs() + scheduler.update(plan, result)
    return plan, masks, outputs


def _constrained(grammars, regex: str, **fields):
    request = make_request(structured=StructuredSpec("regex", regex), **fields)
    request.guide = grammars.compile(request.structured).new_guide()
    return request


# ---- the vocabulary ----------------------------------------------------------------------------

def test_byte_level_tokens_become_their_bytes(smollm2_vocab):
    tokenizer_json, eos, vocab_size = smollm2_vocab
    by_id, special = token_bytes(tokenizer_json)
    vocab = tokenizers.Tokenizer.from_str(tokenizer_json)
    assert by_id[vocab.token_to_id("Ġthe")] == b" the"
    assert by_id[vocab.token_to_id("Ċ")] == b"\n"
    assert by_id[vocab.token_to_id("Ã©")] == "é".encode()
    assert set(eos) <= special and vocab.token_to_id("<|im_start|>") in special
    # Every token's bytes decode back to what the tokenizer decodes it to.
    for token_id in range(100, vocab_size, 997):
        assert by_id[token_id].decode("utf-8", "replace") == vocab.decode([token_id])


def test_sentencepiece_tokens_become_their_bytes():
    vocab = {"<unk>": 0, "<s>": 1, "▁hello": 2, "<0x0A>": 3, "world": 4}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens(["<s>"])
    by_id, special = token_bytes(tokenizer.to_str())
    assert (by_id[2], by_id[3], by_id[4]) == (b" hello", b"\n", b"world")
    assert special == {1}
    unigram = tokenizers.Tokenizer(models.Unigram(
        [("<unk>", 0.0), ("▁a", -1.0), ("<0x41>", -2.0), ("bc", -3.0)], unk_id=0,
        byte_fallback=True))
    unigram.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    by_id, _ = token_bytes(unigram.to_str())
    assert (by_id[1], by_id[2], by_id[3]) == (b" a", b"A", b"bc")


ENGINES = pytest.mark.parametrize("engine", ["outlines", "llguidance"])


@ENGINES
def test_choice_mask_matches_brute_force_and_eos_waits_for_a_final_state(smollm2_vocab, engine):
    tokenizer_json, eos, vocab_size = smollm2_vocab
    # A second end-of-sequence id (outlines-core knows one) and a model vocab larger than the
    # tokenizer's: both handled by the scheduler.
    eos_ids = (*eos, 0)
    compiler = GrammarCompiler(tokenizer_json, eos_ids, vocab_size + 64, engine=engine)
    choices = ["yes", "no", " maybe so"]
    guide = compiler.compile(StructuredSpec("choice", json.dumps(choices))).new_guide()
    by_id, special = token_bytes(tokenizer_json)
    expected = {i for i, spelled in by_id.items()
                if spelled and i not in special and any(c.encode().startswith(spelled)
                                                        for c in choices)}
    row = np.zeros(compiler.num_words, dtype="<u4")
    guide.write_mask(row)
    assert _allowed(row) == expected
    vocab = tokenizers.Tokenizer.from_str(tokenizer_json)
    for token_id in vocab.encode("yes", add_special_tokens=False).ids:
        assert guide.accept(token_id)
    assert guide.is_final
    row[:] = 0
    guide.write_mask(row)
    assert _allowed(row) == set(eos_ids)
    assert not guide.accept(vocab.token_to_id("no"))  # nothing may follow a whole choice


@ENGINES
def test_json_schema_and_object_compile_and_bad_ones_name_the_field(smollm2_vocab, engine):
    from scheduler_service.text.structured import StructuredOutputError
    compiler = GrammarCompiler(*smollm2_vocab, engine=engine)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"]})
    for spec in (StructuredSpec("json_schema", schema), StructuredSpec("json_object", "")):
        guide = compiler.compile(spec).new_guide()
        row = np.zeros(compiler.num_words, dtype="<u4")
        guide.write_mask(row)
        vocab = tokenizers.Tokenizer.from_str(smollm2_vocab[0])
        assert {vocab.decode([t]) for t in _allowed(row)} <= {"{", '{"', "{}", '{"}'}
    with pytest.raises(StructuredOutputError) as error:
        compiler.compile(StructuredSpec("regex", "(unclosed"))
    assert error.value.field == "structured_output.regex"


# No additionalProperties anywhere: the top object, one reached through $defs, one in an array.
_OPEN_SCHEMA = {"type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/B"},
                               "c": {"type": "array", "items": {"type": "object",
                                                                "properties": {"x": {"type": "integer"}}}}},
                "$defs": {"B": {"type": "object", "properties": {"x": {"type": "integer"}}}}}


def _walk(compiler, vocab, spec, document: str) -> tuple[str, bool]:
    """(the text the guide took before it refused a token, whether it took all and is final)."""
    guide = compiler.compile(spec).new_guide()
    taken = []
    for token_id in vocab.encode(document, add_special_tokens=False).ids:
        if not guide.accept(token_id):
            return vocab.decode(taken), False
        taken.append(token_id)
    return vocab.decode(taken), guide.is_final


@ENGINES
def test_a_schema_without_additional_properties_refuses_undeclared_keys_on_both_engines(
        smollm2_vocab, engine):
    compiler = GrammarCompiler(*smollm2_vocab, engine=engine)
    vocab = tokenizers.Tokenizer.from_str(smollm2_vocab[0])
    spec = StructuredSpec("json_schema", json.dumps(_OPEN_SCHEMA))
    assert _walk(compiler, vocab, spec, '{"a": 1, "b": {"x": 2}, "c": [{"x": 3}]}')[1]
    for document, before_the_extra_key in (
            ('{"a": 1, "z": 2}', '{"a": 1, '),
            ('{"a": 1, "b": {"x": 2, "z": 3}}', '{"a": 1, "b": {"x": 2'),
            ('{"a": 1, "c": [{"x": 3, "z": 4}]}', '{"a": 1, "c": [{"x": 3')):
        taken, whole = _walk(compiler, vocab, spec, document)
        assert not whole and taken.startswith(before_the_extra_key), (document, taken)
    # An explicit additionalProperties is the schema's to decide: llguidance then follows it.
    opened = StructuredSpec("json_schema", json.dumps(dict(_OPEN_SCHEMA, additionalProperties=True)))
    assert _walk(compiler, vocab, opened, '{"a": 1, "z": 2}')[1] is (engine == "llguidance")


def test_closing_gives_additional_properties_false_only_where_outlines_core_writes_declared_keys():
    from scheduler_service.text.grammar_llg import closed
    member = {"type": "object", "properties": {"q": {"properties": {}}}}
    schema = {"type": "object", "properties": {"o": {"type": "object"}, "p": {"properties": {}}},
              "anyOf": [{"properties": {}}], "allOf": [member], "definitions": {"D": {"properties": {}}},
              "additionalProperties": {"properties": {}}}
    got = closed(schema)
    assert got["additionalProperties"] == {"properties": {}, "additionalProperties": False}  # kept
    assert "additionalProperties" not in got["properties"]["o"]  # no properties: any keys, as outlines-core
    assert got["properties"]["p"]["additionalProperties"] is False
    assert got["anyOf"][0]["additionalProperties"] is False
    assert got["definitions"]["D"]["additionalProperties"] is False
    # An allOf member stays open (closed, it would refuse the other members' keys); what it holds closes.
    assert "additionalProperties" not in got["allOf"][0]
    assert got["allOf"][0]["properties"]["q"]["additionalProperties"] is False
    assert "additionalProperties" not in member["properties"]["q"]  # the caller's schema is untouched


@ENGINES
def test_the_cache_is_lru_by_spec(smollm2_vocab, engine):
    compiler = GrammarCompiler(*smollm2_vocab, cache_size=2, engine=engine)
    a, b, c = (StructuredSpec("regex", r) for r in ("ab", "cd", "ef"))
    first = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is first and compiler.num_compiled == 2
    compiler.compile(c)  # evicts b, the least recently used
    compiler.compile(a)
    assert compiler.num_compiled == 3
    compiler.compile(b)
    assert compiler.num_compiled == 4


@ENGINES
def test_concurrent_compiles_of_one_spec_compile_once(smollm2_vocab, engine):
    compiler = GrammarCompiler(*smollm2_vocab, engine=engine)
    spec = StructuredSpec("regex", "(ab|cd)+ef")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        grammars = list(pool.map(lambda _: compiler.compile(spec), range(16)))
    assert compiler.num_compiled == 1
    assert all(grammar is grammars[0] for grammar in grammars)
    bad = StructuredSpec("regex", "(unclosed")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(compiler.compile, bad) for _ in range(4)]
    for future in futures:
        assert future.exception().field == "structured_output.regex"


# ---- masks in plans ----------------------------------------------------------------------------

def test_only_the_sampling_step_of_a_constrained_sequence_is_masked(grammars):
    scheduler = make_scheduler(max_num_batched_tokens=4)
    constrained = _constrained(grammars, "w5w6w7", num_prompt_tokens=10, max_new_tokens=10)
    plain = make_request(num_prompt_tokens=2, max_new_tokens=3)
    scheduler.add_request(constrained)
    scheduler.add_request(plain)
    slot = None
    for num_scheduled in ([4], [4]):  # prompt chunks that end before the known tokens: no mask
        plan, masks, _ = _masked_step(scheduler)
        assert plan.num_scheduled_tokens == num_scheduled and masks == {}
        slot = plan.slots[0]
    plan, masks, _ = _masked_step(scheduler)  # the last 2 prompt tokens, and plain's 2
    assert plan.num_scheduled_tokens == [2, 2]
    assert masks == {slot: {5}}  # the plain request samples too, unmasked
    seen = []
    while scheduler.has_work():
        seen.append(_masked_step(scheduler)[1])
    # Then w6, w7, then only end of sequence.
    assert [m for m in seen if m] == [{slot: {6}}, {slot: {7}}, {slot: {EOS}}]
    assert constrained.output_token_ids == [5, 6, 7, EOS]
    assert constrained.finish_reason is FinishReason.EOS
    assert plain.output_token_ids == [50, 50, 50]


def test_guides_stay_right_through_preemption(grammars):
    # 12 blocks of 4 tokens for four sequences growing to 6 + 10 tokens: they preempt.
    scheduler = make_scheduler(num_blocks=13, block_size=4, max_num_batched_tokens=16)
    regex = "(w2|w3)w4w5w6w7w8w9w10w11w12"
    requests = [_constrained(grammars, regex, num_prompt_tokens=6, max_new_tokens=12)
                for _ in range(4)]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(500):
        if not scheduler.has_work():
            break
        _masked_step(scheduler)
    assert scheduler.num_preemptions_total > 0
    for request in requests:
        assert request.output_token_ids == [2, 4, 5, 6, 7, 8, 9, 10, 11, 12, EOS]
        assert request.finish_reason is FinishReason.EOS
    assert scheduler._num_constrained == 0


def test_parallel_samples_start_from_the_grammars_first_state(grammars):
    scheduler = make_scheduler()
    parent = _constrained(grammars, "(w3|w2)w9", n=3, max_new_tokens=5)
    scheduler.add_request(parent)
    plan, masks, _ = _masked_step(scheduler)
    assert masks == {parent.slot: {2, 3}}
    plan, masks, _ = _masked_step(scheduler)  # the parent's second token, the samples' first
    children = [r for r in scheduler.running if r is not parent]
    assert len(children) == 2
    assert masks[parent.slot] == {9}
    assert all(masks[child.slot] == {2, 3} for child in children)
    assert all(child.guide is not parent.guide for child in children)


def test_unconstrained_plans_carry_no_masks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request())
    plan, _ = run_step(scheduler)
    fill_plan_masks(plan)
    assert plan.masked_slots == [] and plan.allowed_token_bitmask == b""


def test_stream_interval_coalesces_outputs_without_losing_tokens():
    def run(**fields):
        scheduler = make_scheduler()
        request = make_request(max_new_tokens=7, request_id="r", **fields)
        scheduler.add_request(request)
        outputs = []
        while scheduler.has_work():
            outputs.extend(output for _, output in run_step(scheduler)[1])
        return outputs

    every_step, batched = run(), run(stream_interval=3)
    assert [len(output.token_ids) for output in every_step] == [1] * 7
    assert [len(output.token_ids) for output in batched] == [3, 3, 1]
    assert ([t for output in batched for t in output.token_ids]
            == [t for output in every_step for t in output.token_ids])
    assert "".join(o.text for o in batched) == "".join(o.text for o in every_step)
    assert batched[-1].finish_reason is FinishReason.LENGTH
    assert batched[-1].usage.completion_tokens == 7


# ---- a grammar after the end of thinking ------------------------------------------------------

@ENGINES
def test_a_guide_waiting_for_a_marker_is_free_until_it_is_spelled_then_constrains(smollm2_vocab,
                                                                                  engine):
    compiler = GrammarCompiler(*smollm2_vocab, engine=engine)
    vocab = tokenizers.Tokenizer.from_str(smollm2_vocab[0])
    grammar = compiler.compile(StructuredSpec("choice", json.dumps(["yes", "no"])))
    guide = grammar.new_guide(b"</think>")
    thinking = vocab.encode("Hmm <b> and </thinking? </think>", add_special_tokens=False).ids
    assert len(thinking) > 4  # the marker spans tokens: "</", "think", ">"
    for token_id in thinking:  # tokens no grammar state of ["yes", "no"] allows
        assert not guide.active and not guide.is_final
        assert guide.accept(token_id)
    assert guide.active and not guide.failed
    assert not guide.accept(vocab.token_to_id("maybe"))  # now the grammar applies
    for token_id in vocab.encode("yes", add_special_tokens=False).ids:
        assert guide.accept(token_id)
    assert guide.is_final
    fork = guide.fork()  # a parallel sample starts thinking again
    assert not fork.active


def test_a_waiting_guide_gets_no_mask_until_the_marker(grammars):
    scheduler = make_scheduler(num_blocks=16)
    request = make_request(structured=StructuredSpec("regex", "w3w4"), max_new_tokens=8)
    request.guide = grammars.compile(request.structured).new_guide(b"w7")
    scheduler.add_request(request)
    plan = scheduler.schedule()
    fill_plan_masks(plan)
    assert not plan.masked_slots  # thinking: free
    request.guide.accept(7)  # the marker ("w7" is token 7's spelling)
    fill_plan_masks(plan)
    assert _plan_masks(plan) == {request.slot: {3}}


@ENGINES
def test_a_qwen3_guide_either_opens_a_think_block_or_takes_the_grammar_at_once(smollm2_vocab,
                                                                               engine):
    tokenizer_json, eos, vocab_size = smollm2_vocab
    compiler = GrammarCompiler(tokenizer_json, eos, vocab_size, engine=engine)
    vocab = tokenizers.Tokenizer.from_str(tokenizer_json)
    by_id, _ = token_bytes(tokenizer_json)
    grammar = compiler.compile(StructuredSpec("choice", json.dumps(["yes", "no"])))
    plain = grammar.new_guide()
    row = np.zeros(compiler.num_words, dtype="<u4")
    plain.write_mask(row)
    first = _allowed(row)
    opening = {i for i, b in by_id.items() if b and (b"<think>".startswith(b)
                                                     or b.startswith(b"<think>"))}
    guide = grammar.new_guide(b"</think>", b"<think>")
    assert guide.masked and not guide.active
    row[:] = 0
    guide.write_mask(row)
    assert _allowed(row) == first | opening and vocab.token_to_id("<") in opening
    opened = vocab.encode("<think>", add_special_tokens=False).ids
    assert guide.accept(opened[0])
    row[:] = 0
    guide.write_mask(row)  # inside the marker: only what goes on spelling it
    assert opened[1] in _allowed(row) and not _allowed(row) & first
    for token_id in opened[1:] + vocab.encode("hm </think>", add_special_tokens=False).ids:
        assert guide.accept(token_id)
    assert guide.active
    for token_id in vocab.encode("no", add_special_tokens=False).ids:
        assert guide.accept(token_id)
    assert guide.is_final
    direct = grammar.new_guide(b"</think>", b"<think>")  # no think block: the grammar at once
    for token_id in vocab.encode("yes", add_special_tokens=False).ids:
        assert direct.accept(token_id)
    assert direct.active and direct.is_final
