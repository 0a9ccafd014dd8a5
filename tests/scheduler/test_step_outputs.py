"""cython_ext/step_outputs.pyx against Python: take_plain_tokens against its pure-Python statement
(below) on random steps of fake requests, and the whole of overlap's reconcile with it against
reconcile with every entry on the interpreted path, on random workloads (stream_interval, stop
strings, stop ids, eos, max_new_tokens, the model's length, parallel samples, logprobs, text made
here or not, preemptions and aborts): every output equal, field by field. put_outputs,
note_token_times and BatchSink against the loops they replace."""
import collections
import random
import types

import pytest

from cython_ext import step_outputs
from factories import EOS, make_request, make_scheduler
from scheduler_service.core.plan import StepResult
from scheduler_service.core.request import FinishReason, RequestOutput
from scheduler_service.text import outputs as outputs_module

NO_TEXT = object()


def take_plain_tokens_py(requests, sampled, counts, live, placeholders, core, held, detokenizers,
                         no_text, output_type, max_model_len, eos_token_ids, now, slow, outputs):
    """The rule take_plain_tokens states, in Python."""
    if len(counts) > len(requests):
        raise ValueError(f"{len(counts)} counts for {len(requests)} entries")
    offset = 0
    for index, count in enumerate(counts):
        if count == 0:
            continue
        if count < 0 or offset + count > len(sampled):
            raise ValueError(f"entry {index}: {count} tokens at {offset} of {len(sampled)}")
        request = requests[index]
        placeholder = placeholders.get(index) if index in live else None
        plain = (request.logprobs is None and request.prompt_logprobs is None and request.guide is None
                 and request.finish_reason is None and request.slot is not None
                 and (request.forked or request.n == 1) and not request.stopping.stop_strings)
        token = sampled[offset]
        stopping = request.stopping
        stops = (token in stopping.stop_token_ids
                 or (not stopping.ignore_eos and token in eos_token_ids)
                 or len(request.output_token_ids) + 1 >= stopping.max_new_tokens
                 or len(request.prompt_token_ids) + len(request.output_token_ids) + 1 >= max_model_len)
        if count != 1 or placeholder is None or not plain or stops:
            output = slow(index, offset, count)
            if output is not None:
                outputs.append((request, output))
            offset += count
            continue
        offset += 1
        if request.first_token_time is None:
            request.first_token_time = now
        request.output_token_ids.append(token)
        detokenizer = detokenizers[request.request_id]
        if detokenizer is not no_text:
            detokenizer.add_token(token)
        core.set_token(request.slot, placeholder, token)
        output = held.pop(request.request_id, None)
        if output is None:
            output = output_type([token], "", None, None, None, request.index)
        else:
            output.token_ids.append(token)
        if len(output.token_ids) < request.stream_interval:
            held[request.request_id] = output
            continue
        if detokenizer is not no_text:
            output.text = detokenizer.take_text(False)
        outputs.append((request, output))


class _Core:
    def __init__(self):
        self.calls = []

    def set_token(self, slot, index, token):
        self.calls.append((slot, index, token))


class _Detokenizer:
    def __init__(self):
        self.tokens, self.taken = [], 0

    def add_token(self, token):
        self.tokens.append(token)

    def take_text(self, final=False):
        text = "".join(f"<{t}>" for t in self.tokens[self.taken:])
        self.taken = len(self.tokens)
        return text


