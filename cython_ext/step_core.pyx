# distutils: language = c++
"""The scheduler's per-step hot path (contract: step_core.pxd, Python view: step_core.pyi).

scheduler_service/core/scheduler.py keeps the orchestration (Request lifecycle, the waiting queue and
its policy, outputs, aborts, deadlines) and calls in here for everything that is a loop over
running sequences. A step, as the Scheduler drives it:

    begin_step(step_id, tokens, seqs)    budget reset, plan buffers emptied
    schedule_running(phase)              running slots in admission order (one or two passes,
                                         by chunking mode): chunk, blocks, allocate, write entry;
                                         calls back into Python only when blocks run out
    admit(...) + schedule_admitted(...)  per waiting request the Python loop admits
    fork(...)                            (update) a parallel sample sharing its parent's prompt
    end_step()                           -> the plan's lists, its PackedPlan, its requests
    advance(packed, num_sampled)         (update) computed counts, prefix hashes of full blocks

Per-slot state (SlotState) and the plan buffers are allocated once; a step allocates only the
plan's own objects. The core is the one owner of a running sequence's computed count and block
table: while a Request holds a slot it is bound to that slot's SlotView (admit, fork) and its
`num_computed_tokens` and `block_ids` read the SlotState through it; release unbinds it and leaves
the last count on the Request (scheduler_service/core/request.py).

Plan entry layout (all uint32, one entry per scheduled sequence, in scheduling order):

    entry i      slots[i]  num_scheduled_tokens[i]  num_new_blocks[i]  epochs[i]
    block ids    new_block_ids[sum(num_new_blocks[:i]) : sum(num_new_blocks[:i + 1])]
                 (a sequence's first entry sends its whole table, shared blocks first)
"""
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free as c_free, malloc, realloc
from libc.string cimport memcpy, memmove

from cython_ext.block_pool cimport BlockPool, Digest, digest_from_int, digest_to_int, hash_block
from cython_ext.wire cimport put_varint

PHASE_ALL = 0        # every running sequence (interleaved)
PHASE_PREFILLS = 1   # only those with more than one token to compute
PHASE_DECODES = 2    # only those with exactly one token to compute


cdef inline int64_t _cdiv(int64_t a, int64_t b) noexcept nogil:
    # a >= 0, b > 0 (cdivision: C's / truncates, so -(-a // b) would not round up)
    return (a + b - 1) // b


cdef inline int64_t _min(int64_t a, int64_t b) noexcept nogil:
    return a if a < b else b


cdef inline uint8_t* _put_packed(uint8_t* p, uint32_t field, const uint32_t* values,
                                 Py_ssize_t n) noexcept nogil:
    # A packed repeated uint32 field; nothing for an empty one (as protobuf writes it).
    cdef Py_ssize_t i
    cdef uint64_t size = 0
    cdef uint32_t v
    if n == 0:
        return p
    for i in range(n):
        v = values[i]
        size += 1
        while v >= 0x80:
            size += 1
            v >>= 7
    p = put_varint(p, (field << 3) | 2)
    p = put_varint(p, size)
    for i in range(n):
        p = put_varint(p, values[i])
    return p


def packed_uint32_field(uint32_t field, values):
    """A packed repeated uint32 protobuf field (`field`, then its length, then the varints) of
    `values`, b"" for none, as protobuf writes it: `Message.MergeFromString` sets the field.
    What plan.to_pb hands a NewSequence's token ids through (thousands per admitted prompt),
    instead of protobuf converting a Python list one int at a time. OverflowError outside
    uint32; a list is read item by item without the generic indexing call."""
    if not 1 <= field < (1 << 29):
        raise ValueError(f"protobuf field numbers are in [1, 2**29), got {field}")
    cdef Py_ssize_t i, n = len(values)
    cdef list as_list
    cdef uint32_t* buf = <uint32_t*>malloc((n + 1) * sizeof(uint32_t))
    cdef uint8_t* wire
    cdef uint8_t* end
    if buf == NULL:
        raise MemoryError("cannot allocate a token buffer")
    try:
        if type(values) is list:
            as_list = <list>values
            for i in range(n):
                buf[i] = as_list[i]
        else:
            for i in range(n):
                buf[i] = values[i]
        # tag (<= 5 bytes) + length (<= 10) + at most 5 bytes a value
        wire = <uint8_t*>malloc(15 + 5 * n)
        if wire == NULL:
            raise MemoryError("cannot allocate a wire buffer")
        try:
            end = _put_packed(wire, field, buf, n)
            return PyBytes_FromStringAndSize(<char*>wire, end - wire)
        finally:
            c_free(wire)
    finally:
        c_free(buf)


