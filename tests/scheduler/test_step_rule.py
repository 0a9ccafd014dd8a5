"""Chunking modes, the per-request chunk cap, decode reservation, prefix caching, deadlines."""
import time

import pytest
from factories import make_request, make_scheduler, run_step, run_until_idle

from scheduler_service.core.request import FinishReason


def _decoding_and_a_long_prompt(**config):
    scheduler = make_scheduler(max_num_batched_tokens=16, block_size=4, **config)
    decoders = [make_request(num_prompt_tokens=4, max_new_tokens=20) for _ in range(3)]
    for request in decoders:
        scheduler.add_request(request)
    run_step(scheduler)  # all three prompts done: they decode from now on
    long_prompt = make_request(num_prompt_tokens=40, max_new_tokens=2)
    scheduler.add_request(long_prompt)
    return scheduler, decoders, long_prompt


def test_interleaved_mixes_decodes_and_a_prompt_chunk_in_one_step():
    scheduler, decoders, long_prompt = _decoding_and_a_long_prompt()
    plan, _ = run_step(scheduler)
    assert plan.requests == decoders + [long_prompt]
    assert plan.num_scheduled_tokens == [1, 1, 1, 13]


def test_prefill_first_gives_the_prompt_the_budget_before_decodes():
    scheduler, decoders, long_prompt = _decoding_and_a_long_prompt(chunking_mode="prefill-first")
    plan, _ = run_step(scheduler)
    assert plan.requests[0] is long_prompt
    assert plan.num_scheduled_tokens[0] == 16
    assert decoders[0] not in plan.requests  # nothing left for decodes this step


def test_decode_priority_allows_one_prompt_chunk_per_step():
    scheduler = make_scheduler(max_num_batched_tokens=64, block_size=4,
                               chunking_mode="decode-priority")
    decoder = make_request(num_prompt_tokens=4, max_new_tokens=20)
    scheduler.add_request(decoder)
    run_step(scheduler)
    prompts = [make_request(num_prompt_tokens=10) for _ in range(3)]
    for request in prompts:
        scheduler.add_request(request)
    plan, _ = run_step(scheduler)
    assert plan.requests == [decoder, prompts[0]]
    plan, _ = run_step(scheduler)
    assert plan.requests[:2] == [decoder, prompts[0]] and prompts[1] in plan.requests


def test_max_prefill_chunk_caps_one_sequence_per_step():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_prefill_chunk=8)
    first, second = make_request(num_prompt_tokens=20), make_request(num_prompt_tokens=20)
    scheduler.add_request(first)
    scheduler.add_request(second)
    plan, _ = run_step(scheduler)
    assert plan.num_scheduled_tokens == [8, 8]


def test_admission_keeps_room_for_running_decodes_to_grow():
    # 10 usable blocks of 4 tokens. The running request wants to grow to 4 + 30 tokens.
    scheduler = make_scheduler(num_blocks=11, block_size=4, max_num_batched_tokens=64,
                               decode_reserve_tokens=16)
    running = make_request(num_prompt_tokens=4, max_new_tokens=30, ignore_eos=True)
    scheduler.add_request(running)
    run_step(scheduler)
    # Next step it computes its 5th token (2 blocks); growing 16 more needs 21 tokens, 6 blocks:
    # 4 to keep free. The newcomer needs 5 blocks, and 2 + 5 + 4 > 10.
    newcomer = make_request(prompt_token_ids=range(100, 120))
    scheduler.add_request(newcomer)
    plan, _ = run_step(scheduler)
    assert newcomer not in plan.requests
    without_reserve = make_scheduler(num_blocks=11, block_size=4, max_num_batched_tokens=64)
    running = make_request(num_prompt_tokens=4, max_new_tokens=30, ignore_eos=True)
    without_reserve.add_request(running)
    run_step(without_reserve)
    newcomer = make_request(prompt_token_ids=range(100, 120))
    without_reserve.add_request(newcomer)
    plan, _ = run_step(without_reserve)
    assert newcomer in plan.requests