def _fake_step(rng: random.Random):
    """A random step of fake requests (every kind of entry) and its result, with its state."""
    n = rng.randrange(0, 24)
    requests, counts, sampled, live, placeholders, detokenizers, held = [], [], [], set(), {}, {}, {}
    for index in range(n):
        rid = f"r{index}"
        request = types.SimpleNamespace(
            request_id=rid, index=rng.choice([0, 0, 0, 1]), n=rng.choice([1, 1, 1, 2]),
            forked=rng.random() < 0.5, slot=None if rng.random() < 0.05 else index,
            logprobs=rng.choice([None] * 6 + [2]), prompt_logprobs=rng.choice([None] * 6 + [1]),
            guide=rng.choice([None] * 8 + ["g"]), finish_reason=rng.choice([None] * 12 + [FinishReason.STOP]),
            first_token_time=rng.choice([None, 1.0]), stream_interval=rng.choice([1, 1, 2, 3, 8]),
            prompt_token_ids=[5] * rng.randrange(1, 30), output_token_ids=[6] * rng.randrange(0, 20),
            stopping=types.SimpleNamespace(
                stop_token_ids=frozenset(rng.sample(range(2, 12), rng.randrange(0, 3))),
                ignore_eos=rng.random() < 0.3, max_new_tokens=rng.randrange(1, 40),
                stop_strings=("x",) if rng.random() < 0.1 else ()),
            plain_facts=None)
        requests.append(request)
        counts.append(rng.choice([0, 1, 1, 1, 1, 2]))
        sampled += [rng.randrange(0, 12) for _ in range(counts[-1])]
        if rng.random() < 0.9:
            live.add(index)
        if rng.random() < 0.95:
            placeholders[index] = None if rng.random() < 0.05 else rng.randrange(0, 60)
        detokenizers[rid] = NO_TEXT if rng.random() < 0.5 else _Detokenizer()
        if rng.random() < 0.3:
            held[rid] = RequestOutput(token_ids=[9] * rng.randrange(1, 3), text="")
    return requests, sampled, counts, live, placeholders, detokenizers, held


def _snapshot(requests, held, outputs, core, slow_calls, detokenizers):
    return ([(r.output_token_ids, r.first_token_time) for r in requests],
            {k: (v.token_ids, v.text) for k, v in held.items()},
            [(r.request_id, o) for r, o in outputs], core.calls, slow_calls,
            {k: (d.tokens, d.taken) for k, d in detokenizers.items() if d is not NO_TEXT})


def _run_take(take, seed):
    import copy
    requests, sampled, counts, live, placeholders, detokenizers, held = copy.deepcopy(
        _fake_step(random.Random(seed)), memo={id(NO_TEXT): NO_TEXT})
    core, slow_calls, outputs = _Core(), [], []

    def slow(index, offset, count):
        slow_calls.append((index, offset, count))
        return RequestOutput(token_ids=sampled[offset:offset + count], text="slow") if index % 3 else None

    take(requests, sampled, counts, live, placeholders, core, held, detokenizers, NO_TEXT,
         RequestOutput, 48, frozenset({EOS}), 2.5, slow, outputs)
    return _snapshot(requests, held, outputs, core, slow_calls, detokenizers)


@pytest.mark.parametrize("seed", range(300))
def test_take_plain_tokens_equals_its_python_statement(seed):
    assert _run_take(step_outputs.take_plain_tokens, seed) == _run_take(take_plain_tokens_py, seed)


def _next_step(rng: random.Random, requests: list) -> tuple:
    """Another step of the same requests: new tokens, and what may change between steps changed
    (one ended, one out of its slot, samples forked)."""
    counts, sampled, live, placeholders = [], [], set(), {}
    for index, request in enumerate(requests):
        if rng.random() < 0.05:
            request.finish_reason = FinishReason.STOP
        if rng.random() < 0.05:
            request.slot = None if request.slot is not None else index
        if rng.random() < 0.1:
            request.forked = True
        counts.append(rng.choice([0, 1, 1, 1, 1, 2]))
        sampled += [rng.randrange(0, 12) for _ in range(counts[-1])]
        if rng.random() < 0.9:
            live.add(index)
        if rng.random() < 0.95:
            placeholders[index] = rng.randrange(0, 60)
    return sampled, counts, live, placeholders


