"""The model service's decode fast path, in C loops (Python view: decode_step.pyi; no C callers).

A plain decode plan (slots, token counts and new blocks only) is read, checked and applied here,
and its result written, without a Python operation per row:

    parse_decode_request ExecuteRequest (or parse_decode_plan: BatchPlan) wire bytes -> step_id
                         and four int64 arrays, with batch.py's stateless checks (lengths, id
                         ranges, >= 1 token, no slot twice)
    check_decode         slot_checks.py's checks against the slot table, then the new block ids
                         appended to the block tables (runner._apply_diff's block part)
    advance              after the forward: computed counts, the sampled tokens appended
                         (runner._step's slot-table update, any plan)
    encode_result        a StepResult without logprobs -> ExecuteResponse wire bytes

Each answers "not mine" (None, or CHECK_FAILED with nothing changed) instead of raising: the
caller then runs the Python path on the same plan, which names the field and the bound (one
wording of every error, the Python one). What the fast path covers is whatever parse_decode_plan
accepts; anything else in a plan (new sequences, drops, copies, swaps, masks) sends it to Python.
"""
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free as c_free, malloc
from libc.string cimport memcpy

from cython_ext.wire cimport put_varint

import numpy as np

cdef enum:
    # check_decode's answers.
    C_FAILED = -1  # a check failed; nothing was changed
    C_CHECKED = 0  # applied; some scheduled slot samples with more than a plain argmax
    C_GREEDY = 1  # applied; every scheduled slot is greedy with no processing or logprobs

CHECK_FAILED = C_FAILED
CHECKED = C_CHECKED
CHECKED_GREEDY = C_GREEDY
cdef uint64_t UINT32_MAX = 0xFFFFFFFFu

# BatchPlan field numbers (protos/planserve/v1/engine.proto) the fast path reads.
cdef enum:
    F_STEP_ID = 1
    F_SLOTS = 3  # then num_scheduled_tokens 4, num_new_blocks 5
    F_NEW_BLOCK_IDS = 6
    F_EXTENSION = 15  # bytes from_pb ignores


cdef inline const uint8_t* _varint(const uint8_t* p, const uint8_t* end, uint64_t* out) noexcept nogil:
    """Reads one varint at p; NULL past `end` or beyond 10 bytes."""
    cdef uint64_t value = 0
    cdef int shift = 0
    while p < end and shift < 70:
        value |= (<uint64_t>(p[0] & 0x7F)) << shift
        if p[0] < 0x80:
            out[0] = value
            return p + 1
        p += 1
        shift += 7
    return NULL


cdef int _scan(const uint8_t* p, const uint8_t* end, uint64_t* step_id, Py_ssize_t* counts,
               int64_t** outs) noexcept nogil:
    """One pass over a BatchPlan's fields: counts the values of fields 3-6 (outs NULL) or writes
    them (outs[i] for field 3 + i, each big enough). 0, or -1 for anything the fast path leaves
    to Python: another field, a value above uint32, a wire type protobuf would not write."""
    cdef uint64_t key, value, length
    cdef uint32_t field, wire
    cdef const uint8_t* stop
    cdef int k
    while p < end:
        p = _varint(p, end, &key)
        if p == NULL:
            return -1
        field, wire = <uint32_t>(key >> 3), <uint32_t>(key & 7)
        if field == F_STEP_ID and wire == 0:
            p = _varint(p, end, step_id)
            if p == NULL:
                return -1
            continue
        if wire != 2 and not (F_SLOTS <= field <= F_NEW_BLOCK_IDS and wire == 0):
            return -1
        if wire == 0:  # one unpacked value
            stop = p
            length = 0
        else:
            p = _varint(p, end, &length)
            if p == NULL or length > <uint64_t>(end - p):
                return -1
            stop = p + length
        if field == F_EXTENSION or (wire == 2 and length == 0):
            p = stop
            continue
        if not F_SLOTS <= field <= F_NEW_BLOCK_IDS:
            return -1
        k = field - F_SLOTS
        while True:
            p = _varint(p, end, &value)
            if p == NULL or value > UINT32_MAX:
                return -1
            if outs != NULL:
                outs[k][counts[k]] = <int64_t>value
            counts[k] += 1
            if p >= stop:
                break
        if p != stop and wire == 2:
            return -1
    return 0


cdef bint _valid(const int64_t* slots, const int64_t* num_scheduled, const int64_t* num_new_blocks,
                 const int64_t* new_block_ids, Py_ssize_t n, Py_ssize_t num_ids, int64_t max_num_slots,
                 int64_t num_kv_blocks, uint8_t* seen) noexcept nogil:
    """batch.from_pb's checks of these four fields (seen: max_num_slots zeroed bytes)."""
    cdef Py_ssize_t i
    cdef int64_t total = 0
    for i in range(n):
        if slots[i] >= max_num_slots or seen[slots[i]] or num_scheduled[i] < 1:
            return False
        seen[slots[i]] = 1
        total += num_new_blocks[i]
    if total != num_ids:
        return False
    for i in range(num_ids):
        if new_block_ids[i] < 1 or new_block_ids[i] >= num_kv_blocks:  # block 0 is reserved
            return False
    return True


