"""A step's sampled tokens taken into their requests, the common case in C (core/overlap.py
reconcile): one token for a sequence that it does not stop, with no logprobs, no grammar, no stop
strings and no samples left to fork. At 256 running sequences that is nearly every entry of
every decode step, and the interpreted path (reconcile -> Scheduler._take_tokens ->
OutputProcessor.take_tokens -> _accept -> _check_stop) was a dozen Python calls a sequence.

Any other entry goes to `slow(index, offset, count)`, the interpreted path, in its turn (it
returns the entry's output, or None): the
entries are taken in plan order either way, so the step's outputs come out in the same order and
a logprob reader (read by the slow entries only: a plain entry has no logprobs) stays in step.
A token that would stop its sequence (eos, a stop id, max_new_tokens, the model's length) is
seen before anything is changed and goes to `slow` whole, so finishing, its release and its
final output stay in one place.

What a request's entry is checked against that never changes once it runs (its logprobs, grammar,
stop rules, prompt length, sample index and chunk size; Request.plain_facts says why they do not)
is read once and kept on the request as a tuple (`_plain_facts`): at a thousand running sequences
the twenty-odd attribute reads a sequence a step, each a cache miss, were most of this loop's
time (docs/benchmarks.md). Each step reads the tuple and what does change (finish_reason, slot,
forked).

tests/scheduler/test_step_outputs.py holds the pure-Python statement of the same rule and checks
this against it and against the interpreted path on random steps.
"""

# The tuple's items (_plain_facts).
cdef enum:
    F_EOS = 0           # the eos ids it was made with (a replica of another model makes it again)
    F_MAX_LEN = 1       # the max_model_len it was made with
    F_PLAIN = 2         # no logprobs of either kind, no grammar, no stop strings
    F_STOP_IDS = 3      # ids that end it: its stop ids, and eos unless it ignores eos
    F_MAX_OUT = 4       # the output length it ends at: max_new_tokens, or the model's length
    F_INTERVAL = 5      # stream_interval
    F_INDEX = 6         # its sample's index
    F_REQUEST_ID = 7


def take_plain_tokens(list requests, list sampled, list counts, live, dict placeholders,
                      core, dict held, dict detokenizers, no_text, output_type,
                      Py_ssize_t max_model_len, eos_token_ids, double now, slow, list outputs):
    """Takes every plain entry of a step's result (see the module doc) and hands each other one
    to `slow`.

    requests, counts: parallel to the plan's entries; sampled: the flat token ids, `counts[i]`
    of them for entry i. live: the entries whose sequence still holds the slot it was planned
    in; placeholders: entry -> the index overlap's commit reserved for its token (None: a
    constrained sequence's). core: the StepCore (set_token). held, detokenizers:
    the OutputProcessor's, by request id (`no_text`: the detokenizer of a request whose text is
    made elsewhere). output_type: RequestOutput. slow(index, offset, count) returns an entry's
    output or None. Outputs, (request, output), go to `outputs`.
    """
    cdef Py_ssize_t index, count, offset = 0, num_out, n = len(counts)
    cdef object request, token, placeholder, out_ids, request_id, output, detokenizer, slot
    cdef tuple facts
    if n > len(requests):
        raise ValueError(f"{n} counts for {len(requests)} entries")
    for index in range(n):
        count = counts[index]
        if count == 0:
            continue
        if count < 0 or offset + count > len(sampled):
            raise ValueError(f"entry {index}: {count} tokens at {offset} of {len(sampled)}")
        request = requests[index]
        placeholder = placeholders.get(index) if index in live else None
        if count != 1 or placeholder is None:
            _take_slow(slow, request, index, offset, count, outputs)
            offset += count
            continue
        facts = request.plain_facts
        if (facts is None or facts[F_EOS] is not eos_token_ids
                or <Py_ssize_t>facts[F_MAX_LEN] != max_model_len):
            facts = _plain_facts(request, eos_token_ids, max_model_len)
            request.plain_facts = facts
        slot = request.slot
        if (not facts[F_PLAIN] or request.finish_reason is not None or slot is None
                or not (request.forked or request.n == 1)):
            _take_slow(slow, request, index, offset, count, outputs)
            offset += count
            continue
        token = sampled[offset]
        out_ids = request.output_token_ids
        num_out = len(out_ids) + 1
        if token in facts[F_STOP_IDS] or num_out >= <Py_ssize_t>facts[F_MAX_OUT]:
            _take_slow(slow, request, index, offset, 1, outputs)  # it stops here
            offset += 1
            continue
        offset += 1
        if request.first_token_time is None:
            request.first_token_time = now
        out_ids.append(token)
        request_id = facts[F_REQUEST_ID]
        detokenizer = detokenizers[request_id]
        if detokenizer is not no_text:
            detokenizer.add_token(token)
        core.set_token(slot, placeholder, token)
        output = held.pop(request_id, None)
        if output is None:
            output = output_type([token], "", None, None, None, facts[F_INDEX])
        else:
            output.token_ids.append(token)
        if len(output.token_ids) < <Py_ssize_t>facts[F_INTERVAL]:
            held[request_id] = output
            continue
        if detokenizer is not no_text:
            output.text = detokenizer.take_text(False)
        outputs.append((request, output))