@pytest.mark.parametrize("seed", range(60))
def test_the_facts_kept_from_a_first_step_give_the_python_statement_in_the_next(seed):
    """take_plain_tokens keeps each request's unchanging facts from the first step it sees it in
    (Request.plain_facts). Over eight steps of the same requests, with what does change changed
    between them, and a step of another replica's model length and eos ids (the facts made
    again), it takes what the Python statement takes."""
    import copy
    first = _fake_step(random.Random(seed))
    runs = {}
    for take in (step_outputs.take_plain_tokens, take_plain_tokens_py):
        requests, sampled, counts, live, placeholders, detokenizers, held = copy.deepcopy(
            first, memo={id(NO_TEXT): NO_TEXT})
        rng, snapshots = random.Random(seed + 1000), []
        for step in range(8):
            core, slow_calls, outputs = _Core(), [], []

            def slow(index, offset, count, sampled=sampled, slow_calls=slow_calls):
                slow_calls.append((index, offset, count))
                return RequestOutput(sampled[offset:offset + count], "slow") if index % 3 else None

            max_model_len, eos = (40, frozenset({EOS, 3})) if step == 5 else (48, frozenset({EOS}))
            take(requests, sampled, counts, live, placeholders, core, held, detokenizers, NO_TEXT,
                 RequestOutput, max_model_len, eos, 2.5, slow, outputs)
            snapshots.append(_snapshot(requests, held, outputs, core, slow_calls, detokenizers))
            sampled, counts, live, placeholders = _next_step(rng, requests)
        runs[take] = snapshots
    assert runs[step_outputs.take_plain_tokens] == runs[take_plain_tokens_py]
    kept = [r.plain_facts for r in requests]  # the Python statement's run keeps none
    assert kept == [None] * len(requests)


def test_take_plain_tokens_keeps_a_requests_facts_and_makes_them_again_for_another_model():
    request = make_request(num_prompt_tokens=4, max_new_tokens=10)
    request.slot = 0
    args = dict(live={0}, placeholders={0: 4}, core=_Core(), held={},
                detokenizers={request.request_id: NO_TEXT}, no_text=NO_TEXT,
                output_type=RequestOutput, now=0.0, slow=None)
    eos = frozenset({EOS})
    step_outputs.take_plain_tokens([request], [7], [1], max_model_len=48, eos_token_ids=eos,
                                   outputs=[], **args)
    facts = request.plain_facts
    assert facts is not None and facts[0] is eos and facts[1] == 48
    step_outputs.take_plain_tokens([request], [7], [1], max_model_len=48, eos_token_ids=eos,
                                   outputs=[], **args)
    assert request.plain_facts is facts  # kept, not made again
    step_outputs.take_plain_tokens([request], [7], [1], max_model_len=40, eos_token_ids=eos,
                                   outputs=[], **args)
    assert request.plain_facts is not facts and request.plain_facts[1] == 40


def test_take_plain_tokens_edge_cases():
    args = dict(live=set(), placeholders={}, core=_Core(), held={}, detokenizers={}, no_text=NO_TEXT,
                output_type=RequestOutput, max_model_len=8, eos_token_ids=frozenset({EOS}), now=0.0)
    out = []
    step_outputs.take_plain_tokens([], [], [], slow=None, outputs=out, **args)  # an empty step
    assert out == []
    with pytest.raises(ValueError, match="2 counts for 1 entries"):
        step_outputs.take_plain_tokens([None], [1, 2], [1, 1], slow=None, outputs=out, **args)
    with pytest.raises(ValueError, match="entry 0: 3 tokens at 0 of 2"):
        step_outputs.take_plain_tokens([None], [1, 2], [3], slow=None, outputs=out, **args)
    with pytest.raises(ValueError, match="entry 0: -1 tokens"):
        step_outputs.take_plain_tokens([None], [1], [-1], slow=None, outputs=out, **args)
    # An exception from the interpreted path goes through, nothing after it taken.
    def slow(index, offset, count):
        raise KeyError("from slow")
    with pytest.raises(KeyError, match="from slow"):
        step_outputs.take_plain_tokens([object()], [1], [1], slow=slow, outputs=out, **args)


# ---- reconcile: native against every entry on the interpreted path ----------------------------


def _interpreted(requests, sampled, counts, live, placeholders, core, held, detokenizers, no_text,
                 output_type, max_model_len, eos_token_ids, now, slow, outputs):
    offset = 0
    for index, count in enumerate(counts):
        if count:
            output = slow(index, offset, count)
            if output is not None:
                outputs.append((requests[index], output))
            offset += count


def _next_token(tokens: list[int]) -> int:
    h = (sum(t * (i + 7) for i, t in enumerate(tokens)) * 2654435761) % 1000003
    return EOS if h % 29 == 0 else 2 + h % 150


