"""Speculative decoding end to end: a scheduler over a model service that drafts (by n-gram
lookup, or with a draft model: the tiny model drafting for itself, so that drafts are proposed
and accepted at every step) gives exactly the greedy tokens of one that does not (tiny model,
mixed batches, chunked prefill), exports its drafts, and seeded sampling stays reproducible."""
import asyncio

import pytest
import pytest_asyncio

from api import assert_no_leaked_blocks, complete, greedy_ids_request, stub_for, wait_until_idle
from conftest import EngineProcess, start_scheduler

# Repetitive prompts give the n-gram drafter something to propose at every step.
PROMPTS = [[5, 6, 7, 8] * 10, list(range(300, 340)), [11, 12] * 40 + list(range(900, 960)), [42] * 20]


@pytest.fixture(scope="module")
def ngram_engine():
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64",
                           "--speculative-method", "ngram", "--num-speculative-tokens", "4")
    yield engine.address
    engine.stop()


@pytest_asyncio.fixture(scope="module")
async def ngram_server(ngram_engine):
    server = await start_scheduler(ngram_engine, max_num_batched_tokens=64, max_num_seqs=16)
    yield server
    await server.stop(grace_s=1)


@pytest.fixture(scope="module")
def draft_engine():
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64",
                           "--speculative-method", "draft", "--draft-model", "tiny",
                           "--num-speculative-tokens", "3")
    yield engine.address
    engine.stop()


@pytest_asyncio.fixture(scope="module")
async def draft_server(draft_engine):
    server = await start_scheduler(draft_engine, max_num_batched_tokens=64, max_num_seqs=16)
    yield server
    await server.stop(grace_s=1)


async def _all(server, prompts, new_tokens=32, **kwargs):
    stub = stub_for(server)
    return await asyncio.gather(*[complete(stub, greedy_ids_request(p, new_tokens, **kwargs))
                                  for p in prompts])


async def test_describe_announces_speculation(ngram_server):
    assert ngram_server.loop.scheduler.facts.num_speculative_tokens == 4


async def test_greedy_output_is_identical_with_and_without_ngram_speculation(ngram_server, tiny_server):
    await _check_parity(ngram_server, tiny_server, "ngram")


async def test_greedy_output_is_identical_with_and_without_a_draft_model(draft_server, tiny_server):
    await _check_parity(draft_server, tiny_server, "draft")


async def _check_parity(server, tiny_server, method):
    scheduler = server.loop.scheduler
    drafts_before = scheduler.num_draft_tokens_total
    plain = await _all(tiny_server, PROMPTS)
    speculated = await _all(server, PROMPTS)
    for a, b in zip(plain, speculated):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
    if method == "draft":  # the model drafting for itself: every draft is its own greedy pick
        assert scheduler.num_draft_tokens_total > drafts_before
        assert scheduler.num_accepted_draft_tokens_total == scheduler.num_draft_tokens_total
    await wait_until_idle(server)
    assert_no_leaked_blocks(server)


async def test_seeded_sampling_is_reproducible_with_speculation(ngram_server):
    def sampled(seed):
        request = greedy_ids_request(PROMPTS[0], 24)
        request.sampling.temperature = 0.8
        request.sampling.seed = seed
        return complete(stub_for(ngram_server), request)

    first, again, other = await asyncio.gather(sampled(7), sampled(7), sampled(8))
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


async def test_stop_inside_accepted_drafts_truncates(ngram_server, tiny_server):
    """A stop token id may land among several tokens of one step: nothing after it is sent."""
    [plain] = await _all(tiny_server, [PROMPTS[3]], 32)
    stop_id = plain.token_ids[5]
    request = greedy_ids_request(PROMPTS[3], 32)
    request.stopping.stop_token_ids.append(stop_id)
    result = await complete(stub_for(ngram_server), request)
    first = plain.token_ids.index(stop_id)
    assert result.token_ids == plain.token_ids[:first + 1]
    assert result.finish_reason == 3  # FINISH_REASON_STOP


async def test_drafts_and_acceptances_are_exported_to_prometheus(draft_server):
    from prometheus_client import generate_latest

    scheduler = draft_server.loop.scheduler
    before = scheduler.num_draft_tokens_total
    await _all(draft_server, [list(range(700, 720))], 12)
    assert scheduler.num_draft_tokens_total > before
    text = generate_latest(draft_server.metrics.registry).decode().splitlines()
    drafted = [line for line in text if line.startswith("planserve_spec_decode_draft_tokens_total")]
    accepted = [line for line in text if line.startswith("planserve_spec_decode_accepted_tokens_total")]
    assert float(drafted[0].split()[-1]) == scheduler.num_draft_tokens_total
    assert float(accepted[0].split()[-1]) == scheduler.num_accepted_draft_tokens_total