cdef inline int _take_slow(object slow, object request, Py_ssize_t index, Py_ssize_t offset,
                           Py_ssize_t count, list outputs) except -1:
    output = slow(index, offset, count)
    if output is not None:
        outputs.append((request, output))
    return 0


cdef tuple _plain_facts(object request, object eos_token_ids, Py_ssize_t max_model_len):
    """What take_plain_tokens checks a request's entries against that stays as it is while the
    request runs (the F_* items). Plain: no logprobs (of its tokens, or of its prompt with the
    first), no grammar, no stop strings (they need the text); whether it has ended, holds its
    slot and has its samples forked is read each step."""
    stopping = request.stopping
    plain = (request.logprobs is None
             and request.prompt_logprobs is None
             and request.guide is None
             and not stopping.stop_strings)
    stop_ids = stopping.stop_token_ids
    if not stopping.ignore_eos:
        stop_ids = frozenset(stop_ids).union(eos_token_ids) if stop_ids else eos_token_ids
    max_out = min(<Py_ssize_t>stopping.max_new_tokens,
                  max_model_len - <Py_ssize_t>len(request.prompt_token_ids))
    return (eos_token_ids, max_model_len, plain, stop_ids, max_out, request.stream_interval,
            request.index, request.request_id)


def put_outputs(list outputs):
    """Each (request, output) of a step into its request's sink (`request.outputs.put_nowait`),
    in order; returns the pairs whose output is its sample's last (finish_reason set)."""
    cdef list finished = []
    cdef object pair, output
    for pair in outputs:
        output = (<tuple>pair)[1]
        (<tuple>pair)[0].outputs.put_nowait(output)
        if output.finish_reason is not None:
            finished.append(pair)
    return finished


def note_token_times(list outputs, dict last_token_time, double now, list gaps):
    """A step's outputs as the inter-token histogram sees them: for each output with tokens,
    the gap since its request's previous one (appended to `gaps`; none for its first) and
    `now` as its request's time (keyed by id(request)); a finished output's request is
    forgotten. Returns (number of tokens, the finished pairs)."""
    cdef Py_ssize_t num_tokens = 0, num
    cdef list finished = []
    cdef object pair, output, key, last
    for pair in outputs:
        output = (<tuple>pair)[1]
        key = id((<tuple>pair)[0])
        num = len(output.token_ids)
        if num:
            num_tokens += num
            last = last_token_time.get(key)
            if last is not None:
                gaps.append(now - <double>last)
            last_token_time[key] = now
        if output.finish_reason is not None:
            last_token_time.pop(key, None)
            finished.append(pair)
    return num_tokens, finished


cdef class BatchSink:
    """A request's outputs sink that appends `(key, output)` to a batch it shares with other
    requests (a frontend's step message, frontends/hub.py): a C call an output where a Python
    sink was a frame or two. `on_first()` runs when an output finds the batch empty (the step's
    first: the owner schedules the batch's flush, and clears the batch in place once sent);
    `on_final(key)` after an output that is its sample's last."""

    cdef readonly object key
    cdef list batch
    cdef object on_first
    cdef object on_final

    def __init__(self, key, list batch not None, on_first, on_final):
        self.key = key
        self.batch = batch
        self.on_first = on_first
        self.on_final = on_final

    def put_nowait(self, output):
        if not self.batch:
            self.on_first()
        self.batch.append((self.key, output))
        if output.finish_reason is not None:
            self.on_final(self.key)


def compact_outputs(list batch):
    """A frontend's step batch for its message, flat: each `(key, output)` as two items, the key
    and then the output's one token id (an int), its token ids (a list) when it is token ids and
    nothing else (no text, no end, sample 0, no logprobs: most outputs of most steps), or the
    output as it is. A flat list of strings and ints pickles in a fifth of the time of a list of
    pairs (no tuple, and no list for one token). expand_outputs undoes it."""
    cdef list compact = []
    cdef object pair, output, token_ids
    for pair in batch:
        output = (<tuple>pair)[1]
        compact.append((<tuple>pair)[0])
        if (output.finish_reason is None and output.index == 0 and not output.text
                and output.logprobs is None and output.prompt_logprobs is None
                and output.stop_match is None and output.usage is None):
            token_ids = output.token_ids
            if len(token_ids) == 1 and type(token_ids[0]) is int:
                compact.append(token_ids[0])
            else:
                compact.append(token_ids)
        else:
            compact.append(output)
    return compact


def expand_outputs(list compact, output_type):
    """compact_outputs undone: `key, token_id` and `key, token_ids` become `(key,
    output_type(token_ids, ""))`, `key, output` becomes `(key, output)`."""
    cdef list batch = []
    cdef object key, value
    cdef Py_ssize_t i, n = len(compact)
    if n % 2:
        raise ValueError(f"a step batch of {n} items: keys and values come in pairs")
    for i in range(0, n, 2):
        key = compact[i]
        value = compact[i + 1]
        if type(value) is int:
            batch.append((key, output_type([value], "")))
        elif type(value) is list:
            batch.append((key, output_type(value, "")))
        else:
            batch.append((key, value))
    return batch