def parse_decode_plan(bytes wire, int64_t max_num_slots, int64_t num_kv_blocks):
    """A BatchPlan's wire bytes -> (step_id, slots, num_scheduled_tokens, num_new_blocks,
    new_block_ids), int64 arrays, when the plan holds nothing but those (and `extension`),
    schedules at least one slot and passes batch.from_pb's checks of them; else None."""
    cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(wire)
    return _parse(p, p + len(wire), max_num_slots, num_kv_blocks)


def parse_decode_request(bytes wire, int64_t max_num_slots, int64_t num_kv_blocks):
    """parse_decode_plan of an ExecuteRequest's wire bytes: None unless they hold the plan alone
    (field 1, once)."""
    cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(wire)
    cdef const uint8_t* end = p + len(wire)
    cdef uint64_t key, length
    p = _varint(p, end, &key)
    if p == NULL or key != ((1 << 3) | 2):
        return None
    p = _varint(p, end, &length)
    if p == NULL or length != <uint64_t>(end - p):  # anything after the plan: Python's to read
        return None
    return _parse(p, end, max_num_slots, num_kv_blocks)


cdef object _parse(const uint8_t* p, const uint8_t* end, int64_t max_num_slots,
                   int64_t num_kv_blocks):
    cdef uint64_t step_id = 0
    cdef Py_ssize_t counts[4]
    cdef int64_t* outs[4]
    cdef int64_t[::1] view
    cdef uint8_t* seen
    cdef bint ok
    cdef int k
    counts[:] = [0, 0, 0, 0]
    if _scan(p, end, &step_id, counts, NULL) != 0:
        return None
    n = counts[0]
    if n == 0 or counts[1] != n or counts[2] != n:
        return None
    arrays = [np.empty(counts[k], dtype=np.int64) for k in range(4)]
    for k in range(4):
        view = arrays[k]
        outs[k] = &view[0] if counts[k] else NULL
        counts[k] = 0
    _scan(p, end, &step_id, counts, outs)  # the same bytes: cannot fail now
    seen = <uint8_t*>calloc(max_num_slots if max_num_slots > 0 else 1, 1)
    if seen == NULL:
        raise MemoryError("cannot allocate the slot marks")
    ok = _valid(outs[0], outs[1], outs[2], outs[3], n, counts[3], max_num_slots, num_kv_blocks,
                seen)
    c_free(seen)
    if not ok:
        return None
    return step_id, arrays[0], arrays[1], arrays[2], arrays[3]


@cython.boundscheck(False)
cdef int _check(const int64_t[::1] slots, const int64_t[::1] num_scheduled,
                const int64_t[::1] num_new_blocks, const uint8_t[::1] active,
                const int64_t[::1] num_tokens, const int64_t[::1] num_computed,
                const int64_t[::1] num_blocks, Py_ssize_t max_blocks, int64_t max_model_len,
                int64_t block_size) noexcept nogil:
    """slot_checks.check_plan for a plan that drops and registers nothing, speculation off."""
    cdef Py_ssize_t i
    cdef int64_t s, end, blocks
    for i in range(slots.shape[0]):
        s = slots[i]
        if not active[s]:
            return C_FAILED
        end = num_computed[s] + num_scheduled[i]
        if end > num_tokens[s] or end > max_model_len:
            return C_FAILED
        blocks = num_blocks[s] + num_new_blocks[i]
        if blocks * block_size < end or blocks > max_blocks:
            return C_FAILED
    return C_CHECKED


def check_decode(table, const int64_t[::1] slots, const int64_t[::1] num_scheduled,
                 const int64_t[::1] num_new_blocks, const int64_t[::1] new_block_ids,
                 int64_t max_model_len, int64_t block_size):
    """Checks a parsed decode plan against `table` (a slot_table.SlotTable; the slots, lengths
    and ids already passed parse_decode_plan) and, if it passes, appends each slot's new block
    ids after its current blocks. CHECK_FAILED with the table unchanged; else CHECKED, or
    CHECKED_GREEDY when no scheduled slot draws, changes its logits or asks for logprobs."""
    cdef int32_t[:, ::1] block_table = table.block_table
    cdef int64_t[::1] num_blocks = table.num_blocks
    cdef const float[::1] temperature = table.temperature
    cdef const uint8_t[::1] changes_logits = table.changes_logits.view(np.uint8)
    cdef const int64_t[::1] num_logprobs = table.num_logprobs
    cdef const int64_t[::1] num_prompt_logprobs = table.num_prompt_logprobs
    cdef Py_ssize_t i, j, first = 0
    cdef int64_t s
    cdef int answer = C_GREEDY
    if _check(slots, num_scheduled, num_new_blocks, table.active.view(np.uint8), table.num_tokens,
              table.num_computed, num_blocks, block_table.shape[1], max_model_len,
              block_size) != C_CHECKED:
        return C_FAILED
    for i in range(slots.shape[0]):
        s = slots[i]
        for j in range(num_new_blocks[i]):
            block_table[s, num_blocks[s] + j] = <int32_t>new_block_ids[first + j]
        first += num_new_blocks[i]
        num_blocks[s] += num_new_blocks[i]
        if (temperature[s] > 0 or changes_logits[s] or num_logprobs[s] >= 0
                or num_prompt_logprobs[s] >= 0):
            answer = C_CHECKED
    return answer


