"""One owner per fact: a running request's computed count and block table are the StepCore's.

While a request holds a slot it reads both through the slot's view (Request.slot_view, bound by
StepCore.admit/fork, unbound by release) and cannot set its count; out of a slot it keeps its
count itself (0 after a recompute preemption, the kept count after a swap-out, the last count
after it finished) and holds no block.
"""
from __future__ import annotations

import pytest

from cython_ext.block_pool import BlockPool
from cython_ext.step_core import StepCore
from factories import make_request, make_scheduler, run_step
from scheduler_service.core.request import RequestStatus
from scheduler_service.core.scheduler import Scheduler
from test_swap_scheduler import _requests, make_swap_scheduler, next_token


def _check_ownership(scheduler) -> None:
    core = scheduler.core
    for request in scheduler.requests.values():
        if request.slot is None:
            assert request.slot_view is None and request.block_ids == []
            continue
        assert request.slot_view.slot == request.slot
        assert request.num_computed_tokens == core.num_computed_tokens(request.slot)
        assert request.block_ids == core.block_ids(request.slot)


def test_a_running_request_reads_its_count_and_table_from_the_core():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    request = make_request(num_prompt_tokens=10, max_new_tokens=6)
    scheduler.add_request(request)
    run_step(scheduler)  # a first chunk of 6: 2 blocks of 4
    assert request.slot_view is not None
    assert request.num_computed_tokens == 6 == scheduler.core.num_computed_tokens(request.slot)
    assert len(request.block_ids) == 2
    with pytest.raises(AttributeError, match="StepCore"):
        request.num_computed_tokens = 3
    assert request.num_computed_tokens == 6
    table = request.block_ids
    table.append(99)  # a copy: the core's table is not touched
    assert request.block_ids == scheduler.core.block_ids(request.slot) == table[:-1]


def test_a_finished_request_keeps_its_last_count_and_no_table():
    scheduler = make_scheduler()
    requests = [make_request(num_prompt_tokens=8, max_new_tokens=4) for _ in range(3)]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_work():
        run_step(scheduler)
        _check_ownership(scheduler)
    for request in requests:
        assert request.status is RequestStatus.FINISHED and request.slot_view is None
        # Its last token was sampled, never computed.
        assert request.num_computed_tokens == request.num_tokens - 1 == 11
        assert request.block_ids == []


@pytest.mark.parametrize("num_swap_blocks", [0, 64])
def test_preempted_requests_keep_the_count_they_resume_from(num_swap_blocks):
    scheduler = make_swap_scheduler(num_swap_blocks)
    requests = _requests()
    for request in requests:
        scheduler.add_request(request)
    seen = 0
    while scheduler.has_work():
        plan, _ = run_step(scheduler, next_token)
        _check_ownership(scheduler)
        for request in requests:
            if request.status is not RequestStatus.WAITING or not request.num_preemptions:
                continue
            seen += 1
            if scheduler.swap.held_blocks(request) is None:  # by recompute: from the start
                assert request.num_computed_tokens == 0
            else:  # by swap: every known token but the last, at most
                assert 0 < request.num_computed_tokens < request.num_tokens
    assert seen and scheduler.num_preemptions_total
    assert bool(num_swap_blocks) == bool(scheduler.swap.num_swap_outs)


def test_a_handed_off_request_takes_its_count_and_no_binding_along():
    src = make_scheduler(num_blocks=512)
    dst = Scheduler(src.config, src.facts, src.outputs)  # replicas share the OutputProcessor
    request = make_request(num_prompt_tokens=8, max_new_tokens=20)
    src.add_request(request)
    for _ in range(3):
        run_step(src)
    src.reset_engine(src.facts)  # back to waiting, to be recomputed
    assert request.slot_view is None and request.num_computed_tokens == 0
    dst.take_over(request, src.hand_off(request))
    run_step(dst)
    assert request.slot_view is not None and request.slot_view.slot == request.slot
    assert request.num_computed_tokens == request.num_tokens - 1  # prompt + outputs, recomputed
    assert request.block_ids == dst.core.block_ids(request.slot)


def test_step_core_binds_on_admit_and_unbinds_on_release():
    pool = BlockPool(16)
    core = StepCore(pool, 4, 2)
    request = make_request(num_prompt_tokens=6)
    request.slot = 1
    core.admit(1, request, request.all_token_ids, 0, [], 10, 0)
    core.begin_step(1, 32, 2)
    core.schedule_running(0)
    core.advance(core.end_step()[-1], [1])
    assert request.slot_view.slot == 1
    assert request.num_computed_tokens == 6 and len(request.block_ids) == 2
    core.release(1)
    assert request.slot_view is None and request.block_ids == []
    assert request.num_computed_tokens == 6  # left on the request by release
    assert core.num_computed_tokens(1) == 0 and pool.num_free == pool.num_usable


def test_running_slot_is_the_slot_held_or_an_error():
    scheduler = make_scheduler()
    request = make_request()
    with pytest.raises(ValueError, match="holds no slot"):
        request.running_slot
    scheduler.add_request(request)
    run_step(scheduler)
    assert request.running_slot == request.slot == request.slot_view.slot
