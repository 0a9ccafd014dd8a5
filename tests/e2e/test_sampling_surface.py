"""The rest of the sampling surface, end to end over real gRPC on the tiny model: logprobs of
sampled and prompt tokens (against transformers' log-softmax), min_p, repetition / presence /
frequency penalties, logit_bias and min_new_tokens; the penalties' effect on SmolLM2's greedy
output in the CPU's default dtype (what users run)."""
import grpc
import pytest

from api import complete, greedy_ids_request, stub_for, wait_until_idle, assert_no_leaked_blocks
from reference import hf_llama_from_loaded, reference_logprobs

PROMPT = list(range(300, 340))
LOGPROB_TOLERANCE = 1e-4  # the sampled (greedy) token's logprob, float32 against float32
# Alternatives further down the distribution carry more rounding: transformers' own float32
# log-softmax differs from its float64 one by up to 6e-4 over the tiny model's vocabulary.
ALTERNATIVE_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def tiny_reference_model():
    from model_service.config import ModelServiceConfig
    from model_service.loading.loader import load_model
    return hf_llama_from_loaded(load_model(ModelServiceConfig(model="tiny", dtype="float32")))


async def _greedy(server, max_new_tokens=24, **sampling):
    request = greedy_ids_request(PROMPT, max_new_tokens)
    for name, value in sampling.items():
        if name == "logit_bias":
            request.sampling.logit_bias.update(value)
        else:
            setattr(request.sampling, name, value)
    return await complete(stub_for(server), request)


