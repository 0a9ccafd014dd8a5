"""The step rule, driven by fake step results: schedule -> fake result -> update."""
from factories import EOS, make_request, make_scheduler, run_step

from scheduler_service.core.request import FinishReason, RequestStatus


def _free_everything(scheduler):
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
    assert scheduler.slots.num_free == scheduler.facts.max_num_slots


def test_prompt_is_chunked_to_the_budget_then_decodes_one_token_per_step():
    scheduler = make_scheduler(max_num_batched_tokens=8, block_size=4)
    request = make_request(num_prompt_tokens=20, max_new_tokens=3)
    scheduler.add_request(request)

    chunks = []
    while not request.is_finished:
        plan, _ = run_step(scheduler)
        chunks.append(plan.num_scheduled_tokens[0])
    # 20 prompt tokens in chunks of 8, 8, 4 (the last samples token 1), then 2 decodes.
    assert chunks == [8, 8, 4, 1, 1]
    assert request.finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == [50, 50, 50]
    _free_everything(scheduler)


def test_new_request_is_registered_once_and_blocks_are_appended_as_it_grows():
    scheduler = make_scheduler(max_num_batched_tokens=64, block_size=4)
    request = make_request(num_prompt_tokens=6, max_new_tokens=5)
    scheduler.add_request(request)
    plan, _ = run_step(scheduler)
    assert [s.slot for s in plan.new_sequences] == [request.slot]
    assert plan.new_sequences[0].token_ids == request.prompt_token_ids
    assert plan.num_new_blocks == [2]  # 6 tokens in blocks of 4
    new_blocks = []
    for _ in range(3):
        plan, _ = run_step(scheduler)
        assert plan.new_sequences == []
        new_blocks.append(plan.num_new_blocks[0])
    # computed goes 6 -> 7 -> 8 -> 9: a third block is needed for the 9th token only.
    assert new_blocks == [0, 0, 1]


def test_decodes_come_before_waiting_prompts_and_share_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=10, block_size=4)
    first = make_request(num_prompt_tokens=4, max_new_tokens=10)
    scheduler.add_request(first)
    run_step(scheduler)  # first is decoding now
    second = make_request(num_prompt_tokens=30, max_new_tokens=2)
    scheduler.add_request(second)
    plan, _ = run_step(scheduler)
    assert plan.requests == [first, second]
    assert plan.num_scheduled_tokens == [1, 9]  # the decode, then what is left of the budget


def test_eos_finishes_unless_ignored_and_finished_slots_reach_the_next_plan():
    scheduler = make_scheduler()
    stops = make_request(max_new_tokens=10)
    ignores = make_request(max_new_tokens=3, ignore_eos=True)
    scheduler.add_request(stops)
    scheduler.add_request(ignores)
    run_step(scheduler, next_token=lambda request: EOS)
    assert stops.finish_reason is FinishReason.EOS
    assert ignores.finish_reason is None
    plan, _ = run_step(scheduler, next_token=lambda request: EOS)
    assert plan.finished_slots == [0]
    while not ignores.is_finished:
        run_step(scheduler, next_token=lambda request: EOS)
    assert ignores.output_token_ids == [EOS] * 3
    _free_everything(scheduler)


def test_stop_token_and_stop_string():
    scheduler = make_scheduler()
    by_id = make_request(max_new_tokens=10, stop_token_ids=[60])
    by_text = make_request(max_new_tokens=10, stop=["w61 w62"])
    scheduler.add_request(by_id)
    scheduler.add_request(by_text)
    sequence = {by_id.request_id: iter([55, 60, 70]),
                by_text.request_id: iter([55, 61, 62, 63])}
    texts = {by_id.request_id: "", by_text.request_id: ""}
    while scheduler.has_work():
        _, outputs = run_step(scheduler, next_token=lambda r: next(sequence[r.request_id]))
        for request, output in outputs:
            texts[request.request_id] += output.text
    assert by_id.finish_reason is FinishReason.STOP and by_id.output_token_ids == [55, 60]
    assert by_text.finish_reason is FinishReason.STOP
    # The match and what follows are not returned (words are space-joined after the prompt).
    assert texts[by_text.request_id] == " w55 "


def test_length_is_capped_by_the_model():
    scheduler = make_scheduler(max_model_len=12)
    request = make_request(num_prompt_tokens=10, max_new_tokens=100, ignore_eos=True)
    scheduler.add_request(request)
    while not request.is_finished:
        run_step(scheduler)
    assert request.finish_reason is FinishReason.LENGTH
    assert request.num_tokens == 12


def test_running_out_of_blocks_preempts_the_latest_arrival_and_it_recomputes():
    # 8 usable blocks of 4 tokens = 32 tokens for two requests that want 2 x 24.
    scheduler = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64)
    early = make_request(num_prompt_tokens=12, max_new_tokens=12, ignore_eos=True)
    late = make_request(num_prompt_tokens=12, max_new_tokens=12, ignore_eos=True)
    scheduler.add_request(early)
    scheduler.add_request(late)
    preempted = []
    registrations = []
    while scheduler.has_work():
        plan, _ = run_step(scheduler)
        preempted.extend(plan.preempted_slots)
        registrations.extend(s.token_ids for s in plan.new_sequences)
        assert scheduler.kv.num_free_blocks >= 0
    assert preempted, "the cache was too small for both: someone must have been preempted"
    assert early.output_token_ids == [50] * 12 and late.output_token_ids == [50] * 12
    # The resumed request was registered again with its generated tokens.
    assert any(len(ids) > 12 for ids in registrations)
    _free_everything(scheduler)


def test_abort_frees_blocks_in_the_next_step_and_tells_the_model_service():
    scheduler = make_scheduler()
    running = make_request(max_new_tokens=50)
    waiting_one = make_request(max_new_tokens=50)
    scheduler.add_request(running)
    run_step(scheduler)
    scheduler.add_request(waiting_one)
    scheduler.abort_request(running.request_id)
    scheduler.abort_request(waiting_one.request_id)
    plan = scheduler.schedule()
    assert plan.aborted_slots == [0]
    assert plan.slots == []
    outputs = scheduler.take_early_outputs()
    assert {r.request_id for r, _ in outputs} == {running.request_id, waiting_one.request_id}
    assert all(o.finish_reason is FinishReason.CANCELLED for _, o in outputs)
    assert running.status is RequestStatus.FINISHED
    _free_everything(scheduler)


def test_max_num_seqs_bounds_a_step():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=100)
    for _ in range(5):
        scheduler.add_request(make_request(num_prompt_tokens=4))
    plan, _ = run_step(scheduler)
    assert len(plan.slots) == 3