def test_prefix_cache_hit_starts_at_the_cached_length_and_reports_it():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64)
    shared = list(range(10, 30))  # 20 tokens: 5 full blocks
    first = make_request(prompt_token_ids=shared + [40, 41], max_new_tokens=2)
    scheduler.add_request(first)
    run_until_idle(scheduler)
    second = make_request(prompt_token_ids=shared + [50, 51, 52], max_new_tokens=2)
    scheduler.add_request(second)
    plan, _ = run_step(scheduler)
    assert plan.new_sequences[0].num_computed_tokens == 20
    assert plan.num_scheduled_tokens == [3]
    run_until_idle(scheduler)
    assert second.num_cached_tokens == 20
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_a_fully_cached_prompt_still_computes_its_last_token():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64)
    prompt = list(range(10, 26))  # exactly 4 blocks
    scheduler.add_request(make_request(prompt_token_ids=prompt, max_new_tokens=1))
    run_until_idle(scheduler)
    again = make_request(prompt_token_ids=prompt, max_new_tokens=1)
    scheduler.add_request(again)
    plan, _ = run_step(scheduler)
    assert plan.new_sequences[0].num_computed_tokens == 12  # the last block is recomputed
    assert plan.num_scheduled_tokens == [4]


def test_cache_salt_keeps_prefixes_apart():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64)
    prompt = list(range(10, 30))
    scheduler.add_request(make_request(prompt_token_ids=prompt, max_new_tokens=1,
                                       cache_salt="alice"))
    run_until_idle(scheduler)
    bob = make_request(prompt_token_ids=prompt, max_new_tokens=1, cache_salt="bob")
    scheduler.add_request(bob)
    plan, _ = run_step(scheduler)
    assert plan.new_sequences[0].num_computed_tokens == 0


def test_prefix_caching_can_be_turned_off():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64,
                               enable_prefix_caching=False)
    prompt = list(range(10, 30))
    scheduler.add_request(make_request(prompt_token_ids=prompt, max_new_tokens=1))
    run_until_idle(scheduler)
    scheduler.add_request(make_request(prompt_token_ids=prompt, max_new_tokens=1))
    plan, _ = run_step(scheduler)
    assert plan.new_sequences[0].num_computed_tokens == 0


def test_passed_deadline_ends_with_deadline_after_the_tokens_it_has():
    scheduler = make_scheduler()
    late = make_request(max_new_tokens=50, deadline=time.monotonic() + 0.05)
    on_time = make_request(max_new_tokens=5)
    scheduler.add_request(late)
    scheduler.add_request(on_time)
    run_step(scheduler)
    run_step(scheduler)
    time.sleep(0.06)
    plan, outputs = run_step(scheduler)
    assert late.finish_reason is FinishReason.DEADLINE
    assert late.output_token_ids == [50, 50]
    assert late not in plan.requests
    assert any(r is late and o.finish_reason is FinishReason.DEADLINE for r, o in outputs)
    run_until_idle(scheduler)
    assert on_time.finish_reason is FinishReason.LENGTH
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_deadline_also_expires_a_waiting_request():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request(max_new_tokens=30))
    waiting = make_request(max_new_tokens=5, deadline=time.monotonic() - 1)
    scheduler.add_request(waiting)
    run_step(scheduler)
    assert waiting.finish_reason is FinishReason.DEADLINE
    assert waiting.output_token_ids == []


@pytest.mark.parametrize("mode", ["interleaved", "prefill-first", "decode-priority"])
def test_every_mode_drains_a_mixed_load_without_leaks(mode):
    scheduler = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=24,
                               chunking_mode=mode, decode_reserve_tokens=8)
    requests = [make_request(num_prompt_tokens=3 + 7 * i % 30, max_new_tokens=2 + i % 9,
                             ignore_eos=True) for i in range(12)]
    for request in requests:
        scheduler.add_request(request)
    for plan in run_until_idle(scheduler):
        assert sum(plan.num_scheduled_tokens) <= 24
    assert all(len(r.output_token_ids) == r.stopping.max_new_tokens for r in requests)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