async def test_logprobs_of_greedy_tokens_match_transformers(tiny_server, tiny_reference_model):
    request = greedy_ids_request(PROMPT, 24, logprobs=True, top_logprobs=5)
    chunks = [c async for c in stub_for(tiny_server).Generate(request)]
    tokens = [t for c in chunks for t in c.token_ids]
    entries = [e for c in chunks for e in c.logprobs]
    assert len(entries) == len(tokens) == 24
    assert [e.token_id for e in entries] == tokens

    reference = reference_logprobs(tiny_reference_model, PROMPT + tokens)
    for i, entry in enumerate(entries):
        row = reference[len(PROMPT) - 1 + i]
        assert abs(entry.logprob - float(row[entry.token_id])) < LOGPROB_TOLERANCE, i
        assert len(entry.top) == 5
        top_values = [t.logprob for t in entry.top]
        assert top_values == sorted(top_values, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert abs(entry.top[0].logprob - entry.logprob) < 1e-6
        for alternative in entry.top:
            assert abs(alternative.logprob - float(row[alternative.token_id])) < ALTERNATIVE_TOLERANCE


async def test_prompt_logprobs_match_transformers(tiny_server, tiny_reference_model):
    request = greedy_ids_request(PROMPT, 2, prompt_logprobs=3)
    chunks = [c async for c in stub_for(tiny_server).Generate(request)]
    entries = list(chunks[0].prompt_logprobs)
    assert sum(len(c.prompt_logprobs) for c in chunks) == len(entries)  # first chunk only
    assert [e.token_id for e in entries] == PROMPT[1:]
    reference = reference_logprobs(tiny_reference_model, PROMPT)
    for i, entry in enumerate(entries):
        # A prompt token is any token, not the model's pick: the alternatives' tolerance.
        assert abs(entry.logprob - float(reference[i][entry.token_id])) < ALTERNATIVE_TOLERANCE, i
        assert len(entry.top) == 3
        assert entry.top[0].token_id == int(reference[i].argmax())


async def test_prompt_logprobs_bypass_the_prefix_cache(tiny_server):
    """The second identical request would hit the prefix cache; with prompt logprobs it must
    compute (and return) every prompt position all the same."""
    long_prompt = list(range(500, 560))
    first = await complete(stub_for(tiny_server), greedy_ids_request(long_prompt, 1))
    assert first.usage.prompt_tokens == 60
    request = greedy_ids_request(long_prompt, 1, prompt_logprobs=0)
    chunks = [c async for c in stub_for(tiny_server).Generate(request)]
    assert len(chunks[0].prompt_logprobs) == 59
    assert chunks[-1].usage.cached_tokens == 0


async def test_min_p_one_keeps_only_the_most_likely_token(tiny_server):
    greedy = await _greedy(tiny_server)
    sampled = await _greedy(tiny_server, temperature=1.0, min_p=1.0, seed=7)
    assert sampled.token_ids == greedy.token_ids


async def test_logit_bias_and_min_new_tokens_hold_back_eos(tiny_server):
    eos = min(tiny_server.loop.scheduler.facts.eos_token_ids)
    request = greedy_ids_request(PROMPT, 16)
    request.stopping.ignore_eos = False
    request.sampling.logit_bias[eos] = 100.0  # EOS wins every argmax it is allowed into
    eager = await complete(stub_for(tiny_server), request)
    assert eager.token_ids == [eos] and eager.finish_reason == 1  # FINISH_REASON_EOS

    request.stopping.min_new_tokens = 5
    held = await complete(stub_for(tiny_server), request)
    assert len(held.token_ids) == 6 and held.token_ids[-1] == eos
    assert eos not in held.token_ids[:5]
    assert held.finish_reason == 1


def _distinct(ids):
    return len(set(ids))


REPETITIVE_CHAT = "List the days of the week, then list them again, and again."


_PLAIN: dict[int, object] = {}  # the unpenalized decode, once per server


async def _smollm2_greedy(server, **sampling):
    if not sampling and id(server) in _PLAIN:
        return _PLAIN[id(server)]
    request = greedy_ids_request([], 64)
    request.ClearField("token_ids")
    request.messages.messages.add(role="user", content=REPETITIVE_CHAT)
    for name, value in sampling.items():
        setattr(request.sampling, name, value)
    done = await complete(stub_for(server), request)
    if not sampling:
        _PLAIN[id(server)] = done
    return done


@pytest.mark.slow(reason="two SmolLM2 greedy decodes of 64 tokens a case")
@pytest.mark.parametrize("name, value", [
    ("repetition_penalty", 1.5), ("presence_penalty", 2.0), ("frequency_penalty", 2.0)])
async def test_penalties_discourage_repeats(smollm2_default_server, name, value):
    """SmolLM2 asked to repeat a list repeats tokens greedily; each penalty makes the same
    greedy decode use more distinct tokens (the random tiny model hardly repeats at all)."""
    plain = await _smollm2_greedy(smollm2_default_server)
    penalized = await _smollm2_greedy(smollm2_default_server, **{name: value})
    assert _distinct(plain.token_ids) < len(plain.token_ids) - 8, "the plain output must repeat"
    assert _distinct(penalized.token_ids) / len(penalized.token_ids) > \
        _distinct(plain.token_ids) / len(plain.token_ids)


@pytest.mark.slow(reason="two SmolLM2 greedy decodes of 64 tokens")
async def test_negative_presence_penalty_encourages_repeats(smollm2_default_server):
    plain = await _smollm2_greedy(smollm2_default_server)
    encouraged = await _smollm2_greedy(smollm2_default_server, presence_penalty=-2.0)
    assert _distinct(encouraged.token_ids) / len(encouraged.token_ids) < \
        _distinct(plain.token_ids) / len(plain.token_ids)


@pytest.mark.parametrize("field, value, message", [
    ("min_p", 1.5, "sampling.min_p: must be in [0, 1]"),
    ("repetition_penalty", 0.0, "sampling.repetition_penalty: must be in (0, 2]"),
    ("presence_penalty", 2.5, "sampling.presence_penalty: must be in [-2, 2]"),
    ("frequency_penalty", -3.0, "sampling.frequency_penalty: must be in [-2, 2]"),
])
async def test_out_of_range_sampling_fields_are_rejected(tiny_server, field, value, message):
    request = greedy_ids_request(PROMPT, 4)
    setattr(request.sampling, field, value)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await complete(stub_for(tiny_server), request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.sampling.logit_bias.update({10**6: 1.0}), "sampling.logit_bias[1000000]: 1000000 is outside the vocabulary"),
    (lambda r: r.sampling.logit_bias.update({5: 101.0}), "sampling.logit_bias[5]: must be in [-100, 100]"),
    (lambda r: r.sampling.logit_bias.update({i: 1.0 for i in range(301)}), "sampling.logit_bias: at most 300 entries"),
    (lambda r: (setattr(r, "logprobs", True), setattr(r, "top_logprobs", 21)), "top_logprobs: must be in [0, 20]"),
    (lambda r: setattr(r, "top_logprobs", 2), "top_logprobs: needs logprobs set"),
    (lambda r: setattr(r, "prompt_logprobs", 21), "prompt_logprobs: must be in [0, 20]"),
    (lambda r: setattr(r.stopping, "min_new_tokens", 5), "stopping.min_new_tokens: must be in [0, max_new_tokens 4]"),
])
async def test_bad_surface_fields_are_rejected_and_nothing_leaks(tiny_server, mutate, message):
    request = greedy_ids_request(PROMPT, 4)
    mutate(request)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await complete(stub_for(tiny_server), request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)


async def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch_of_eight_others(tiny_server):
    import asyncio

    def seeded(prompt, seed):
        request = greedy_ids_request(prompt, 24)
        request.sampling.temperature = 0.9
        request.sampling.top_p = 0.95
        request.sampling.seed = seed
        return complete(stub_for(tiny_server), request)

    alone = await seeded(PROMPT, 1234)
    others = [seeded(list(range(600 + 40 * i, 600 + 40 * i + 10 + 5 * i)), i) for i in range(8)]
    together = await asyncio.gather(seeded(PROMPT, 1234), *others)
    assert together[0].token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in together}) == 9  # the others really sampled
