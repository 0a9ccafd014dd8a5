"""n > 1: samples fork from a computed prompt, share its blocks, copy the partial one."""
from factories import make_request, make_scheduler, run_step, run_until_idle

from scheduler_service.core.request import FinishReason


def _tokens_by_sample(next_tokens):
    """Each sample draws its own token stream (by index), so outputs can be told apart."""
    return lambda request: 60 + request.index


def test_samples_share_full_prompt_blocks_and_copy_the_partial_one():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64)
    parent = make_request(num_prompt_tokens=10, max_new_tokens=3, n=3)
    scheduler.add_request(parent)
    run_step(scheduler, _tokens_by_sample(None))  # the prompt; sample 0 draws; 1 and 2 fork
    samples = scheduler._groups[parent.request_id]
    assert [s.index for s in samples] == [0, 1, 2]
    plan, _ = run_step(scheduler, _tokens_by_sample(None))
    # Position 9 (the last prompt token) sits in block 2 with positions 8: copy it per sample.
    assert [s.num_computed_tokens for s in plan.new_sequences] == [9, 9]
    assert plan.copy_src == [parent.block_ids[2]] * 2
    assert len(set(plan.copy_dst)) == 2 and parent.block_ids[2] not in plan.copy_dst
    for child in samples[1:]:
        assert child.block_ids[:2] == parent.block_ids[:2]  # the full blocks are shared
        assert scheduler.kv.pool.ref_count(parent.block_ids[0]) == 3
    run_until_idle(scheduler, _tokens_by_sample(None))
    assert [s.output_token_ids for s in samples] == [[60] * 3, [61] * 3, [62] * 3]
    assert all(s.finish_reason is FinishReason.LENGTH for s in samples)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
    assert not scheduler._groups


def test_block_aligned_prompt_needs_no_copy():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64)
    parent = make_request(num_prompt_tokens=9, max_new_tokens=2, n=2)  # position 8 opens block 3
    scheduler.add_request(parent)
    run_step(scheduler)
    plan, _ = run_step(scheduler)
    assert plan.copy_src == [] and plan.new_sequences[0].num_computed_tokens == 8
    run_until_idle(scheduler)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_samples_get_their_own_seeds_and_abort_reaches_every_sample():
    scheduler = make_scheduler(block_size=4)
    parent = make_request(num_prompt_tokens=6, max_new_tokens=50, n=3)
    scheduler.add_request(parent)
    run_step(scheduler)
    samples = scheduler._groups[parent.request_id]
    assert [s.sampling.seed for s in samples] == [parent.sampling.seed + i for i in range(3)]
    assert scheduler.find(parent.request_id) is parent
    assert scheduler.abort_request(parent.request_id)
    _, outputs = run_step(scheduler)
    finals = sorted(o.index for _, o in outputs if o.finish_reason is FinishReason.CANCELLED)
    assert finals == [0, 1, 2]
    assert not scheduler.has_work()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_abort_before_the_fork_still_ends_every_sample():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=4)
    parent = make_request(num_prompt_tokens=20, max_new_tokens=5, n=4)
    scheduler.add_request(parent)
    run_step(scheduler)  # a first prompt chunk only
    scheduler.abort_request(parent.request_id)
    _, outputs = run_step(scheduler)
    assert sorted(o.index for _, o in outputs) == [0, 1, 2, 3]
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_samples_without_room_wait_and_reuse_the_cached_prompt():
    scheduler = make_scheduler(block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    parent = make_request(num_prompt_tokens=13, max_new_tokens=2, n=3)
    scheduler.add_request(parent)
    run_step(scheduler)
    samples = list(scheduler._groups[parent.request_id])
    assert [s.status.value for s in samples] == ["running", "waiting", "waiting"]
    run_until_idle(scheduler)
    assert all(len(s.output_token_ids) == 2 for s in samples)
    assert [s.num_cached_tokens for s in samples[1:]] == [12, 12]  # 3 full prompt blocks
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
