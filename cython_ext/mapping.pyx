"""Step-input mapping (runner.py's packed-row table). The contract is mapping.pxd, the Python view mapping.pyi.

One builder per runner. Every output lives in a preallocated int64 buffer; a step fills the front of
each in one C loop over the scheduled slots, without the GIL, and hands out numpy views of the
filled prefix. Nothing is allocated per request or per token, only the views.

    B scheduled slots, slot s = slots[b], k = num_scheduled[b] tokens, c = num_computed[s]:

    row            query_start[b] .. query_start[b] + k - 1       (query_start[b] = k[0] + .. + k[b-1])
    position       c .. c + k - 1
    input id       tokens[s, position]
    slot mapping   block_table[s, position // bs] * bs + position % bs
    context_lens   c + k
    needs_sample   c + k == num_tokens[s]  -> logits_indices += [last row], sample_slots += [s]
    block_tables   block_table[s, :ceil(max context_lens / bs)]   (rows of a [B, cols] block)

The slot mapping walks one block at a time (one division per block, not per token): inside block
j = position // bs, position % bs = position - j * bs, so slot = (block_id - j) * bs + position.
"""
cimport cython
from libc.stdint cimport int32_t, int64_t

import numpy as np


@cython.final
@cython.freelist(4)
cdef class StepInputs:
    """The packed inputs of one step: views of the builder's buffers, valid until its next build()."""