def _execute(plan, model: dict) -> StepResult:
    """A model service's slot bookkeeping; logprobs for the requests that ask (1 + k values,
    k ids a token)."""
    for slot in plan.finished_slots + plan.preempted_slots + plan.aborted_slots:
        del model[slot]
    for seq in plan.new_sequences:
        model[seq.slot] = [list(seq.token_ids), seq.num_computed_tokens]
    counts, sampled, values, ids = [], [], [], []
    for request, slot, n in zip(plan.requests, plan.slots, plan.num_scheduled_tokens):
        tokens = model[slot][0]
        model[slot][1] += n
        if model[slot][1] == len(tokens):
            tokens.append(_next_token(tokens))
            counts.append(1), sampled.append(tokens[-1])
            if request.logprobs is not None:
                values += [-0.5] + [-1.0 - j for j in range(request.logprobs)]
                ids += [(tokens[-1] + j) % 150 for j in range(request.logprobs)]
        else:
            counts.append(0)
    return StepResult(step_id=plan.step_id, num_sampled_tokens=counts, sampled_token_ids=sampled,
                      forward_ns=0, sample_ns=0, total_ns=0, logprobs=values, logprob_token_ids=ids)


def _request_spec(rng: random.Random, index: int) -> dict:
    return dict(
        num_prompt_tokens=rng.randrange(1, 40), max_new_tokens=rng.randrange(1, 40),
        stop_token_ids=rng.sample(range(2, 152), 10) if rng.random() < 0.3 else (),
        stop=("w7 w9", *(f"w{j} " for j in rng.sample(range(2, 152), 8))) if rng.random() < 0.2 else (),
        ignore_eos=rng.random() < 0.3,
        n=2 if rng.random() < 0.15 else 1, stream_interval=rng.choice([1, 1, 2, 3, 8]),
        logprobs=2 if rng.random() < 0.1 else None, request_id=f"q{index}")


def _run_workload(seed: int, num_blocks: int) -> list:
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=24,
                               max_num_seqs=8, max_model_len=48)
    arrivals = collections.defaultdict(list)
    for index in range(40):
        arrivals[rng.randrange(0, 60)].append(_request_spec(rng, index))
    aborts = {rng.randrange(5, 80): f"q{rng.randrange(40)}" for _ in range(4)}
    detokenize = {f"q{i}": rng.random() < 0.5 for i in range(40)}
    model, in_flight, seen = {}, collections.deque(), []

    def take(outputs):
        for request, output in outputs:
            usage = output.usage
            seen.append((request.request_id, output.token_ids, output.text, output.finish_reason,
                         output.stop_match, output.index, output.logprobs, output.prompt_logprobs,
                         None if usage is None else (usage.prompt_tokens, usage.completion_tokens,
                                                     usage.cached_tokens)))

    step = 0
    while step <= 80 or scheduler.has_work() or in_flight:
        assert step < 5000, "did not drain"
        for spec in arrivals.get(step, []):
            request = make_request(**spec)
            request.detokenize = detokenize[request.request_id] or bool(spec["stop"])
            scheduler.add_request(request)
        if step in aborts:
            scheduler.abort_request(aborts[step])
        step += 1
        if len(in_flight) < 2 and scheduler.has_work():
            plan = scheduler.schedule()
            take(scheduler.take_early_outputs())
            if not plan.is_empty:
                scheduler.commit(plan)
                in_flight.append((plan, _execute(plan, model)))
                if len(in_flight) < 2:
                    continue
        if in_flight:
            plan, result = in_flight.popleft()
            take(scheduler.reconcile(plan, result))
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks, "blocks leaked"
    return seen


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("num_blocks", [20, 300])  # 20: preemptions; 300: prefix-cache hits
def test_reconcile_native_equals_the_interpreted_path(seed, num_blocks, monkeypatch):
    native = _run_workload(seed, num_blocks)
    monkeypatch.setattr(outputs_module, "take_plain_tokens", _interpreted)
    interpreted = _run_workload(seed, num_blocks)
    assert native == interpreted
    reasons = {entry[3] for entry in native}
    assert {FinishReason.LENGTH, FinishReason.STOP, FinishReason.EOS} <= reasons
    assert any(entry[6] for entry in native), "no logprobs in the mix"
    assert any(entry[2] for entry in native) and any(not entry[2] for entry in native)


# ---- delivery ----------------------------------------------------------------------------------


