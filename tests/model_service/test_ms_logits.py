"""model_service/step/logits.py against plain formulas on hand-made logits, and the plan checks of
the new per-sequence fields (penalties, logit bias, min tokens, masks, logprob counts)."""
import numpy as np
import pytest
import torch

from model_service.batch import from_pb
from model_service.step.logits import apply_masks, apply_processing, gather_logprobs
from model_service.step.plan import LogitsProcessing, PlanError, PlanLimits
from model_service.step.sampler import on_device
from model_service.step.slot_table import SlotTable
from planserve.v1 import engine_pb2

VOCAB = 40


def _cache_with(slot, token_ids, processing):
    cache = SlotTable(max_num_slots=4, max_model_len=64, block_size=16)
    cache.register(slot, np.asarray(token_ids, dtype=np.int32), 0, 1.0, 0, 1.0, 0, processing)
    return cache


def test_penalties_bias_and_suppression_follow_their_formulas():
    prompt, output = [1, 2, 3], [3, 4, 4, 5]
    p = LogitsProcessing(num_prompt_tokens=3, repetition_penalty=1.5, presence_penalty=0.5,
                         frequency_penalty=0.25, logit_bias=((7, 3.0), (8, -2.0)),
                         min_new_tokens=10, min_tokens_suppressed_ids=(9,))
    cache = _cache_with(2, prompt + output, p)
    logits = torch.linspace(-2, 2, VOCAB).repeat(2, 1)
    expected = logits[1].clone()
    for t in set(prompt + output):  # repetition: prompt and output tokens
        expected[t] = expected[t] / 1.5 if expected[t] > 0 else expected[t] * 1.5
    for t in set(output):  # presence once, frequency per occurrence: output tokens only
        expected[t] -= 0.5 + 0.25 * output.count(t)
    expected[7] += 3.0
    expected[8] -= 2.0
    expected[9] = float("-inf")  # 4 of 10 min tokens generated
    untouched = logits[0].clone()
    apply_processing(logits, np.array([1]), np.array([2]), cache)
    torch.testing.assert_close(logits[1], expected)
    torch.testing.assert_close(logits[0], untouched)


def test_suppression_ends_once_min_new_tokens_are_generated():
    p = LogitsProcessing(num_prompt_tokens=2, min_new_tokens=2, min_tokens_suppressed_ids=(9,))
    cache = _cache_with(0, [1, 2, 5, 6], p)  # two generated
    logits = torch.zeros(1, VOCAB)
    apply_processing(logits, np.array([0]), np.array([0]), cache)
    assert torch.isfinite(logits).all()


def test_masks_keep_only_allowed_tokens_and_the_grammar_wins_over_suppression():
    logits = torch.zeros(2, VOCAB)
    logits[1, 5] = float("-inf")  # as if min tokens suppressed the only allowed token
    raw = torch.zeros(2, VOCAB)
    words = -(-VOCAB // 32)
    masks = np.zeros((2, words), dtype=np.uint32)
    masks[0, 0] = (1 << 3) | (1 << 31)
    masks[0, 1] = 1 << (33 - 32)
    masks[1, 0] = 1 << 5
    apply_masks(logits, np.array([0, 1]), masks, raw)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3, 31, 33]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5]


def test_gather_logprobs_layout():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    values, ids = gather_logprobs(logits, np.array([1, 0]), np.array([2, 0]))
    reference = torch.log_softmax(logits, -1)
    np.testing.assert_allclose(values, [reference[0, 1], reference[0, 3], reference[0, 2], reference[1, 0]], rtol=1e-6)
    assert ids.tolist() == [3, 2]


LIMITS = PlanLimits(vocab_size=VOCAB, num_kv_blocks=8, max_num_slots=4, max_model_len=64)


def _plan(**sequence_fields):
    request = engine_pb2.ExecuteRequest()
    seq = request.plan.new_sequences.add(slot=0, token_ids=[1, 2, 3], **sequence_fields)
    seq.sampling.seed = 1
    return request, seq


@pytest.mark.parametrize("mutate, field", [
    (lambda s: setattr(s.sampling, "min_p", 1.5), "new_sequences[0].sampling.min_p"),
    (lambda s: setattr(s.sampling, "repetition_penalty", 0.0), "new_sequences[0].sampling.repetition_penalty"),
    (lambda s: setattr(s.sampling, "presence_penalty", 3.0), "new_sequences[0].sampling.presence_penalty"),
    (lambda s: s.sampling.logit_bias.update({VOCAB: 1.0}), "new_sequences[0].sampling.logit_bias"),
    (lambda s: s.sampling.logit_bias.update({1: 500.0}), "new_sequences[0].sampling.logit_bias[1]"),
    (lambda s: s.min_tokens_suppressed_ids.append(VOCAB), "new_sequences[0].min_tokens_suppressed_ids"),
    (lambda s: setattr(s, "num_logprobs", 21), "new_sequences[0].num_logprobs"),
    (lambda s: setattr(s, "num_prompt_tokens", 4), "new_sequences[0].num_prompt_tokens"),
])
def test_bad_sequence_fields_name_the_field(mutate, field):
    request, seq = _plan()
    mutate(seq)
    with pytest.raises(PlanError) as error:
        from_pb(request, LIMITS)
    assert error.value.field == field


