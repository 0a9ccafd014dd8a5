"""The speculative-sampling rule (model_service/speculative/verify.py): the edge cases of
shared/reference/001 one by one, and chi-square tests that what it emits is distributed as the
target's own samples, for a deterministic drafter (n-gram) and for a sampling draft model."""
import numpy as np
import pytest
import torch

from conftest import tiny_config
from model_service.step.plan import PlanArrays, SlotRegistration
from model_service.start import build_runner
from model_service.step.sampler import draw
from model_service.speculative.verify import Draft, NgramDrafter, uniforms, verify, verify_greedy

V = 6
# Chi-square critical value at p = 0.001 for V - 1 = 5 degrees of freedom: a correct rule fails
# one run in a thousand; a wrong one (e.g. a one-hot residual with a sampling draft) fails always.
CHI2_CRIT_5DOF = 20.515


def _p(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_all_accepted_then_a_bonus_from_the_last_position():
    target = torch.stack([_p(0, 1, 0, 0, 0, 0), _p(0, 0, 1, 0, 0, 0), _p(0, 0, 0, 0, 0, 1)])
    draft = Draft(np.array([1, 2]))
    tokens, accepted = verify(target, draft, np.array([0.99, 0.99]), np.array([0.5, 0.5, 0.5]))
    assert (tokens, accepted) == ([1, 2, 5], 2)


def test_first_rejected_resamples_from_the_residual_and_stops():
    # p(1) = 0.25, u = 0.5 rejects; the residual (target without token 1) is 3 and 4 evenly.
    target = torch.stack([_p(0, 0.25, 0, 0.375, 0.375, 0), _p(1, 0, 0, 0, 0, 0)])
    tokens, accepted = verify(target, Draft(np.array([1])), np.array([0.5]), np.array([0.2, 0.0]))
    assert (tokens, accepted) == ([3], 0)
    tokens, _ = verify(target, Draft(np.array([1])), np.array([0.5]), np.array([0.7, 0.0]))
    assert tokens == [4]


def test_zero_draft_probability_is_a_rejection():
    target = torch.stack([_p(0.5, 0.5, 0, 0, 0, 0), _p(1, 0, 0, 0, 0, 0)])
    q = torch.stack([_p(1, 0, 0, 0, 0, 0)])  # the draft model gave token 1 no mass
    tokens, accepted = verify(target, Draft(np.array([1]), q), np.array([0.0]), np.array([0.9, 0.0]))
    assert accepted == 0
    assert tokens == [1]  # residual max(0, p - q) = token 1 alone


def test_degenerate_residual_falls_back_to_the_target():
    # p == q: the ratio is 1 and u < 1 always accepts, so force the rejection branch with a
    # q whose mass covers p everywhere (p - q <= 0): the residual is empty, draw from p.
    target = torch.stack([_p(0.5, 0.5, 0, 0, 0, 0), _p(1, 0, 0, 0, 0, 0)])
    q = torch.stack([_p(0.5, 0.5 + 1e-9, 0, 0, 0, 0)])
    tokens, accepted = verify(target, Draft(np.array([1]), q), np.array([0.9999999999]), np.array([0.75, 0.0]))
    assert accepted == 0 and tokens == [1]  # from p = (0.5, 0.5): u = 0.75 lands on token 1


def test_greedy_accepts_while_drafts_are_the_argmax():
    assert verify_greedy(np.array([4, 2, 3]), Draft(np.array([4, 2]))) == ([4, 2, 3], 2)
    assert verify_greedy(np.array([4, 1, 3]), Draft(np.array([4, 2]))) == ([4, 1], 1)
    assert verify_greedy(np.array([0, 1, 3]), Draft(np.array([4, 2]))) == ([0], 0)


def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _first_token_counts(target_row, make_draft, trials):
    counts = np.zeros(V)
    target = torch.stack([target_row, _p(1, 1, 1, 1, 1, 1)])
    for seed in range(trials):
        accept_u, draw_u = uniforms(seed, 100, 2)
        tokens, _ = verify(target, make_draft(seed), accept_u[:1], draw_u)
        counts[tokens[0]] += 1
    return counts


P = _p(0.05, 0.30, 0.10, 0.25, 0.20, 0.10)


def test_ngram_draft_emits_the_target_distribution():
    # A deterministic draft of token 1 (often right) and of token 0 (rarely right).
    for token in (1, 0):
        counts = _first_token_counts(P, lambda seed: Draft(np.array([token])), 6000)
        assert _chi2(counts, P.numpy()) < CHI2_CRIT_5DOF, counts


def test_sampled_draft_model_emits_the_target_distribution():
    q = _p(0.30, 0.05, 0.25, 0.10, 0.10, 0.20)  # far from P on purpose

    def draft(seed):
        u = np.random.default_rng(seed).random(1)
        return Draft(draw(q[None], u).numpy(), q[None])

    counts = _first_token_counts(P, draft, 6000)
    assert _chi2(counts, P.numpy()) < CHI2_CRIT_5DOF, counts


def test_a_one_hot_residual_with_a_sampling_draft_would_be_caught():
    """The same chi-square check rejects reference 001's residual (draft treated as one-hot)
    when the draft model samples: the test has the power to see a wrong rule."""
    q = _p(0.30, 0.05, 0.25, 0.10, 0.10, 0.20)

    def draft(seed):
        u = np.random.default_rng(seed).random(1)
        token = draw(q[None], u).numpy()
        # One-hot q with the drafted token's probability, as reference 001 builds it.
        one_hot = torch.zeros(1, V, dtype=torch.float64)
        one_hot[0, int(token[0])] = q[int(token[0])]
        return Draft(token, one_hot)

    counts = _first_token_counts(P, draft, 6000)
    assert _chi2(counts, P.numpy()) > CHI2_CRIT_5DOF, counts


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(max_n=3)
    tokens = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert drafter.propose(tokens, 2).token_ids.tolist() == [7, 8]  # latest "1 2 3" is followed by 7 8
    assert drafter.propose(np.array([5, 6, 7]), 3).token_ids.size == 0  # nothing repeats
    assert drafter.propose(np.array([4, 4]), 3).token_ids.tolist() == [4]  # 1-gram, up to the end


# ---- the runner with drafts: acceptance, rejection and bonus on the real tiny model ----------

_EMPTY = np.zeros(0, dtype=np.int64)


class ScriptedDrafter:
    """Injected drafts: the true greedy continuation, with every `wrong_every`-th proposal's
    second token corrupted, so that steps see full acceptance, early and late rejections."""

    def __init__(self, continuation: dict[tuple, list[int]], wrong_every: int):
        self.continuation, self.wrong_every, self.calls = continuation, wrong_every, 0

    def on_register(self, slot):
        pass

    def propose_batch(self, cache, slots, rooms):
        return [self.propose(cache.tokens[s, : cache.num_tokens[s]], int(k)) for s, k in zip(slots.tolist(), rooms.tolist())]

    def propose(self, tokens: np.ndarray, k: int) -> Draft:
        self.calls += 1
        for prompt, full in self.continuation.items():
            if tuple(tokens[: len(prompt)].tolist()) == prompt:
                proposal = list(full[len(tokens) : len(tokens) + k])
                if self.calls % self.wrong_every == 0 and len(proposal) > 1:
                    proposal[1] = (proposal[1] + 1) % 1000
                return Draft(np.asarray(proposal, dtype=np.int64))
        return Draft(_EMPTY)


def _generate(runner, prompts, new_tokens, lookahead):
    """A minimal scheduler: whole-prompt prefill, then decodes granted 1 + lookahead tokens;
    computed advances by what came back for decodes (the scheduler's rule)."""
    seqs = {slot: dict(tokens=list(p), computed=0, blocks=[]) for slot, p in enumerate(prompts)}
    new = [SlotRegistration(slot, np.asarray(p, dtype=np.int32), 0, 0.0, 0, 1.0, 0, None, True) for slot, p in enumerate(prompts)]
    next_block, step = 1, 0
    while any(len(s["tokens"]) - len(prompts[slot]) < new_tokens for slot, s in seqs.items()):
        slots, counts, num_new, ids = [], [], [], []
        for slot, s in seqs.items():
            to_compute = len(s["tokens"]) - s["computed"]
            n = to_compute + (lookahead if to_compute == 1 else 0)
            need = -(-(s["computed"] + n) // 16) - len(s["blocks"])
            fresh = list(range(next_block, next_block + max(need, 0)))
            next_block += len(fresh)
            s["blocks"] += fresh
            slots.append(slot), counts.append(n), num_new.append(len(fresh)), ids.extend(fresh)
        plan = PlanArrays(step, new, np.array(slots), np.array(counts), np.array(num_new), np.array(ids, dtype=np.int64), _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)
        new, step = [], step + 1
        out = runner.execute(plan)
        at = 0
        for slot, n, k in zip(slots, counts, out.num_sampled_tokens.tolist()):
            s = seqs[slot]
            decode = len(s["tokens"]) - s["computed"] == 1
            s["computed"] += k if decode and k else n
            s["tokens"] += out.sampled_token_ids[at : at + k].tolist()
            at += k
    return [s["tokens"][len(prompts[slot]) : len(prompts[slot]) + new_tokens] for slot, s in seqs.items()]


def test_runner_with_drafts_emits_the_plain_greedy_tokens(tiny_loaded):
    prompts = [list(range(300, 320)), list(range(1000, 1037)), [7] * 9]
    plain = _generate(build_runner(tiny_loaded, tiny_config()), prompts, 24, lookahead=0)
    runner = build_runner(tiny_loaded, tiny_config(speculative_method="ngram", num_speculative_tokens=3))
    runner.speculation.drafter = ScriptedDrafter({tuple(p): p + out for p, out in zip(prompts, plain)}, wrong_every=3)
    speculated = _generate(runner, prompts, 24, lookahead=3)
    assert speculated == plain
    assert runner.speculation.drafter.calls > 0


def test_runner_reports_drafts_and_acceptances(tiny_loaded):
    prompt = list(range(300, 320))
    [plain] = _generate(build_runner(tiny_loaded, tiny_config()), [prompt], 12, lookahead=0)
    runner = build_runner(tiny_loaded, tiny_config(speculative_method="ngram", num_speculative_tokens=3))
    runner.speculation.drafter = ScriptedDrafter({tuple(prompt): prompt + plain}, wrong_every=10**9)  # always right
    outputs = []
    original = runner.execute
    runner.execute = lambda plan: outputs.append(original(plan)) or outputs[-1]
    assert _generate(runner, [prompt], 12, lookahead=3) == [plain]
    decodes = [o for o in outputs if o.num_draft_tokens]
    assert decodes and all(o.num_accepted_draft_tokens == o.num_draft_tokens == 3 for o in decodes[:-1])
    assert all(o.num_sampled_tokens[0] == 4 for o in decodes[:-1])  # 3 accepted + the bonus


def test_draft_model_equal_to_the_target_is_always_accepted_greedy(tiny_loaded):
    """The tiny model drafting for itself proposes the target's own greedy tokens: every draft
    is accepted (up to near ties) and the output is the plain greedy output."""
    prompts = [list(range(300, 320)), list(range(1000, 1037))]
    plain = _generate(build_runner(tiny_loaded, tiny_config()), prompts, 16, lookahead=0)
    runner = build_runner(tiny_loaded, tiny_config(speculative_method="draft", draft_model="tiny", num_speculative_tokens=3))
    outputs = []
    original = runner.execute
    runner.execute = lambda plan: outputs.append(original(plan)) or outputs[-1]
    assert _generate(runner, prompts, 16, lookahead=3) == plain
    drafted = sum(o.num_draft_tokens for o in outputs)
    accepted = sum(o.num_accepted_draft_tokens for o in outputs)
    assert drafted > 0 and accepted == drafted