def _pairs(rng: random.Random):
    requests = [types.SimpleNamespace(name=i) for i in range(rng.randrange(0, 12))]
    return [(rng.choice(requests), RequestOutput(token_ids=[1] * rng.randrange(0, 3), text="",
                                                 finish_reason=rng.choice([None, None, FinishReason.EOS])))
            for _ in range(rng.randrange(0, 30) if requests else 0)]


@pytest.mark.parametrize("seed", range(50))
def test_put_outputs_and_note_token_times_equal_python(seed):
    pairs = _pairs(random.Random(seed))
    got = []
    for request, _ in pairs:
        request.outputs = types.SimpleNamespace(put_nowait=lambda o, r=request: got.append((r, o)))
    finished = step_outputs.put_outputs(pairs)
    assert got == pairs
    assert finished == [p for p in pairs if p[1].finish_reason is not None]

    times = {id(r): 1.0 for r, _ in pairs[::2]}
    py_times, gaps, py_gaps, num, py_finished = dict(times), [], [], 0, []
    for request, output in pairs:  # metrics.on_outputs' loop as it was
        key = id(request)
        if output.token_ids:
            num += len(output.token_ids)
            if py_times.get(key) is not None:
                py_gaps.append(3.0 - py_times[key])
            py_times[key] = 3.0
        if output.finish_reason is not None:
            py_times.pop(key, None)
            py_finished.append((request, output))
    assert step_outputs.note_token_times(pairs, times, 3.0, gaps) == (num, py_finished)
    assert (times, gaps) == (py_times, py_gaps)


def test_batch_sink_appends_to_the_shared_batch():
    batch, firsts, finals = [], [], []
    sinks = [step_outputs.BatchSink(key, batch, lambda: firsts.append(len(batch)), finals.append)
             for key in ("a", "b")]
    plain, last = RequestOutput(token_ids=[3], text=""), RequestOutput([], "", FinishReason.STOP)
    sinks[0].put_nowait(plain)
    sinks[1].put_nowait(last)
    sinks[0].put_nowait(plain)
    assert batch == [("a", plain), ("b", last), ("a", plain)]
    assert firsts == [0] and finals == ["b"] and sinks[1].key == "b"
    batch.clear()  # the owner sent it: the next output is a step's first again
    sinks[1].put_nowait(plain)
    assert firsts == [0, 0] and batch == [("b", plain)]
    with pytest.raises(TypeError):
        step_outputs.BatchSink("c", None, None, None)


@pytest.mark.parametrize("seed", range(50))
def test_compact_outputs_round_trip(seed):
    """A step message's batch, compacted, pickled and expanded, is the batch (field by field,
    dataclass equality); only outputs of token ids alone travel as their id or ids."""
    import pickle

    from scheduler_service.core.request import TokenLogprob, Usage
    rng = random.Random(seed)
    batch = []
    for i in range(rng.randrange(0, 40)):
        fields = dict(token_ids=[rng.randrange(100) for _ in range(rng.randrange(0, 3))], text="")
        for name, value in [("text", "é"), ("finish_reason", FinishReason.LENGTH), ("stop_match", 5),
                            ("stop_match", "x"), ("usage", Usage(1, 2, 0, 3, 4)), ("index", 1),
                            ("logprobs", [TokenLogprob(3, -0.5)]), ("prompt_logprobs", [])]:
            if rng.random() < 0.08:
                fields[name] = value
        batch.append((f"r{i}", RequestOutput(**fields)))
    compact = step_outputs.compact_outputs(batch)
    plain = [p for p in batch if p[1] == RequestOutput(p[1].token_ids, "")]
    assert compact[::2] == [key for key, _ in batch]  # flat: key, value, key, value ...
    values = compact[1::2]
    assert sum(type(value) in (int, list) for value in values) == len(plain)
    assert [v for v in values if type(v) is int] == [
        p[1].token_ids[0] for p in plain if len(p[1].token_ids) == 1]
    expanded = step_outputs.expand_outputs(pickle.loads(pickle.dumps(compact, protocol=5)), RequestOutput)
    assert expanded == batch
    assert all(type(output) is RequestOutput for _, output in expanded)
    if compact:
        with pytest.raises(ValueError, match="keys and values come in pairs"):
            step_outputs.expand_outputs(compact[:-1], RequestOutput)