def advance(table, const int64_t[::1] slots, const int64_t[::1] context_lens,
            const int64_t[::1] sample_slots, const int64_t[::1] sampled_token_ids):
    """The slot table after a step: num_computed[slots] = context_lens, then each sample slot's
    token appended (tokens[s, num_tokens[s]] = the token, num_tokens[s] += 1). ValueError, with
    nothing changed, for mismatched lengths, a slot outside the table or a full token row."""
    cdef int32_t[:, ::1] tokens = table.tokens
    cdef int64_t[::1] num_tokens = table.num_tokens
    cdef int64_t[::1] num_computed = table.num_computed
    cdef Py_ssize_t i, num_slots = num_tokens.shape[0]
    cdef int64_t s
    if slots.shape[0] != context_lens.shape[0] or sample_slots.shape[0] != sampled_token_ids.shape[0]:
        raise ValueError("advance: mismatched lengths")
    for i in range(slots.shape[0]):
        if not 0 <= slots[i] < num_slots:
            raise ValueError(f"advance: slot {slots[i]} outside the table")
    for i in range(sample_slots.shape[0]):
        s = sample_slots[i]
        if not 0 <= s < num_slots or not 0 <= num_tokens[s] < tokens.shape[1]:
            raise ValueError(f"advance: no room for a token in slot {s}")
    for i in range(slots.shape[0]):
        num_computed[slots[i]] = context_lens[i]
    for i in range(sample_slots.shape[0]):
        s = sample_slots[i]
        tokens[s, num_tokens[s]] = <int32_t>sampled_token_ids[i]
        num_tokens[s] += 1


cdef inline uint8_t* _put_scalar(uint8_t* p, uint32_t field, uint64_t v) noexcept nogil:
    if v == 0:  # proto3 writes no default
        return p
    p = put_varint(p, field << 3)
    return put_varint(p, v)


cdef uint8_t* _put_packed(uint8_t* p, uint32_t field, const int64_t[::1] values) noexcept nogil:
    cdef Py_ssize_t i, n = values.shape[0]
    cdef uint64_t size = 0, v
    if n == 0:
        return p
    for i in range(n):
        v = <uint64_t>values[i]
        size += 1
        while v >= 0x80:
            size += 1
            v >>= 7
    p = put_varint(p, (field << 3) | 2)
    p = put_varint(p, size)
    for i in range(n):
        p = put_varint(p, <uint64_t>values[i])
    return p


cdef bint _uint32s(const int64_t[::1] values) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(values.shape[0]):
        if values[i] < 0 or <uint64_t>values[i] > UINT32_MAX:
            return False
    return True


def encode_result(uint64_t step_id, const int64_t[::1] num_sampled_tokens,
                  const int64_t[::1] sampled_token_ids, uint64_t forward_ns, uint64_t sample_ns,
                  uint64_t total_ns, uint32_t num_draft_tokens, uint32_t num_accepted_draft_tokens):
    """An ExecuteResponse whose StepResult holds these fields (no logprobs), as wire bytes: what
    batch.result_to_pb's message serializes to. ValueError for an id outside uint32."""
    if not (_uint32s(num_sampled_tokens) and _uint32s(sampled_token_ids)):
        raise ValueError("a StepResult count or token id is outside uint32")
    # Each value <= 5 bytes; each tag and length <= 10; 8 fields and the outer header.
    cdef Py_ssize_t room = 5 * (num_sampled_tokens.shape[0] + sampled_token_ids.shape[0]) + 200
    cdef uint8_t* inner = <uint8_t*>malloc(room)
    cdef uint8_t* p
    cdef uint8_t header[16]
    cdef uint8_t* h
    cdef uint8_t* dst
    cdef Py_ssize_t head
    if inner == NULL:
        raise MemoryError("cannot allocate a result buffer")
    try:
        p = _put_scalar(inner, 1, step_id)
        p = _put_packed(p, 2, num_sampled_tokens)
        p = _put_packed(p, 3, sampled_token_ids)
        p = _put_scalar(p, 6, forward_ns)
        p = _put_scalar(p, 7, sample_ns)
        p = _put_scalar(p, 8, total_ns)
        p = _put_scalar(p, 11, num_draft_tokens)
        p = _put_scalar(p, 12, num_accepted_draft_tokens)
        h = put_varint(header, (1 << 3) | 2)  # ExecuteResponse.result
        h = put_varint(h, <uint64_t>(p - inner))
        head = h - header
        out = PyBytes_FromStringAndSize(NULL, head + (p - inner))
        dst = <uint8_t*>PyBytes_AS_STRING(out)
        memcpy(dst, header, head)
        memcpy(dst + head, inner, p - inner)
        return out
    finally:
        c_free(inner)
