"""Preemption by swap, driven by fake step results (no model, no gRPC).

KVShadow plays the model service's part with KV *contents*: every device and host block holds, per
position, the token whose KV it caches; plans are applied in the model service's order (drop,
register, append blocks, swap out, copy, swap in, forward) and every scheduled sequence's cached
prefix is checked token by token before the forward writes its new positions. A swap that lost,
misplaced or overwrote a block fails here exactly where the real model would compute from wrong KV.
Under overlap, grammar-constrained sequences (sampled from their plan's mask) are swapped too.
"""
from __future__ import annotations

import collections
import random

import pytest

from factories import EOS, fake_result, make_grammar_compiler, make_request, make_scheduler, plan_masks
from scheduler_service.core.plan import StepResult
from scheduler_service.core.swap import SwapSpace
from scheduler_service.text.structured import StructuredSpec


class KVShadow:
    def __init__(self, num_blocks: int, num_swap_blocks: int, block_size: int):
        self.bs = block_size
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_swap_blocks)]
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.num_computed_total = 0

    def apply(self, plan) -> None:
        for slot in plan.finished_slots + plan.preempted_slots + plan.aborted_slots:
            del self.tables[slot], self.tokens[slot], self.computed[slot]
        for seq in plan.new_sequences:
            assert seq.slot not in self.tables, f"slot {seq.slot} registered twice"
            assert seq.num_computed_tokens < len(seq.token_ids)
            self.tables[seq.slot] = []
            self.tokens[seq.slot] = list(seq.token_ids)
            self.computed[seq.slot] = seq.num_computed_tokens
        offset = 0
        for slot, num_new in zip(plan.slots, plan.num_new_blocks):
            self.tables[slot].extend(plan.new_block_ids[offset:offset + num_new])
            offset += num_new
        assert len(plan.swap_out_src) == len(plan.swap_out_dst)
        assert len(plan.swap_in_src) == len(plan.swap_in_dst)
        assert len(set(plan.swap_out_dst)) == len(plan.swap_out_dst)
        for src, dst in zip(plan.swap_out_src, plan.swap_out_dst):
            assert src != 0, "block 0 is reserved"
            self.host[dst] = list(self.device[src])
        for src, dst in zip(plan.copy_src, plan.copy_dst):
            self.device[dst] = list(self.device[src])
        for src, dst in zip(plan.swap_in_src, plan.swap_in_dst):
            self.device[dst] = list(self.host[src])
        for slot, num_scheduled in zip(plan.slots, plan.num_scheduled_tokens):
            table, tokens, start = self.tables[slot], self.tokens[slot], self.computed[slot]
            assert len(table) * self.bs >= start + num_scheduled
            cached = [self.device[table[p // self.bs]][p % self.bs] for p in range(start)]
            assert cached == tokens[:start], f"slot {slot}: KV of its first {start} tokens is wrong"
            for p in range(start, start + num_scheduled):
                self.device[table[p // self.bs]][p % self.bs] = tokens[p]
            self.computed[slot] = start + num_scheduled
            self.num_computed_total += num_scheduled

    def sampled(self, plan, result) -> None:
        offset = 0
        for slot, count in zip(plan.slots, result.num_sampled_tokens):
            if slot in self.tokens:
                self.tokens[slot].extend(result.sampled_token_ids[offset:offset + count])
            offset += count


def next_token(request) -> int:
    """Deterministic per request and position, never EOS."""
    return 2 + (request.prompt_token_ids[0] * 7 + len(request.output_token_ids) * 13) % 150


def run(scheduler, requests, num_swap_blocks: int, max_steps: int = 5000):
    shadow = KVShadow(scheduler.kv.pool.num_blocks, num_swap_blocks, scheduler.kv.block_size)
    for request in requests:
        scheduler.add_request(request)
    outputs: dict[str, list[int]] = collections.defaultdict(list)
    plans = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        shadow.apply(plan)
        result = fake_result(plan, next_token)
        shadow.sampled(plan, result)
        for request, output in scheduler.take_early_outputs() + scheduler.update(plan, result):
            outputs[request.request_id].extend(output.token_ids)
        plans.append(plan)
        assert len(plans) < max_steps, "the scheduler did not drain"
    return outputs, plans, shadow


def _requests(count=6, prompt=20, new=24):
    return [make_request(num_prompt_tokens=prompt, max_new_tokens=new, request_id=f"q{i}",
                         prompt_token_ids=[2 + (i * 31 + j) % 150 for j in range(prompt)])
            for i in range(count)]


# 24 usable blocks of 4 tokens for 6 sequences of 44 tokens (11 blocks each): preemption is forced.
SMALL = dict(num_blocks=25, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)


def _facts_with_swap(scheduler, num_swap_blocks):
    import dataclasses

    from scheduler_service.core.scheduler import Scheduler

    facts = dataclasses.replace(scheduler.facts, num_swap_blocks=num_swap_blocks)
    return Scheduler(scheduler.config, facts, scheduler.outputs)


def make_swap_scheduler(num_swap_blocks: int, **config):
    return _facts_with_swap(make_scheduler(**{**SMALL, **config}), num_swap_blocks)


def test_swap_preemption_keeps_the_kv_and_the_outputs():
    reference, _, _ = run(make_scheduler(num_blocks=512, block_size=4), _requests(), 0)
    recompute, recompute_plans, recompute_shadow = run(make_swap_scheduler(0), _requests(), 0)
    scheduler = make_swap_scheduler(64)
    swapped, plans, shadow = run(scheduler, _requests(), 64)

    assert swapped == reference == recompute
    assert all(len(tokens) == 24 for tokens in swapped.values())
    swap = scheduler.swap
    assert swap.num_swap_outs > 0 and swap.num_swap_ins == swap.num_swap_outs
    assert swap.num_blocks_swapped_in == swap.num_blocks_swapped_out > 0
    assert sum(len(p.swap_out_src) for p in plans) == swap.num_blocks_swapped_out
    # Every swap block and every device block is free again.
    assert swap.num_free == 64 and swap.num_held == 0
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
    # Recompute preempted too (no swap space), and computed more tokens than swap did.
    assert any(p.preempted_slots for p in recompute_plans)
    assert not any(p.swap_out_src for p in recompute_plans)
    assert shadow.num_computed_total < recompute_shadow.num_computed_total


def test_a_resumed_sequence_is_registered_at_its_computed_count():
    scheduler = make_swap_scheduler(64)
    _, plans, _ = run(scheduler, _requests(), 64)
    resumes = [p for p in plans if p.swap_in_src]
    assert resumes
    for plan in resumes:
        dst = set(plan.swap_in_dst)
        # Swapped-in blocks are the first blocks sent for a new sequence that starts computed.
        resumed = [s for s in plan.new_sequences if s.num_computed_tokens > 0]
        assert resumed
        assert dst <= set(plan.new_block_ids)
        assert sum(-(-s.num_computed_tokens // 4) for s in resumed) == len(plan.swap_in_dst)


def test_swap_falls_back_to_recompute_when_swap_space_is_short():
    scheduler = make_swap_scheduler(3)  # fewer blocks than one preempted sequence holds, mostly
    outputs, plans, shadow = run(scheduler, _requests(), 3)
    assert all(len(tokens) == 24 for tokens in outputs.values())
    by_recompute = sum(len(p.preempted_slots) for p in plans) - scheduler.swap.num_swap_outs
    assert by_recompute > 0
    assert scheduler.swap.num_free == 3


def test_preemption_mode_recompute_never_swaps():
    scheduler = make_swap_scheduler(64, preemption_mode="recompute")
    assert scheduler.swap.num_blocks == 0
    _, plans, _ = run(scheduler, _requests(), 64)
    assert any(p.preempted_slots for p in plans)
    assert not any(p.swap_out_src or p.swap_in_src for p in plans)


def test_preemption_mode_is_validated():
    with pytest.raises(ValueError, match=r"preemption_mode must be one of auto, recompute, swap"):
        make_scheduler(preemption_mode="evict")


def test_aborting_a_swapped_out_request_frees_its_swap_blocks():
    scheduler = make_swap_scheduler(64)
    requests = _requests()
    shadow = KVShadow(scheduler.kv.pool.num_blocks, 64, 4)
    for request in requests:
        scheduler.add_request(request)
    for _ in range(200):
        plan = scheduler.schedule()
        shadow.apply(plan)
        result = fake_result(plan, next_token)
        shadow.sampled(plan, result)
        scheduler.update(plan, result)
        if scheduler.swap.num_held:
            break
    victim = next(r for r in requests if scheduler.swap.held_blocks(r) is not None)
    held = len(scheduler.swap.held_blocks(victim))
    free_before = scheduler.swap.num_free
    assert scheduler.abort_request(victim.request_id)
    plan = scheduler.schedule()
    shadow.apply(plan)
    assert scheduler.swap.held_blocks(victim) is None
    assert scheduler.swap.num_free >= free_before + held - len(plan.swap_out_dst)
    scheduler.update(plan, fake_result(plan, next_token))


def test_reset_engine_sends_swapped_requests_back_to_recompute():
    scheduler = make_swap_scheduler(64)
    requests = _requests()
    for request in requests:
        scheduler.add_request(request)
    while not scheduler.swap.num_held:
        plan = scheduler.schedule()
        scheduler.update(plan, fake_result(plan, next_token))
    swapped = [r for r in requests if scheduler.swap.held_blocks(r) is not None]
    scheduler.reset_engine(scheduler.facts)
    assert all(r.num_computed_tokens == 0 for r in swapped)
    assert scheduler.swap.num_held == 0 and scheduler.swap.num_free == 64
    # And everything still runs to the end on the "new" engine, KV checked.
    shadow = KVShadow(scheduler.kv.pool.num_blocks, 64, 4)
    while scheduler.has_work():
        plan = scheduler.schedule()
        shadow.apply(plan)
        result = fake_result(plan, next_token)
        shadow.sampled(plan, result)
        scheduler.update(plan, result)
    assert all(len(r.output_token_ids) == 24 for r in requests)


def test_swap_space_does_not_reuse_swapped_in_blocks_within_a_plan():
    a, b = make_request(), make_request()
    space = SwapSpace(4)
    assert space.swap_out(a, 3) == [0, 1, 2]
    assert space.swap_in(a) == [0, 1, 2]
    # Blocks 0-2 are read by this plan's swap-in: a swap-out in the same plan gets block 3 only.
    assert not space.can_swap_out(2)
    assert space.swap_out(b, 1) == [3]
    space.end_plan()
    assert space.num_free == 3
    space.discard(b)
    assert space.num_free == 4
    with pytest.raises(MemoryError):
        space.swap_out(a, 5)


def test_parallel_samples_survive_swap_preemption():
    scheduler = make_swap_scheduler(64)
    requests = [make_request(num_prompt_tokens=10, max_new_tokens=16, n=3, request_id=f"n{i}",
                             prompt_token_ids=[2 + (i * 17 + j) % 150 for j in range(10)])
                for i in range(4)]
    outputs, plans, _ = run(scheduler, requests, 64)
    assert any(p.preempted_slots for p in plans)
    assert scheduler.swap.num_free == 64 and scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
    assert len(outputs) == 12 and all(len(tokens) == 16 for tokens in outputs.values())
    assert EOS not in [t for tokens in outputs.values() for t in tokens]


@pytest.mark.parametrize("chunking_mode", ["interleaved", "prefill-first", "decode-priority"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_kv_stays_right_across_modes_policies_and_shared_prefixes(chunking_mode, policy):
    """Swaps and resumes in every chunking mode (prefill-first preempts decodes after this
    step's resumes, so swap-in blocks must not be reused by that step's swap-outs), with the
    priority policy preempting for waiting work, and prompts sharing a prefix (prefix-cache hits
    next to swapped-in blocks): every computed position is checked by the shadow."""
    shared = [2 + j % 150 for j in range(12)]
    requests = [make_request(max_new_tokens=20, request_id=f"m{i}", priority=i % 3,
                             arrival_time=float(i),
                             prompt_token_ids=shared + [3 + (i * 11 + j) % 140 for j in range(6 + 3 * i)])
                for i in range(8)]
    scheduler = make_swap_scheduler(40, chunking_mode=chunking_mode, policy=policy,
                                    max_num_batched_tokens=24)
    outputs, plans, _ = run(scheduler, requests, 40)
    assert all(len(outputs[r.request_id]) == 20 for r in requests)
    assert scheduler.swap.num_swap_outs > 0
    assert scheduler.swap.num_free == 40 and scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
    # The same tokens as with room for everyone.
    roomy = make_scheduler(num_blocks=512, block_size=4, chunking_mode=chunking_mode, policy=policy,
                           max_num_batched_tokens=24)
    reference, _, _ = run(roomy, [make_request(max_new_tokens=20, request_id=r.request_id,
                                               priority=r.priority, arrival_time=r.arrival_time,
                                               prompt_token_ids=r.prompt_token_ids) for r in requests], 0)
    assert outputs == reference


def _random_run(seed: int):
    rng = random.Random(seed)
    requests = [make_request(max_new_tokens=rng.randint(4, 24), request_id=f"x{i}",
                             prompt_token_ids=[2 + rng.randrange(140) for _ in range(rng.randint(2, 20))])
                for i in range(rng.randint(4, 12))]
    num_swap_blocks = rng.choice([8, 16, 40])
    scheduler = make_swap_scheduler(num_swap_blocks, num_blocks=rng.choice([17, 21, 25, 33]),
                                    chunking_mode=rng.choice(["interleaved", "prefill-first", "decode-priority"]),
                                    max_num_batched_tokens=rng.choice([6, 8, 12, 16, 24]))
    outputs, plans, _ = run(scheduler, requests, num_swap_blocks)
    assert all(len(outputs[r.request_id]) == r.stopping.max_new_tokens for r in requests)
    assert scheduler.swap.num_free == num_swap_blocks
    return plans


def test_random_workloads_keep_the_kv_right():
    """Seeded random workloads, KV contents checked by the shadow; among them steps that resume
    one sequence by swap-in and swap another out (prefill-first preempts decodes after
    admitting), where reusing the swap-in's host blocks in the same plan would corrupt it."""
    plans = [plan for seed in range(80) for plan in _random_run(seed)]
    assert sum(1 for p in plans if p.swap_in_src and p.swap_out_src) > 0


class KVModel(KVShadow):
    """KVShadow that also samples, like the model service: the next token is a function of the
    whole sequence, appended to the slot's own tokens (overlap feeds it to the next step)."""

    def execute(self, plan):
        self.apply(plan)
        counts, sampled = [], []
        masks = plan_masks(plan)  # a masked slot samples among its allowed tokens
        for slot in plan.slots:
            tokens = self.tokens[slot]
            if self.computed[slot] == len(tokens):
                h = sum(t * (i + 7) for i, t in enumerate(tokens)) * 2654435761 % 1000003
                allowed = masks.get(slot)
                tokens.append(allowed[h % len(allowed)] if allowed else 2 + h % 150)
                counts.append(1), sampled.append(tokens[-1])
            else:
                counts.append(0)
        return StepResult(step_id=plan.step_id, num_sampled_tokens=counts, sampled_token_ids=sampled,
                          forward_ns=0, sample_ns=0, total_ns=0)


def _run_model(scheduler, requests, num_swap_blocks: int, overlap: bool):
    model = KVModel(scheduler.kv.pool.num_blocks, num_swap_blocks, scheduler.kv.block_size)
    for request in requests:
        scheduler.add_request(request)
    outputs = collections.defaultdict(list)
    in_flight = collections.deque()
    plans = []

    def take(pairs):
        for request, output in pairs:
            outputs[request.request_id].extend(output.token_ids)

    while scheduler.has_work() or in_flight:
        assert len(plans) < 5000, "did not drain"
        if not overlap:
            plan = scheduler.schedule()
            plans.append(plan)
            take(scheduler.take_early_outputs())
            take(scheduler.update(plan, model.execute(plan)))
            continue
        if len(in_flight) < 2 and scheduler.has_work():
            plan = scheduler.schedule()
            take(scheduler.take_early_outputs())
            if not plan.is_empty:
                plans.append(plan)
                scheduler.commit(plan)
                in_flight.append((plan, model.execute(plan)))  # computed now, read later
                if len(in_flight) < 2:
                    continue
        if in_flight:
            plan, result = in_flight.popleft()
            take(scheduler.reconcile(plan, result))
    return dict(outputs), plans


@pytest.mark.parametrize("seed", range(4))
def test_overlap_swaps_decodes_whose_token_is_in_flight(seed):
    """With two plans in flight a decoding victim has computed all its known tokens (its next
    one is still coming): it is swapped out all the same, keeping every position but its last,
    which it computes again on resume to sample that token again. Tokens equal lockstep's."""
    def requests():
        rng = random.Random(seed)
        return [make_request(max_new_tokens=rng.randint(8, 24), request_id=f"o{i}",
                             prompt_token_ids=[2 + rng.randrange(140) for _ in range(rng.randint(4, 20))])
                for i in range(8)]

    lockstep, _ = _run_model(make_swap_scheduler(64, num_blocks=21, max_num_batched_tokens=16), requests(), 64, False)
    scheduler = make_swap_scheduler(64, num_blocks=21, max_num_batched_tokens=16)
    overlapped, plans = _run_model(scheduler, requests(), 64, True)
    assert overlapped == lockstep
    assert scheduler.swap.num_swap_outs > 0 and scheduler.swap.num_free == 64
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
    # Some swapped-out sequence was decoding: resumed one position short of its known tokens.
    resumed = [s for p in plans if p.swap_in_src for s in p.new_sequences if s.num_computed_tokens > 0]
    assert any(s.num_computed_tokens == len(s.token_ids) - 1 for s in resumed)


@pytest.mark.parametrize("seed", range(4))
def test_overlap_swaps_constrained_sequences_that_sit_out_a_plan(seed):
    """A constrained sequence has no placeholder while its token is in flight (it sits out the
    plan built meanwhile); swapped out then, it resumes one position short and samples that
    token again under the same mask. Tokens equal lockstep's; nothing is left held."""
    grammars = make_grammar_compiler()

    def requests():
        rng = random.Random(seed)
        made = []
        for i in range(8):
            request = make_request(max_new_tokens=rng.randint(8, 24), request_id=f"g{i}",
                                   prompt_token_ids=[2 + rng.randrange(140) for _ in range(rng.randint(4, 20))])
            if i % 2 == 0:
                request.structured = StructuredSpec("regex", "(w2|w3|w4)((w5|w6|w7)(w2|w3|w4)){2,8}")
                request.guide = grammars.compile(request.structured).new_guide()
            made.append(request)
        return made

    lockstep, _ = _run_model(make_swap_scheduler(64, num_blocks=21, max_num_batched_tokens=16), requests(), 64, False)
    scheduler = make_swap_scheduler(64, num_blocks=21, max_num_batched_tokens=16)
    overlapped_requests = requests()
    overlapped, _ = _run_model(scheduler, overlapped_requests, 64, True)
    assert overlapped == lockstep
    assert any(r.num_preemptions for r in overlapped_requests if r.guide is not None)
    assert scheduler.swap.num_swap_outs > 0 and scheduler.swap.num_free == 64
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
    assert all(r.finish_reason is not None and r.finish_reason.name != "ERROR" for r in overlapped_requests)
