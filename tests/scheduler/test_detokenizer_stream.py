"""The incremental detokenizer against a full decode, on SmolLM2's byte-level BPE tokenizer: the
text a request's chunks add up to is the text of its tokens decoded at once (after the prompt),
for prose, characters that span several tokens, special tokens and random ids; with stop strings
the text ends before the first stop, whichever token brought it."""

from __future__ import annotations

import random

import pytest

from scheduler_service.text.detokenizer import IncrementalDetokenizer
from scheduler_service.text.tokenizer import Tokenizer

MIXED = (
    "Plain words, then numbers 12345 and code: `x = f(y) ** 2`.\n"
    "Accents: café, naïve, Zürich. CJK: 東京の天気は晴れです。 Emoji: 🙂🚀👩‍💻 and Ω≈ç√∫.\n"
    "  Leading spaces,\ttabs and a final line"
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from model_service.loading.gguf_file import load_gguf_tokenizer
    from model_service.loading.loader import smollm2_path

    loaded = load_gguf_tokenizer(smollm2_path())
    return Tokenizer(loaded.tokenizer_json, loaded.chat_template, loaded.special_tokens)


def _streamed(tokenizer, prompt, generated, stop_strings=(), take_every=1):
    """The chunks' text, taken every `take_every` tokens (stream_interval), and the stop found."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, stop_strings)
    chunks = []
    for count, token_id in enumerate(generated, 1):
        stop = detokenizer.add_token(token_id)
        if stop is not None:
            chunks.append(detokenizer.take_text(final=True))
            return "".join(chunks), stop
        if count % take_every == 0:
            chunks.append(detokenizer.take_text())
    chunks.append(detokenizer.take_text(final=True))
    return "".join(chunks), None


def _full(tokenizer, prompt, generated) -> str:
    return tokenizer.decode(list(prompt) + list(generated))[len(tokenizer.decode(list(prompt))) :]


@pytest.mark.parametrize("take_every", [1, 3])
def test_text_equals_a_full_decode(tokenizer, take_every):
    prompt = tokenizer.encode("Tell me something:", add_special_tokens=False)
    generated = tokenizer.encode(MIXED, add_special_tokens=False)
    text, stop = _streamed(tokenizer, prompt, generated, take_every=take_every)
    assert stop is None
    assert text == _full(tokenizer, prompt, generated)
    assert "東京" in text and "🙂🚀" in text


def test_random_ids_and_special_tokens_equal_a_full_decode(tokenizer):
    rng = random.Random(7)
    special = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(special) == 1
    for _ in range(20):
        prompt = [rng.randrange(49152) for _ in range(rng.randrange(0, 12))]
        generated = [rng.randrange(49152) for _ in range(60)] + special + [rng.randrange(49152)]
        text, _ = _streamed(tokenizer, prompt, generated)
        assert text == _full(tokenizer, prompt, generated)


@pytest.mark.parametrize("stops", [("晴れ",), ("naïve, Z", "ZZZ"), ("`x =",)])
def test_text_ends_before_the_first_stop(tokenizer, stops):
    prompt = tokenizer.encode("Tell me something:", add_special_tokens=False)
    generated = tokenizer.encode(MIXED, add_special_tokens=False)
    text, stop = _streamed(tokenizer, prompt, generated, stop_strings=stops, take_every=2)
    full = _full(tokenizer, prompt, generated)
    index, first = min((full.find(s), s) for s in stops if s in full)
    assert stop == first
    assert text == full[:index]


def test_a_request_whose_text_is_made_elsewhere_gets_ids_and_no_text(tokenizer):
    """Request.detokenize False (its frontend makes the text): outputs carry the tokens, stops by
    id still apply, and this side makes no text; the same request detokenized here reads the
    tokens' text."""
    from factories import make_request

    from scheduler_service.text.outputs import OutputProcessor

    generated = tokenizer.encode(MIXED, add_special_tokens=False)
    texts = {}
    for detokenize in (False, True):
        outputs = OutputProcessor(tokenizer, frozenset({2}), 4096)
        request = make_request(prompt_token_ids=[5, 6, 7], max_new_tokens=len(generated) - 3)
        request.detokenize = detokenize
        outputs.start(request)
        shown = [outputs.take_tokens(request, [token_id])[1] for token_id in generated[:-3]]
        assert [t for output in shown for t in output.token_ids] == generated[:-3]
        assert shown[-1].finish_reason is not None and shown[-1].finish_reason.name == "LENGTH"
        texts[detokenize] = "".join(output.text for output in shown)
    assert texts[False] == ""
    assert texts[True] == _full(tokenizer, [5, 6, 7], generated[:-3])