cdef inline Py_ssize_t _ceil_div(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return (a + b - 1) // b


@cython.final
cdef class StepInputBuilder:
    """Fills a step's packed inputs into preallocated int64 buffers. Not thread safe."""

    def __cinit__(self, Py_ssize_t max_num_tokens, Py_ssize_t max_num_seqs, Py_ssize_t max_blocks_per_seq,
                  Py_ssize_t block_size):
        if max_num_tokens < 1 or max_num_seqs < 1 or max_blocks_per_seq < 1 or block_size < 1:
            raise ValueError(
                f"max_num_tokens {max_num_tokens}, max_num_seqs {max_num_seqs}, "
                f"max_blocks_per_seq {max_blocks_per_seq}, block_size {block_size}: each must be >= 1"
            )
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self._alloc_tokens(max_num_tokens)
        self._query_start_np = np.zeros(max_num_seqs, dtype=np.int64)
        self._context_lens_np = np.zeros(max_num_seqs, dtype=np.int64)
        self._needs_sample_np = np.zeros(max_num_seqs, dtype=np.int64)
        self._logits_indices_np = np.zeros(max_num_seqs, dtype=np.int64)
        self._sample_slots_np = np.zeros(max_num_seqs, dtype=np.int64)
        self._block_tables_np = np.zeros(max_num_seqs * max_blocks_per_seq, dtype=np.int64)
        self._query_start = self._query_start_np
        self._context_lens = self._context_lens_np
        self._needs_sample = self._needs_sample_np
        self._logits_indices = self._logits_indices_np
        self._sample_slots = self._sample_slots_np
        self._block_tables = self._block_tables_np

    cdef int _alloc_tokens(self, Py_ssize_t capacity) except -1:
        # Views handed out earlier keep the old arrays alive; they are simply no longer written.
        self._positions_np = np.zeros(capacity, dtype=np.int64)
        self._input_ids_np = np.zeros(capacity, dtype=np.int64)
        self._slot_mapping_np = np.zeros(capacity, dtype=np.int64)
        self._positions = self._positions_np
        self._input_ids = self._input_ids_np
        self._slot_mapping = self._slot_mapping_np
        self.max_num_tokens = capacity
        return 0

    def build(self, const int32_t[:, ::1] tokens not None, const int32_t[:, ::1] block_table not None,
              const int64_t[::1] num_computed not None, const int64_t[::1] num_tokens not None,
              const int64_t[::1] slots not None, const int64_t[::1] num_scheduled not None):
        """The step's packed inputs for `slots`, each scheduled `num_scheduled[b]` tokens."""
        cdef Py_ssize_t num_seqs = slots.shape[0]
        cdef Py_ssize_t bad, num_sample = 0, cols
        cdef bint filled = False
        self._check_shapes(tokens.shape[0], block_table.shape[0], block_table.shape[1], num_computed.shape[0],
                           num_tokens.shape[0], num_seqs, num_scheduled.shape[0])
        with nogil:
            bad = self._measure(tokens, block_table, num_computed, slots, num_scheduled)
            if bad < 0 and self._num_tokens <= self.max_num_tokens:
                num_sample = self._fill(tokens, block_table, num_computed, num_tokens, slots, num_scheduled)
                filled = True
        if bad >= 0:
            raise ValueError(_explain(bad, tokens, block_table, num_computed, slots, num_scheduled, self.block_size))
        if not filled:  # more rows than ever before: grow, then fill
            self._alloc_tokens(max(self._num_tokens, 2 * self.max_num_tokens))
            with nogil:
                num_sample = self._fill(tokens, block_table, num_computed, num_tokens, slots, num_scheduled)

        cdef Py_ssize_t T = self._num_tokens
        cdef StepInputs out = StepInputs.__new__(StepInputs)
        out.num_tokens = T
        out.max_query_len = self._max_query_len
        out.max_context_len = self._max_context_len
        out.positions = self._positions_np[:T]
        out.input_ids = self._input_ids_np[:T]
        out.slot_mapping = self._slot_mapping_np[:T]
        out.query_start = self._query_start_np[:num_seqs]
        out.context_lens = self._context_lens_np[:num_seqs]
        out.needs_sample = self._needs_sample_np[:num_seqs]
        out.logits_indices = self._logits_indices_np[:num_sample]
        out.sample_slots = self._sample_slots_np[:num_sample]
        cols = _ceil_div(self._max_context_len, self.block_size)
        out.block_tables = self._block_tables_np[: num_seqs * cols].reshape(num_seqs, cols)
        return out

    cdef int _check_shapes(self, Py_ssize_t num_slots, Py_ssize_t block_table_rows, Py_ssize_t block_table_cols,
                           Py_ssize_t num_computed_len, Py_ssize_t num_tokens_len, Py_ssize_t num_seqs,
                           Py_ssize_t num_scheduled_len) except -1:
        if not block_table_rows == num_computed_len == num_tokens_len == num_slots:
            raise ValueError(
                f"tokens has {num_slots} slots but block_table {block_table_rows}, "
                f"num_computed {num_computed_len}, num_tokens {num_tokens_len}"
            )
        if block_table_cols > self.max_blocks_per_seq:
            raise ValueError(f"block_table has {block_table_cols} columns > max_blocks_per_seq {self.max_blocks_per_seq}")
        if num_scheduled_len != num_seqs:
            raise ValueError(f"num_scheduled has length {num_scheduled_len} != len(slots) {num_seqs}")
        if num_seqs > self.max_num_seqs:
            raise ValueError(f"{num_seqs} slots scheduled > max_num_seqs {self.max_num_seqs}")
        return 0

    cdef Py_ssize_t _measure(self, const int32_t[:, ::1] tokens, const int32_t[:, ::1] block_table,
                             const int64_t[::1] num_computed, const int64_t[::1] slots,
                             const int64_t[::1] num_scheduled) noexcept nogil:
        cdef Py_ssize_t num_slots = tokens.shape[0], max_len = tokens.shape[1], max_blocks = block_table.shape[1]
        cdef Py_ssize_t b, total = 0, max_query = 0, max_context = 0
        cdef int64_t s, k, c
        for b in range(slots.shape[0]):
            s, k = slots[b], num_scheduled[b]
            if s < 0 or s >= num_slots or k < 1:
                return b
            c = num_computed[s]
            if c < 0 or k > max_len - c or _ceil_div(c + k, self.block_size) > max_blocks:
                return b
            total += k
            max_query = max(max_query, k)
            max_context = max(max_context, c + k)
        self._num_tokens, self._max_query_len, self._max_context_len = total, max_query, max_context
        return -1

    cdef Py_ssize_t _fill(self, const int32_t[:, ::1] tokens, const int32_t[:, ::1] block_table,
                          const int64_t[::1] num_computed, const int64_t[::1] num_tokens,
                          const int64_t[::1] slots, const int64_t[::1] num_scheduled) noexcept nogil:
        cdef int64_t bs = self.block_size
        cdef Py_ssize_t cols = _ceil_div(self._max_context_len, bs)
        cdef int64_t* positions = &self._positions[0]
        cdef int64_t* input_ids = &self._input_ids[0]
        cdef int64_t* slot_mapping = &self._slot_mapping[0]
        cdef int64_t* block_tables = &self._block_tables[0]
        cdef Py_ssize_t b, j, row = 0, num_sample = 0
        cdef int64_t s, pos, end, block_end, base
        cdef const int32_t* tok_row
        cdef const int32_t* blk_row
        for b in range(slots.shape[0]):
            s = slots[b]
            pos, end = num_computed[s], num_computed[s] + num_scheduled[b]
            tok_row, blk_row = &tokens[s, 0], &block_table[s, 0]
            self._query_start[b] = row
            self._context_lens[b] = end
            while pos < end:  # one block of the chunk per pass
                j = pos // bs
                block_end = min((j + 1) * bs, end)
                base = (<int64_t>blk_row[j] - j) * bs
                while pos < block_end:
                    positions[row], input_ids[row], slot_mapping[row] = pos, tok_row[pos], base + pos
                    pos += 1
                    row += 1
            for j in range(cols):
                block_tables[b * cols + j] = blk_row[j]
            self._needs_sample[b] = end == num_tokens[s]
            if end == num_tokens[s]:
                self._logits_indices[num_sample] = row - 1
                self._sample_slots[num_sample] = s
                num_sample += 1
        return num_sample


def _explain(Py_ssize_t b, tokens, block_table, num_computed, slots, num_scheduled, Py_ssize_t block_size):
    # The slow path of a failed _measure: say which bound scheduled row b broke.
    s, k = slots[b], num_scheduled[b]
    if not 0 <= s < tokens.shape[0]:
        return f"slots[{b}] = {s} is outside 0 .. {tokens.shape[0] - 1}"
    if k < 1:
        return f"num_scheduled[{b}] = {k}: every scheduled slot needs >= 1 token"
    c = num_computed[s]
    if c < 0 or c + k > tokens.shape[1]:
        return f"slot {s}: computed {c} + scheduled {k} is outside the {tokens.shape[1]} token columns"
    return f"slot {s}: computed {c} + scheduled {k} tokens need more than the {block_table.shape[1]} block columns of size {block_size}"