def test_bad_masks_name_the_field():
    request, _ = _plan()
    plan = request.plan
    plan.slots.append(0)
    plan.num_scheduled_tokens.append(3)
    plan.num_new_blocks.append(1)
    plan.new_block_ids.append(1)
    plan.masked_slots.append(0)
    plan.allowed_token_bitmask = b"\x00" * 4  # too short: 40 tokens need two words
    with pytest.raises(PlanError, match="allowed_token_bitmask: 4 bytes"):
        from_pb(request, LIMITS)
    plan.allowed_token_bitmask = b"\x00" * 4 + b"\x00\x01\x00\x00"  # only token 40: past the vocab
    with pytest.raises(PlanError, match="allows no token"):
        from_pb(request, LIMITS)
    plan.masked_slots[0] = 1
    plan.allowed_token_bitmask = b"\x01" + b"\x00" * 7
    with pytest.raises(PlanError, match="masked_slots: slot 1 is not scheduled"):
        from_pb(request, LIMITS)


def row_by_row(logits, rows, slots, slot_table, in_flight=None):
    """apply_processing as it was before it took all rows at once: one row at a time, each rule
    on that row's own tokens. The batched version must give its bits."""
    vocab, device = logits.shape[-1], logits.device
    for i, (row, slot) in enumerate(zip(rows.tolist(), slots.tolist())):
        p = slot_table.processing[slot]
        known = slot_table.tokens[slot, : slot_table.num_tokens[slot]]
        num_output = known.size - p.num_prompt_tokens
        last = None  # the last token where it is still in flight: [1] on the device
        if in_flight is not None and in_flight[0][i] >= 0:
            known = known[:-1]
            last = in_flight[1][int(in_flight[0][i])].view(1)
        line = logits[row]
        if p.repetition_penalty != 1.0:
            seen = on_device(device, np.unique(known).astype(np.int64))
            if last is not None:  # a repeat of a known token is written twice, the same value
                seen = torch.cat([seen, last])
            values = line[seen]
            line[seen] = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and num_output:
            output = known[p.num_prompt_tokens :]
            host_counts = np.bincount(output, minlength=vocab)[:vocab].astype(np.float32)
            counts = on_device(device, host_counts)
            if last is not None:
                counts = counts.index_add(0, last, torch.ones(1, device=device))
            line -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias)
            bias = on_device(device, np.array(biases, dtype=np.float64)).to(line.dtype)
            line[on_device(device, np.array(ids, dtype=np.int64))] += bias
        if p.min_new_tokens and num_output < p.min_new_tokens and p.min_tokens_suppressed_ids:
            suppressed = np.array(p.min_tokens_suppressed_ids, dtype=np.int64)
            line[on_device(device, suppressed)] = float("-inf")


def _random_rows(seed: int, in_flight: bool):
    """12 slots of random prompts and outputs (tokens repeat) with every rule mixed across them,
    logits with ties, zeros of both signs and -inf, and where asked tokens in flight."""
    rng = np.random.default_rng(seed)
    vocab, slots = 300, np.arange(12)
    table = SlotTable(max_num_slots=12, max_model_len=96, block_size=16)
    for slot in slots.tolist():
        prompt = rng.integers(0, 40, size=int(rng.integers(1, 30)))
        output = rng.integers(0, 40, size=int(rng.integers(0, 30)))
        processing = LogitsProcessing(
            num_prompt_tokens=prompt.size,
            repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])),
            presence_penalty=float(rng.choice([0.0, 0.5, -0.25])),
            frequency_penalty=float(rng.choice([0.0, 0.25, 1.5])),
            logit_bias=tuple((int(t), float(b)) for t, b in zip(
                rng.choice(vocab, size=int(rng.integers(0, 4)), replace=False),
                rng.normal(size=4))),
            min_new_tokens=int(rng.integers(0, 20)),
            min_tokens_suppressed_ids=tuple(int(t) for t in rng.integers(0, vocab, size=2)),
        )
        table.register(slot, np.concatenate([prompt, output]).astype(np.int32), 0, 1.0, 0, 1.0, 0,
                       processing)
    logits = torch.from_numpy(rng.normal(size=(14, vocab)).astype(np.float32))
    logits[:, 50:60] = 0.0
    logits[:, 60:63] = -0.0
    logits[:, 63] = float("-inf")
    logits[:, 64:66] = 1.0
    rows = rng.permutation(14)[:12]
    late = None
    if in_flight:
        ids = torch.from_numpy(rng.integers(0, 40, size=5))
        outputs = table.num_tokens[slots] - [p.num_prompt_tokens for p in table.processing[:12]]
        index = np.where(rng.random(12) < 0.6, rng.integers(0, 5, size=12), -1)
        late = (np.where(outputs > 0, index, -1), ids)  # only an output token can be in flight
    return logits, rows, slots, table, late


@pytest.mark.parametrize("in_flight", [False, True], ids=["host", "in flight"])
@pytest.mark.parametrize("seed", range(6))
def test_all_rows_at_once_give_the_row_by_row_bits(seed, in_flight):
    logits, rows, slots, table, late = _random_rows(seed, in_flight)
    expected = logits.clone()
    row_by_row(expected, rows, slots, table, late)
    apply_processing(logits, rows, slots, table, late)
    assert torch.equal(logits.view(torch.int32), expected.view(torch.int32))
    assert not torch.equal(expected, _random_rows(seed, in_flight)[0])  # the rules did something