cdef class SlotView:
    """A slot's computed count and block table as a Request reads them while it holds the slot
    (Request.slot_view). Read-only: they change only through the core."""

    @property
    def num_computed_tokens(self):
        return self.core._slots[self.slot].num_computed_tokens

    @property
    def block_ids(self):
        """The block table (a new list)."""
        cdef SlotState* s = &self.core._slots[self.slot]
        cdef int32_t i
        return [s.block_ids[i] for i in range(s.num_blocks)]


cdef class PackedPlan:
    """The packed arrays of one plan (C copies, owned here) and their protobuf encoding."""

    def __dealloc__(self):
        c_free(self.slots)  # one allocation holds every array

    def arrays(self):
        """(slots, num_scheduled_tokens, num_new_blocks, new_block_ids) as lists (debugging)."""
        return ([self.slots[i] for i in range(self.num_entries)],
                [self.num_scheduled_tokens[i] for i in range(self.num_entries)],
                [self.num_new_blocks[i] for i in range(self.num_entries)],
                [self.new_block_ids[i] for i in range(self.num_block_ids)])


cdef class StepCore:
    """Per-slot running state and the per-step loops over it. Not thread safe."""

    def __cinit__(self, BlockPool pool not None, int32_t block_size, int32_t max_num_slots,
                  int64_t max_prefill_chunk=0, int64_t decode_reserve_tokens=0,
                  bint enable_prefix_caching=True, on_blocks_exhausted=None,
                  on_scheduled=None):
        if block_size < 1 or max_num_slots < 1:
            raise ValueError(f"block_size and max_num_slots must be >= 1, got {block_size} and "
                             f"{max_num_slots}")
        self.pool = pool
        self.block_size = block_size
        self.max_num_slots = max_num_slots
        self.max_prefill_chunk = max_prefill_chunk
        self.decode_reserve_tokens = decode_reserve_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self._on_blocks_exhausted = on_blocks_exhausted
        self._on_scheduled = on_scheduled
        self._requests = [None] * max_num_slots
        cdef Py_ssize_t i, n = max_num_slots
        cdef SlotView view
        views = []
        for i in range(n):
            view = SlotView.__new__(SlotView)
            view.core = self
            view.slot = <int32_t>i
            views.append(view)
        self._views = tuple(views)
        self._slots = <SlotState*>calloc(n, sizeof(SlotState))
        self._running = <int32_t*>malloc(n * sizeof(int32_t))
        self._snap = <int32_t*>malloc(n * sizeof(int32_t))
        self._snap_epochs = <uint32_t*>malloc(n * sizeof(uint32_t))
        self._out_slots = <uint32_t*>malloc(n * sizeof(uint32_t))
        self._out_num_scheduled = <uint32_t*>malloc(n * sizeof(uint32_t))
        self._out_num_new_blocks = <uint32_t*>malloc(n * sizeof(uint32_t))
        self._out_epochs = <uint32_t*>malloc(n * sizeof(uint32_t))
        self._nb_cap = 4 * n
        self._out_block_ids = <uint32_t*>malloc(self._nb_cap * sizeof(uint32_t))
        self._wire_cap = 0
        self._wire = NULL
        if not (self._slots and self._running and self._snap and self._snap_epochs
                and self._out_slots and self._out_num_scheduled and self._out_num_new_blocks
                and self._out_epochs and self._out_block_ids):
            raise MemoryError(f"cannot allocate step core arrays for {n} slots")
        for i in range(n):
            self._slots[i].scheduled_step = -1

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self._slots:
            for i in range(self.max_num_slots):
                c_free(self._slots[i].block_ids)
                c_free(self._slots[i].block_hashes)
                c_free(self._slots[i].token_ids)
        c_free(self._slots)
        c_free(self._running)
        c_free(self._snap)
        c_free(self._snap_epochs)
        c_free(self._out_slots)
        c_free(self._out_num_scheduled)
        c_free(self._out_num_new_blocks)
        c_free(self._out_epochs)
        c_free(self._out_block_ids)
        c_free(self._wire)

    # ---- helpers ------------------------------------------------------------------------------

    cdef bint _is_live(self, PackedPlan packed, Py_ssize_t i):
        # Entry i's sequence still holds its slot: not released since the plan was built (a
        # release bumps the epoch, so a new sequence in the same slot does not match either).
        cdef uint32_t slot = packed.slots[i]
        return self._slots[slot].epoch == packed.epochs[i] and self._requests[slot] is not None

    cdef int _bind(self, int32_t slot, object request) except -1:
        # The request now holds the slot: its counts and table are read from here.
        self._requests[slot] = request
        request.slot_view = self._views[slot]
        self._running[self.num_running] = slot
        self.num_running += 1
        return 0

    cdef SlotState* _state(self, int32_t slot) except NULL:
        if slot < 0 or slot >= self.max_num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.max_num_slots})")
        return &self._slots[slot]

    cdef int _reserve_slot_buffers(self, SlotState* s, int32_t num_blocks,
                                   int64_t num_tokens) except -1:
        cdef int32_t cap
        cdef int64_t tcap
        cdef void* p
        if num_blocks > s.blocks_cap:
            cap = s.blocks_cap * 2 if s.blocks_cap * 2 > num_blocks else num_blocks + 8
            p = realloc(s.block_ids, cap * sizeof(int32_t))
            if p == NULL:
                raise MemoryError("cannot grow a block table")
            s.block_ids = <int32_t*>p
            p = realloc(s.block_hashes, cap * sizeof(Digest))
            if p == NULL:
                raise MemoryError("cannot grow a block hash table")
            s.block_hashes = <Digest*>p
            s.blocks_cap = cap
        if num_tokens > s.tokens_cap:
            tcap = s.tokens_cap * 2 if s.tokens_cap * 2 > num_tokens else num_tokens + 64
            p = realloc(s.token_ids, tcap * sizeof(uint32_t))
            if p == NULL:
                raise MemoryError("cannot grow a token buffer")
            s.token_ids = <uint32_t*>p
            s.tokens_cap = tcap
        return 0

    cdef int64_t _chunk(self, int64_t num_tokens_to_compute) noexcept nogil:
        # A decode takes 1 token, a prompt its next chunk (1 chunk per step in decode-priority).
        if num_tokens_to_compute <= 1:
            return _min(num_tokens_to_compute, self.budget_tokens)
        if self.budget_prefill_chunks <= 0:
            return 0
        cdef int64_t cap = self.max_prefill_chunk if self.max_prefill_chunk > 0 else INT64_MAX
        return _min(_min(num_tokens_to_compute, self.budget_tokens), cap)

    cdef int64_t _reserve_blocks_of(self, SlotState* s, int64_t num_scheduled) noexcept nogil:
        # Blocks the sequence needs to grow decode_reserve_tokens past this step (capped by its
        # maximum length).
        cdef int64_t grown = _min(s.max_num_tokens, s.num_computed_tokens + num_scheduled
                                  + self.decode_reserve_tokens)
        cdef int64_t need = _cdiv(grown, self.block_size) - s.num_blocks
        return need if need > 0 else 0

    cdef int _schedule_slot(self, int32_t slot, int64_t num_new_tokens,
                            int64_t num_blocks) except -1:
        cdef SlotState* s = &self._slots[slot]
        cdef int32_t start, count, j
        if num_blocks > self.pool.num_free:
            raise MemoryError(f"slot {slot}: {num_blocks} blocks wanted, "
                              f"{self.pool.num_free} free")
        if num_blocks > 0:
            self._reserve_slot_buffers(s, s.num_blocks + <int32_t>num_blocks, 0)
            for j in range(<int32_t>num_blocks):
                s.block_ids[s.num_blocks] = self.pool._take_head()
                s.num_blocks += 1
        # A new sequence's block table starts empty on the model side: its first entry sends all
        # of it (prefix hits or blocks shared with a parent first); later ones what was appended.
        start = s.num_blocks_sent
        count = s.num_blocks - start
        s.num_blocks_sent = s.num_blocks
        if self._nb + count > self._nb_cap:
            self._grow_out_block_ids(self._nb + count)
        for j in range(count):
            self._out_block_ids[self._nb + j] = <uint32_t>s.block_ids[start + j]
        self._nb += count
        self._out_slots[self._n] = <uint32_t>slot
        self._out_num_scheduled[self._n] = <uint32_t>num_new_tokens
        self._out_num_new_blocks[self._n] = <uint32_t>count
        self._out_epochs[self._n] = s.epoch
        self._n += 1
        self.budget_tokens -= num_new_tokens
        self.budget_seqs -= 1
        if s.num_tokens - s.num_computed_tokens > 1:
            self.budget_prefill_chunks -= 1
        s.scheduled_step = self.step_id
        s.num_scheduled_tokens = num_new_tokens
        if self._on_scheduled is not None:
            self._on_scheduled(self._requests[slot], num_new_tokens)
        return 0

    cdef int _grow_out_block_ids(self, Py_ssize_t need) except -1:
        cdef Py_ssize_t cap = self._nb_cap * 2 if self._nb_cap * 2 > need else need
        cdef void* p = realloc(self._out_block_ids, cap * sizeof(uint32_t))
        if p == NULL:
            raise MemoryError("cannot grow the plan's block id buffer")
        self._out_block_ids = <uint32_t*>p
        self._nb_cap = cap
        return 0

    cdef int _cache_full_blocks(self, SlotState* s, int64_t num_real_tokens) except -1:
        # Registers every block full of computed tokens, hashed on its parent (BlockPool's
        # cache_block rule: the first block to register a hash keeps it).
        # Tokens computed but not yet appended (accepted drafts, until append_tokens) wait, and
        # so do those from `num_real_tokens` on (overlap's placeholders, ids not known yet).
        cdef int64_t num_full = _min(_min(s.num_computed_tokens, s.num_tokens),
                                     num_real_tokens) // self.block_size
        cdef int64_t index
        if num_full <= s.num_hashed:
            return 0
        for index in range(s.num_hashed, num_full):
            hash_block(&s.block_hashes[index - 1] if index > 0 else NULL, &s.salt,
                       &s.token_ids[index * self.block_size], self.block_size,
                       &s.block_hashes[index])
            # Logged for the KV-cache events when the pool records them (enable_events).
            self.pool._cache_logged(s.block_ids[index], &s.block_hashes[index],
                                    &s.block_hashes[index - 1] if index > 0 else NULL,
                                    &s.token_ids[index * self.block_size], self.block_size)
        s.num_hashed = <int32_t>num_full
        return 0

    cdef void _remove_running(self, int32_t slot) noexcept nogil:
        cdef int32_t i
        for i in range(self.num_running):
            if self._running[i] == slot:
                memmove(&self._running[i], &self._running[i + 1],
                        (self.num_running - i - 1) * sizeof(int32_t))
                self.num_running -= 1
                return

    cdef Py_ssize_t _encode_wire(self) except -1:
        cdef Py_ssize_t bound = 4 * 11 + 5 * (3 * self._n + self._nb)
        cdef void* p
        cdef uint8_t* end
        if bound > self._wire_cap:
            p = realloc(self._wire, bound)
            if p == NULL:
                raise MemoryError("cannot grow the wire buffer")
            self._wire = <uint8_t*>p
            self._wire_cap = bound
        end = _put_packed(self._wire, 3, self._out_slots, self._n)
        end = _put_packed(end, 4, self._out_num_scheduled, self._n)
        end = _put_packed(end, 5, self._out_num_new_blocks, self._n)
        end = _put_packed(end, 6, self._out_block_ids, self._nb)
        return end - self._wire

    # ---- sequences in and out -------------------------------------------------------------------

    def admit(self, int32_t slot, request, token_ids, int64_t num_computed_tokens, hits,
              int64_t max_num_tokens, salt, int32_t num_lookahead=0):
        """Starts the running sequence `request` in `slot`: its tokens, the prefix-cache hit blocks
        it shares (increfed here), appended to the running order. num_lookahead > 0: each of its
        decodes is granted that many draft tokens (speculation).

        `hits` are what BlockPool.match_prefix returned for these tokens and this salt, with
        nothing allocated in between (Scheduler._schedule_waiting): each is still cached, and the
        pool's digest of it is the one hashing its tokens here would give (a hit needs all 256
        bits equal). So the slot's chain takes those digests instead of hashing the prefix a
        second time; a hit without a digest (not from match_prefix) is hashed from its tokens."""
        cdef SlotState* s = self._state(slot)
        if self._requests[slot] is not None:
            raise ValueError(f"slot {slot} is already running a sequence")
        cdef Py_ssize_t i, n = len(token_ids), num_hits = len(hits)
        cdef int32_t b
        cdef Digest salt_digest
        cdef list token_list
        digest_from_int(salt, &salt_digest, "salt")
        if num_hits * self.block_size > n:
            raise ValueError(f"{num_hits} hit blocks of {self.block_size} tokens for "
                             f"{n} tokens")
        self._reserve_slot_buffers(s, <int32_t>num_hits, n)
        if type(token_ids) is list:  # the scheduler's case: items read without generic indexing
            token_list = <list>token_ids
            for i in range(n):
                s.token_ids[i] = token_list[i]
        else:
            for i in range(n):
                s.token_ids[i] = token_ids[i]
        for i in range(num_hits):
            self.pool._check_id(hits[i])
        s.num_tokens = n
        s.num_computed_tokens = num_computed_tokens
        s.max_num_tokens = max_num_tokens
        s.num_lookahead = num_lookahead
        s.salt = salt_digest
        s.num_blocks = 0
        s.num_hashed = 0
        s.scheduled_step = -1
        for i in range(num_hits):
            b = hits[i]
            self.pool._incref_one(b)
            s.block_ids[i] = b
            if self.pool._has_hash[b]:
                s.block_hashes[i] = self.pool._digest[b]
            else:
                hash_block(&s.block_hashes[i - 1] if i > 0 else NULL, &s.salt,
                           &s.token_ids[i * self.block_size], self.block_size, &s.block_hashes[i])
        s.num_blocks = <int32_t>num_hits
        s.num_blocks_sent = 0
        s.num_hashed = <int32_t>num_hits
        self._bind(slot, request)

    def fork(self, int32_t parent_slot, int32_t slot, request, int64_t num_prompt_tokens,
             int64_t max_num_tokens):
        """Starts `request` in `slot` as a parallel sample of the sequence in `parent_slot`,
        whose prompt (its first num_prompt_tokens tokens) is computed: the child shares every
        block of it (increfed) and computes the last prompt token again, to draw its own first
        token. The block that token lands in is copied when the parent already wrote earlier
        tokens into it (copy-on-write: the child's writes must not reach the parent's block).
        Returns (src, dst) of that copy, or None. MemoryError when the copy finds no free block.
        """
        cdef SlotState* parent = self._state(parent_slot)
        cdef SlotState* s = self._state(slot)
        if self._requests[parent_slot] is None:
            raise ValueError(f"slot {parent_slot} is not running")
        if self._requests[slot] is not None:
            raise ValueError(f"slot {slot} is already running a sequence")
        if not 0 < num_prompt_tokens <= parent.num_computed_tokens:
            raise ValueError(f"the parent has computed {parent.num_computed_tokens} tokens, "
                             f"not the whole prompt of {num_prompt_tokens}")
        cdef int64_t num_computed = num_prompt_tokens - 1
        cdef int32_t num_full = <int32_t>(num_computed // self.block_size)
        cdef bint copy = num_computed % self.block_size != 0
        if copy and self.pool.num_free < 1:
            raise MemoryError(f"slot {slot}: no free block for the copy-on-write")
        cdef int32_t j, src = -1, dst = -1
        self._reserve_slot_buffers(s, num_full + 1, num_prompt_tokens)
        memcpy(s.token_ids, parent.token_ids, num_prompt_tokens * sizeof(uint32_t))
        for j in range(num_full):
            self.pool._incref_one(parent.block_ids[j])
            s.block_ids[j] = parent.block_ids[j]
        memcpy(s.block_hashes, parent.block_hashes,
               _min(num_full, parent.num_hashed) * sizeof(Digest))
        s.num_blocks = num_full
        if copy:
            src = parent.block_ids[num_full]
            dst = self.pool._take_head()
            s.block_ids[num_full] = dst
            s.num_blocks += 1
        s.num_tokens = num_prompt_tokens
        s.num_computed_tokens = num_computed
        s.max_num_tokens = max_num_tokens
        s.num_lookahead = parent.num_lookahead
        s.salt = parent.salt
        s.num_blocks_sent = 0
        s.num_hashed = <int32_t>_min(num_full, parent.num_hashed)
        s.scheduled_step = -1
        self._bind(slot, request)
        return (src, dst) if copy else None

    def release(self, int32_t slot):
        """Frees the slot's blocks (in table order) and drops it from the running order. The
        request is unbound from the slot, its last computed count left on it."""
        cdef SlotState* s = self._state(slot)
        cdef int32_t j
        request = self._requests[slot]
        if request is None:
            raise ValueError(f"slot {slot} is not running")
        for j in range(s.num_blocks):
            if self.pool._ref[s.block_ids[j]] <= 0:
                raise ValueError(f"double free: block {s.block_ids[j]} has ref count 0")
        for j in range(s.num_blocks):
            self.pool._decref_one(s.block_ids[j])
        request.slot_view = None
        request.num_computed_tokens = s.num_computed_tokens
        s.num_blocks = 0
        s.num_hashed = 0
        s.num_tokens = 0
        s.num_computed_tokens = 0
        s.scheduled_step = -1
        s.epoch += 1
        self._remove_running(slot)
        self._requests[slot] = None

    def append_tokens(self, int32_t slot, token_ids):
        """Tokens sampled for the slot's sequence (and accepted by the stop checks)."""
        cdef SlotState* s = self._state(slot)
        cdef Py_ssize_t i, n = len(token_ids)
        self._reserve_slot_buffers(s, 0, s.num_tokens + n)
        for i in range(n):
            s.token_ids[s.num_tokens + i] = token_ids[i]
        s.num_tokens += n

    # ---- the step -----------------------------------------------------------------------------

    def begin_step(self, int64_t step_id, int64_t max_num_batched_tokens, int64_t max_num_seqs):
        self.step_id = step_id
        self.budget_tokens = max_num_batched_tokens
        self.budget_seqs = max_num_seqs
        self.budget_prefill_chunks = INT64_MAX
        self.stalled = False
        self._n = 0
        self._nb = 0

    def limit_prefill_chunks(self, int64_t num_chunks):
        self.budget_prefill_chunks = num_chunks

    def schedule_running(self, int phase):
        """One pass over the running sequences in admission order (`phase`: PHASE_ALL, or only
        PHASE_PREFILLS / PHASE_DECODES). Each takes a decode token or its next prompt chunk and the
        blocks that needs; when blocks run out, `on_blocks_exhausted(slot)` preempts the policy's
        victim (True when the victim was that slot's own sequence: the pass, and admission, stop).
        A slot scheduled earlier in the step, or released since the pass began, is skipped."""
        cdef int32_t k, nsnap = self.num_running, slot
        cdef SlotState* s
        cdef int64_t to_compute, n, num_blocks
        memcpy(self._snap, self._running, nsnap * sizeof(int32_t))
        for k in range(nsnap):
            self._snap_epochs[k] = self._slots[self._snap[k]].epoch
        for k in range(nsnap):
            if self.budget_tokens <= 0 or self.budget_seqs <= 0 or self.stalled:
                return
            slot = self._snap[k]
            s = &self._slots[slot]
            if s.epoch != self._snap_epochs[k] or s.scheduled_step == self.step_id:
                continue
            to_compute = s.num_tokens - s.num_computed_tokens
            if (phase == 1 and to_compute <= 1) or (phase == 2 and to_compute != 1):
                continue
            if to_compute == 1 and s.num_lookahead > 0:
                # A speculating decode: room for the drafts, never past its last token.
                to_compute += _min(s.num_lookahead, s.max_num_tokens - s.num_tokens)
            n = self._chunk(to_compute)
            if n == 0:
                continue
            num_blocks = _cdiv(s.num_computed_tokens + n, self.block_size) - s.num_blocks
            if num_blocks < 0:
                num_blocks = 0
            while num_blocks > self.pool.num_free:
                if self._on_blocks_exhausted(slot):
                    self.stalled = True
                    return
            self._schedule_slot(slot, n, num_blocks)

    def schedule_admitted(self, int32_t slot, int64_t num_new_tokens, int64_t num_blocks):
        """Schedules a sequence just admitted: its first chunk and its whole block table."""
        self._state(slot)
        self._schedule_slot(slot, num_new_tokens, num_blocks)

    def chunk(self, int64_t num_tokens_to_compute):
        """Tokens a sequence with this many tokens left may compute, given the budget left."""
        return self._chunk(num_tokens_to_compute)

    @property
    def budget_open(self):
        """Room for one more sequence in this step."""
        return self.budget_tokens > 0 and self.budget_seqs > 0 and not self.stalled

    def is_scheduled(self, int32_t slot):
        return self._state(slot).scheduled_step == self.step_id

    def hold(self, int32_t slot):
        """Leaves the slot's running sequence out of this step (a parked LoRA sequence,
        scheduler_service/core/lora_parking.py): the running passes skip it as if already
        scheduled, with no entry and no tokens; it keeps its slot, blocks and counts."""
        cdef SlotState* s = self._state(slot)
        if self._requests[slot] is None:
            raise ValueError(f"slot {slot} is not running")
        if s.scheduled_step == self.step_id:
            raise ValueError(f"slot {slot} is already scheduled in step {self.step_id}")
        s.scheduled_step = self.step_id
        s.num_scheduled_tokens = 0

    def decode_reserve_blocks(self):
        """Blocks every running sequence needs to grow decode_reserve_tokens past this step."""
        cdef int64_t total = 0
        cdef int32_t k
        cdef SlotState* s
        for k in range(self.num_running):
            s = &self._slots[self._running[k]]
            total += self._reserve_blocks_of(
                s, s.num_scheduled_tokens if s.scheduled_step == self.step_id else 0)
        return total

    def reserve_blocks_of(self, int32_t slot, int64_t num_scheduled):
        return self._reserve_blocks_of(self._state(slot), num_scheduled)

    def end_step(self):
        """(requests, slots, num_scheduled_tokens, num_new_blocks, new_block_ids, packed): the
        plan's entries as lists for Python and as a PackedPlan for the wire and for advance()."""
        cdef Py_ssize_t i, n = self._n, nb = self._nb
        cdef Py_ssize_t wire_len = self._encode_wire()
        cdef PackedPlan packed = PackedPlan.__new__(PackedPlan)
        cdef uint32_t* block = <uint32_t*>malloc((4 * n + nb + 1) * sizeof(uint32_t))
        if block == NULL:
            raise MemoryError("cannot allocate a packed plan")
        packed.slots = block
        packed.num_scheduled_tokens = block + n
        packed.num_new_blocks = block + 2 * n
        packed.epochs = block + 3 * n
        packed.new_block_ids = block + 4 * n
        packed.num_entries = n
        packed.num_block_ids = nb
        memcpy(packed.slots, self._out_slots, n * sizeof(uint32_t))
        memcpy(packed.num_scheduled_tokens, self._out_num_scheduled, n * sizeof(uint32_t))
        memcpy(packed.num_new_blocks, self._out_num_new_blocks, n * sizeof(uint32_t))
        memcpy(packed.epochs, self._out_epochs, n * sizeof(uint32_t))
        memcpy(packed.new_block_ids, self._out_block_ids, nb * sizeof(uint32_t))
        packed.wire = PyBytes_FromStringAndSize(<char*>self._wire, wire_len)
        cdef list requests = PyList_New(n)
        cdef list slots = PyList_New(n)
        cdef list num_scheduled = PyList_New(n)
        cdef list num_new_blocks = PyList_New(n)
        cdef list block_ids = PyList_New(nb)
        cdef object item
        for i in range(n):
            item = self._requests[self._out_slots[i]]
            Py_INCREF(item)
            PyList_SET_ITEM(requests, i, item)
            item = self._out_slots[i]
            Py_INCREF(item)
            PyList_SET_ITEM(slots, i, item)
            item = self._out_num_scheduled[i]
            Py_INCREF(item)
            PyList_SET_ITEM(num_scheduled, i, item)
            item = self._out_num_new_blocks[i]
            Py_INCREF(item)
            PyList_SET_ITEM(num_new_blocks, i, item)
        for i in range(nb):
            item = self._out_block_ids[i]
            Py_INCREF(item)
            PyList_SET_ITEM(block_ids, i, item)
        return requests, slots, num_scheduled, num_new_blocks, block_ids, packed

    def advance(self, PackedPlan packed not None, num_sampled_tokens, bint cache_blocks=True):
        """Applies a plan's result to the sequences still in their slots: computed counts advance
        and newly full blocks enter the prefix cache
        (later, by cache_blocks(), when `cache_blocks` is False: overlap commits a plan before
        its tokens are known). Returns (entry indices, offsets into the sampled token ids) of the
        live entries that sampled tokens, for Python's output processing."""
        cdef Py_ssize_t i, n = packed.num_entries, offset = 0, num_sampled
        cdef SlotState* s
        cdef uint32_t slot
        cdef list indices = [], offsets = []
        if len(num_sampled_tokens) != n:
            raise ValueError(f"result has {len(num_sampled_tokens)} sampled counts for a plan "
                             f"of {n} sequences")
        for i in range(n):
            num_sampled = num_sampled_tokens[i]
            slot = packed.slots[i]
            s = &self._slots[slot]
            if self._is_live(packed, i):
                if num_sampled > 0 and s.num_tokens - s.num_computed_tokens == 1:
                    # A decode: with speculation it computed its accepted drafts and one more
                    # (num_sampled tokens came back), not everything it was granted.
                    s.num_computed_tokens += num_sampled
                else:
                    s.num_computed_tokens += packed.num_scheduled_tokens[i]
                if self.enable_prefix_caching and cache_blocks:
                    self._cache_full_blocks(s, s.num_tokens)
                if num_sampled:
                    indices.append(i)
                    offsets.append(offset)
            offset += num_sampled
        return indices, offsets

    # ---- overlap: plans committed before their results -------------------------------------------

    def sampling_entries(self, PackedPlan packed not None):
        """0/1 per entry: whether it samples a token (its computed tokens reach its known ones);
        for a plan not yet advanced. Without speculation that is the whole result's shape."""
        cdef Py_ssize_t i, n = packed.num_entries
        cdef SlotState* s
        cdef list counts = [0] * n
        for i in range(n):
            s = &self._slots[packed.slots[i]]
            if s.num_computed_tokens + packed.num_scheduled_tokens[i] >= s.num_tokens:
                counts[i] = 1
        return counts

    def live_entries(self, PackedPlan packed not None):
        """Indices of the entries whose sequence still holds its slot (not released since)."""
        cdef Py_ssize_t i
        return [i for i in range(packed.num_entries) if self._is_live(packed, i)]

    def add_placeholders(self, PackedPlan packed not None, expected, held):
        """Overlap's commit: each live entry that samples (`expected[i]`, from
        sampling_entries) gets a placeholder token 0 appended to its sequence, for set_token to
        overwrite once the real id is known. Returns {entry index: the placeholder's token
        index}, in entry order; an entry in `held` (a set of indices, or None: a constrained
        sequence, whose next mask needs the real token) maps to None and gets no placeholder."""
        cdef Py_ssize_t i, n = packed.num_entries
        cdef SlotState* s
        cdef dict placeholders = {}
        if len(expected) != n:
            raise ValueError(f"{len(expected)} sampling flags for a plan of {n} sequences")
        for i in range(n):
            if not expected[i] or not self._is_live(packed, i):
                continue
            if held is not None and i in held:
                placeholders[i] = None
                continue
            s = &self._slots[packed.slots[i]]
            self._reserve_slot_buffers(s, 0, s.num_tokens + 1)
            placeholders[i] = s.num_tokens
            s.token_ids[s.num_tokens] = 0
            s.num_tokens += 1
        return placeholders

    def set_token(self, int32_t slot, int64_t index, uint32_t token_id):
        """Overwrites token `index` of the slot's sequence (a placeholder appended by overlap's
        commit, once the real id is known)."""
        cdef SlotState* s = self._state(slot)
        if not 0 <= index < s.num_tokens:
            raise IndexError(f"slot {slot}: token {index} of {s.num_tokens}")
        s.token_ids[index] = token_id

    def cache_blocks(self, PackedPlan packed not None):
        """The prefix-cache registration advance() skipped, for the entries still live; call once
        every token of their computed blocks is real."""
        cdef Py_ssize_t i
        cdef SlotState* s
        if not self.enable_prefix_caching:
            return
        for i in range(packed.num_entries):
            if self._is_live(packed, i):
                s = &self._slots[packed.slots[i]]
                self._cache_full_blocks(s, s.num_tokens)

    def cache_finished_blocks(self, int32_t slot, int64_t num_real_tokens):
        """Registers the slot's full computed blocks among its first `num_real_tokens` tokens,
        for a sequence about to be released as finished while its plan is reconciled: overlap
        registers a plan's blocks after its stops (cache_blocks), when a finished sequence has
        left its slot, so one that finishes in the step that computed its prompt would leave no
        block cached. Tokens from `num_real_tokens` on are placeholders of a plan in flight."""
        if self.enable_prefix_caching:
            self._cache_full_blocks(self._state(slot), num_real_tokens)

    # ---- inspection -----------------------------------------------------------------------------

    def running_slots(self):
        return [self._running[i] for i in range(self.num_running)]

    def block_ids(self, int32_t slot):
        cdef SlotState* s = self._state(slot)
        return [s.block_ids[i] for i in range(s.num_blocks)]

    def block_hashes(self, int32_t slot):
        cdef SlotState* s = self._state(slot)
        return [digest_to_int(&s.block_hashes[i]) for i in range(s.num_hashed)]

    def num_computed_tokens(self, int32_t slot):
        return self._state(slot).num_computed_tokens

    def num_tokens(self, int32_t slot):
        return self._state(slot).num_tokens
