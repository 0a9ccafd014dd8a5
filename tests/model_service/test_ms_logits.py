"""model_service/step/logits.py against plain formulas on hand-made logits, and the plan checks of
the new per-sequence fields (penalties, logit bias, min tokens, masks, logprob counts)."""
import numpy as np
import pytest
import torch

from model_service.batch import from_pb
from model_service.step.plan import LogitsProcessing, PlanError, PlanLimits
from model_service.step.logits import apply_masks, apply_processing, gather_logprobs
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
