"""The plain step's C path (model_service/step/decode_fast.py, cython_ext/decode_step.pyx) against
the Python path on the same plans: two runners over the tiny model, one with the fast path off,
fed the same random valid and invalid plans, must build the same inputs, sample the same tokens,
hold the same slot state and raise the same PlanError (field and message)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_config

from cython_ext import decode_step
from model_service.batch import from_pb, result_to_pb
from model_service.start import build_runner
from model_service.step import decode_fast
from model_service.step.plan import ComputedStep, PlanError
from planserve.v1 import common_pb2, engine_pb2

INPUTS = ("input_ids", "positions", "slot_mapping", "query_start", "context_lens", "block_tables")
TABLE = ("tokens", "num_tokens", "num_computed", "num_blocks", "block_table", "active")
PLAN = ("slots", "num_scheduled_tokens", "num_new_blocks", "new_block_ids")
# One way to break a plain plan each (the field Python names in brackets, for the reader):
BREAKS = (
    "unregistered",  # slots: a free slot scheduled
    "beyond_known",  # num_scheduled_tokens: one past the known tokens
    "short_blocks",  # num_new_blocks: too few to hold the tokens
    "too_many_blocks",  # num_new_blocks: past the table's width
    "block_zero",  # new_block_ids: the reserved block
    "block_range",  # new_block_ids: past num_kv_blocks
    "twice",  # slots: a slot scheduled twice
    "slot_range",  # slots: past max_num_slots
    "zero_tokens",  # num_scheduled_tokens: 0
    "lengths",  # num_new_blocks: one entry short
    "ids_sum",  # new_block_ids: one id more than num_new_blocks asks
)


def _recorded(runner) -> list[dict]:
    """Every step's inputs as the runner hands them to the model (copies)."""
    seen: list[dict] = []
    forward = runner._forward

    def recording(x, n, logits_indices, lora=None):
        seen.append({name: np.array(getattr(x, name)) for name in INPUTS} | {"rows": np.array(logits_indices)})
        return forward(x, n, logits_indices, lora)

    runner._forward = recording
    return seen


def _run(runner, request: engine_pb2.ExecuteRequest, fast: bool):
    """('ok', output) or ('error', field, message): the server's decode, then the runner."""
    try:
        plan = decode_fast.parse_plan(request.plan.SerializeToString(), runner.limits) if fast else None
        output = runner.execute(plan if plan is not None else from_pb(request, runner.limits))
    except PlanError as error:
        return ("error", error.field, error.message)
    return ("ok", output)


class Script:
    """Random plans over the reference runner's slot state."""

    def __init__(self, rng: np.random.Generator, table, limits, block_size: int) -> None:
        self.rng, self.table, self.limits, self.bs = rng, table, limits, block_size
        self.step_id = 0
        self.next_block = 1

    def _block(self) -> int:
        self.next_block = self.next_block % (self.limits.num_kv_blocks - 1) + 1
        return self.next_block

    def request(self, **fields) -> engine_pb2.ExecuteRequest:
        self.step_id += 1
        return engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(step_id=self.step_id, **fields))

    def lifecycle(self) -> engine_pb2.ExecuteRequest:
        """Finish a random slot (if any) and register a new sequence in a free slot, prefilled."""
        t, rng = self.table, self.rng
        active, free = np.flatnonzero(t.active), np.flatnonzero(~t.active)
        finished = [int(rng.choice(active))] if active.size > 3 else []
        slot = int(rng.choice(free))
        prompt = rng.integers(0, self.limits.vocab_size, rng.integers(1, 40)).tolist()
        sampling = common_pb2.SamplingParams(seed=int(rng.integers(1 << 30)))
        if rng.random() < 0.4:
            sampling.temperature = 0.8
        else:
            sampling.temperature = 0.0
        sequence = engine_pb2.NewSequence(slot=slot, token_ids=prompt, num_computed_tokens=0, sampling=sampling)
        if rng.random() < 0.2:
            sequence.num_logprobs = 2
        chunk = int(rng.integers(1, len(prompt) + 1))
        blocks = [self._block() for _ in range(-(-chunk // self.bs))]
        return self.request(new_sequences=[sequence], finished_slots=finished, slots=[slot], num_scheduled_tokens=[chunk],
                            num_new_blocks=[len(blocks)], new_block_ids=blocks)

    def plain(self, broken: str | None) -> engine_pb2.ExecuteRequest:
        """A plan of scheduled slots and new blocks only: each slot a random share of what it has
        left to compute; `broken` breaks it one way (BREAKS)."""
        t, rng = self.table, self.rng
        active = rng.permutation(np.flatnonzero(t.active))
        chosen = active[: rng.integers(1, active.size + 1)].tolist()
        fields: dict[str, list] = {"slots": [], "num_scheduled_tokens": [], "num_new_blocks": [], "new_block_ids": []}
        for s in chosen:
            left = int(t.num_tokens[s] - t.num_computed[s])
            k = int(rng.integers(1, left + 1))
            need = max(0, -(-(int(t.num_computed[s]) + k) // self.bs) - int(t.num_blocks[s]))
            fields["slots"].append(s)
            fields["num_scheduled_tokens"].append(k)
            fields["num_new_blocks"].append(need)
            fields["new_block_ids"] += [self._block() for _ in range(need)]
        if broken:
            self._break(fields, broken)
        return self.request(**fields)

    def _break(self, f: dict[str, list], broken: str) -> None:
        t, rng, i = self.table, self.rng, int(self.rng.integers(len(f["slots"])))
        s = f["slots"][i]
        if broken == "unregistered" and (~t.active).any():
            f["slots"].append(int(rng.choice(np.flatnonzero(~t.active))))
            f["num_scheduled_tokens"].append(1)
            f["num_new_blocks"].append(1)
            f["new_block_ids"].append(self._block())
        elif broken == "beyond_known":
            f["num_scheduled_tokens"][i] = int(t.num_tokens[s] - t.num_computed[s]) + 1
            f["num_new_blocks"][i] += 1
            f["new_block_ids"].append(self._block())  # last entry's ids shift by one: still valid
        elif broken == "short_blocks" and sum(f["num_new_blocks"]):
            j = int(np.flatnonzero(f["num_new_blocks"])[0])
            f["num_new_blocks"][j] -= 1
            f["new_block_ids"].pop()
        elif broken == "too_many_blocks":
            extra = t.max_blocks_per_seq - int(t.num_blocks[s]) - f["num_new_blocks"][i] + 1
            f["num_new_blocks"][i] += extra
            f["new_block_ids"] += [self._block() for _ in range(extra)]
        elif broken in ("block_zero", "block_range"):
            f["num_new_blocks"][i] += 1
            f["new_block_ids"].append(0 if broken == "block_zero" else self.limits.num_kv_blocks + int(rng.integers(3)))
        elif broken == "twice":
            f["slots"].append(s)
            f["num_scheduled_tokens"].append(1)
            f["num_new_blocks"].append(0)
        elif broken == "slot_range":
            f["slots"][i] = self.limits.max_num_slots + int(rng.integers(3))
        elif broken == "zero_tokens":
            f["num_scheduled_tokens"][i] = 0
        elif broken == "lengths":
            f["num_new_blocks"].pop()
        elif broken == "ids_sum":
            f["new_block_ids"].append(self._block())


def _same(a, b) -> None:
    assert a[0] == b[0], (a, b)
    if a[0] == "error":
        assert a == b
        return
    for name in ("step_id", "num_sampled_tokens", "sampled_token_ids", "logprobs", "logprob_token_ids"):
        np.testing.assert_array_equal(getattr(a[1], name), getattr(b[1], name), err_msg=name)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_both_paths_agree_on_random_plans(tiny_loaded, seed):
    reference, fast = (build_runner(tiny_loaded, tiny_config()) for _ in range(2))
    reference.fast_path = False
    assert fast.fast_path
    seen_ref, seen_fast = _recorded(reference), _recorded(fast)
    rng = np.random.default_rng(seed)
    script = Script(rng, reference.slot_table, reference.limits, reference.block_size)
    counts = {"ok": 0, "error": 0, "fast": 0}
    for _ in range(5):
        request = script.lifecycle()
        _same(_run(reference, request, fast=False), _run(fast, request, fast=True))
    for step in range(60):
        if rng.random() < 0.15 and (~reference.slot_table.active).any():
            request = script.lifecycle()
        else:
            request = script.plain(BREAKS[step % len(BREAKS)] if rng.random() < 0.4 else None)
            counts["fast"] += decode_fast.parse_plan(request.plan.SerializeToString(), fast.limits) is not None
        a, b = _run(reference, request, fast=False), _run(fast, request, fast=True)
        _same(a, b)
        counts[a[0]] += 1
        for name in TABLE:
            np.testing.assert_array_equal(getattr(reference.slot_table, name), getattr(fast.slot_table, name), err_msg=name)
    assert len(seen_ref) == len(seen_fast)
    for ref_inputs, fast_inputs in zip(seen_ref, seen_fast):
        for name, value in ref_inputs.items():
            np.testing.assert_array_equal(value, fast_inputs[name], err_msg=name)
    # Both kinds of plan and both outcomes were met (else the test would prove nothing).
    assert counts["ok"] > 10 and counts["error"] > 5 and counts["fast"] > 10


def test_plain_parse_matches_from_pb(tiny_runner):
    """Where parse_plan accepts a plan, from_pb reads the same arrays; where it declines, from_pb
    either raises or finds more than a plain plan."""
    limits, rng = tiny_runner.limits, np.random.default_rng(7)
    table = tiny_runner.slot_table
    table.active[:8] = True
    table.num_tokens[:8] = 40
    script = Script(rng, table, limits, tiny_runner.block_size)
    accepted = declined = 0
    for step in range(200):
        request = script.plain(BREAKS[step % len(BREAKS)] if step % 2 else None)
        if step % 7 == 0:
            request.plan.finished_slots.append(0)
        if step % 11 == 0:
            request.plan.extension = b"ignored"
        parsed = decode_fast.parse_plan(request.plan.SerializeToString(), limits)
        try:
            expected = from_pb(request, limits)
        except PlanError:
            assert parsed is None
            declined += 1
            continue
        if parsed is None:
            assert expected.finished_slots.size
            declined += 1
            continue
        accepted += 1
        assert parsed.plain and parsed.step_id == expected.step_id and parsed.new_sequences == []
        for name in PLAN:
            np.testing.assert_array_equal(getattr(parsed, name), getattr(expected, name))
            assert getattr(parsed, name).dtype == np.int64
        assert parsed.allowed_token_bitmask.shape == expected.allowed_token_bitmask.shape
        for name in ("finished_slots", "preempted_slots", "aborted_slots", "copy_src", "copy_dst", "masked_slots"):
            assert getattr(parsed, name).size == 0
    assert accepted > 20 and declined > 20


def test_unpacked_fields_read_as_packed(tiny_runner):
    """Protobuf parsers accept a repeated number field unpacked too; so does parse_plan."""
    plan = engine_pb2.BatchPlan(step_id=3, slots=[2, 5], num_scheduled_tokens=[1, 4], num_new_blocks=[0, 1], new_block_ids=[9])
    wire = b"\x08\x03" + b"".join(bytes([field << 3, value]) for field, value in ((3, 2), (4, 1), (3, 5), (4, 4), (5, 0), (5, 1), (6, 9)))
    assert engine_pb2.BatchPlan.FromString(wire) == plan
    parsed = decode_fast.parse_plan(wire, tiny_runner.limits)
    assert parsed is not None and parsed.step_id == 3
    assert [getattr(parsed, name).tolist() for name in PLAN] == [[2, 5], [1, 4], [0, 1], [9]]


@pytest.mark.parametrize("seed", range(4))
def test_encoded_result_is_result_to_pb(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    output = ComputedStep(
        step_id=int(rng.integers(0, 1 << 40)),
        num_sampled_tokens=rng.integers(0, 3, n),
        sampled_token_ids=rng.integers(0, 1 << 32, int(rng.integers(0, 300))),
        forward_ns=int(rng.integers(0, 1 << 50)),
        sample_ns=int(rng.integers(0, 2)),
        num_draft_tokens=int(rng.integers(0, 5)),
        num_accepted_draft_tokens=int(rng.integers(0, 2)),
    )
    total_ns = int(rng.integers(0, 1 << 33))
    wire = decode_fast.encode_result(output, total_ns)
    expected = result_to_pb(output, total_ns=total_ns)
    assert wire == expected.SerializeToString()
    assert engine_pb2.ExecuteResponse.FromString(wire) == expected
    with pytest.raises(ValueError, match="uint32"):
        decode_step.encode_result(1, np.array([-1]), np.zeros(0, dtype=np.int64), 0, 0, 0, 0, 0)


def test_result_with_logprobs_takes_result_to_pb():
    output = ComputedStep(1, np.ones(1, dtype=np.int64), np.array([4]), 0, 0, logprobs=np.zeros(3, dtype=np.float32))
    assert decode_fast.encode_result(output, 0) is None


def test_advance_is_the_array_update(tiny_runner):
    table, rng = tiny_runner.slot_table, np.random.default_rng(3)
    table.num_tokens[:] = rng.integers(0, 20, table.max_num_slots)
    expected_tokens, expected_num = table.tokens.copy(), table.num_tokens.copy()
    slots = rng.permutation(table.max_num_slots)[:10].astype(np.int64)
    context_lens = rng.integers(0, 20, 10)
    sample_slots = slots[rng.random(10) < 0.6]
    sampled = rng.integers(0, 1000, sample_slots.size)
    expected_tokens[sample_slots, expected_num[sample_slots]] = sampled
    expected_num[sample_slots] += 1
    decode_step.advance(table, slots, context_lens, sample_slots, sampled)
    np.testing.assert_array_equal(table.num_computed[slots], context_lens)
    np.testing.assert_array_equal(table.tokens, expected_tokens)
    np.testing.assert_array_equal(table.num_tokens, expected_num)
    # A full token row is refused before anything changes.
    table.num_tokens[slots[0]] = table.tokens.shape[1]
    before = table.num_computed.copy()
    with pytest.raises(ValueError, match="no room"):
        decode_step.advance(table, slots, context_lens + 1, slots[:1], sampled[:1])
    np.testing.assert_array_equal(table.num_computed, before)


def test_beyond_max_model_len_same_error(tiny_loaded):
    """A sequence whose sampled token reached the extra column: its next plain step names
    max_model_len on both paths."""
    reference, fast = (build_runner(tiny_loaded, tiny_config()) for _ in range(2))
    reference.fast_path = False
    length = reference.limits.max_model_len
    bs = reference.block_size
    sequence = engine_pb2.NewSequence(slot=0, token_ids=[5] * length, num_computed_tokens=0,
                                      sampling=common_pb2.SamplingParams(seed=1, temperature=0.0))
    blocks = list(range(1, -(-length // bs) + 1))
    first = engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(
        step_id=1, new_sequences=[sequence], slots=[0], num_scheduled_tokens=[length], num_new_blocks=[len(blocks)],
        new_block_ids=blocks))
    _same(_run(reference, first, fast=False), _run(fast, first, fast=True))
    nxt = engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan(step_id=2, slots=[0], num_scheduled_tokens=[1], num_new_blocks=[1],
                                                              new_block_ids=[len(blocks) + 1]))
    a, b = _run(reference, nxt, fast=False), _run(fast, nxt, fast=True)
    assert a == b and a[0] == "error" and a[1] in ("num_scheduled_tokens", "num_new_blocks")


def test_request_parse_is_the_plan_parse(tiny_runner):
    """The server hands parse_request the ExecuteRequest's bytes: the plan alone is read as
    parse_plan reads it; no plan, an empty one or any other field leaves it to from_pb."""
    limits = tiny_runner.limits
    plan = engine_pb2.BatchPlan(step_id=4, slots=[1, 3], num_scheduled_tokens=[1, 1], num_new_blocks=[1, 0], new_block_ids=[7])
    wire = engine_pb2.ExecuteRequest(plan=plan).SerializeToString()
    parsed, expected = decode_fast.parse_request(wire, limits), decode_fast.parse_plan(plan.SerializeToString(), limits)
    assert parsed is not None and expected is not None and parsed.step_id == expected.step_id == 4
    for name in PLAN:
        np.testing.assert_array_equal(getattr(parsed, name), getattr(expected, name))
    for other in (b"", engine_pb2.ExecuteRequest(plan=engine_pb2.BatchPlan()).SerializeToString(),
                  wire + b"\x10\x01", wire[:-1]):
        assert decode_fast.parse_request(other, limits) is None
