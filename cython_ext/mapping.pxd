"""Step-input mapping: the packed rows of one forward step, built from the per-slot state.

This file is the contract (STYLE.md item 8): the C layout other Cython modules may cimport.
mapping.pyx implements it, mapping.pyi is the Python view. tests/model_service/test_ms_mapping.py
keeps the numpy original as the oracle that every output must match.
"""
from libc.stdint cimport int32_t, int64_t


cdef class StepInputs:
    # numpy views of the builder's buffers, valid until its next build().
    cdef readonly object positions       # [T] int64
    cdef readonly object input_ids       # [T] int64
    cdef readonly object slot_mapping    # [T] int64
    cdef readonly object query_start     # [B] int64
    cdef readonly object context_lens    # [B] int64
    cdef readonly object needs_sample    # [B] int64, 0 or 1
    cdef readonly object logits_indices  # [S] int64, S = needs_sample.sum()
    cdef readonly object sample_slots    # [S] int64
    cdef readonly object block_tables    # [B, ceil(max_context_len / block_size)] int64
    cdef readonly Py_ssize_t num_tokens  # T
    cdef readonly Py_ssize_t max_query_len
    cdef readonly Py_ssize_t max_context_len


cdef class StepInputBuilder:
    cdef readonly Py_ssize_t max_num_tokens      # token-row capacity; grows (doubling) when exceeded
    cdef readonly Py_ssize_t max_num_seqs
    cdef readonly Py_ssize_t max_blocks_per_seq
    cdef readonly Py_ssize_t block_size

    # Owning numpy arrays (the views handed out slice these) and typed views of the same memory.
    cdef object _positions_np, _input_ids_np, _slot_mapping_np                  # [max_num_tokens]
    cdef object _query_start_np, _context_lens_np, _needs_sample_np             # [max_num_seqs]
    cdef object _logits_indices_np, _sample_slots_np                            # [max_num_seqs]
    cdef object _block_tables_np                                                # [max_num_seqs * max_blocks_per_seq]
    cdef int64_t[::1] _positions, _input_ids, _slot_mapping
    cdef int64_t[::1] _query_start, _context_lens, _needs_sample
    cdef int64_t[::1] _logits_indices, _sample_slots
    cdef int64_t[::1] _block_tables

    # Totals of the last _measure: T, the longest chunk, the longest context.
    cdef Py_ssize_t _num_tokens, _max_query_len, _max_context_len

    cdef int _alloc_tokens(self, Py_ssize_t capacity) except -1
    cdef int _check_shapes(self, Py_ssize_t num_slots, Py_ssize_t block_table_rows, Py_ssize_t block_table_cols,
                           Py_ssize_t num_computed_len, Py_ssize_t num_tokens_len, Py_ssize_t num_seqs,
                           Py_ssize_t num_scheduled_len) except -1

    # Pass 1: check every scheduled slot against the arrays' shapes and sum up; -1 if all are
    # in bounds, else the index of the first bad one (nothing is written).
    cdef Py_ssize_t _measure(self, const int32_t[:, ::1] tokens, const int32_t[:, ::1] block_table,
                             const int64_t[::1] num_computed, const int64_t[::1] slots,
                             const int64_t[::1] num_scheduled) noexcept nogil

    # Pass 2: fill the buffers; returns S, the number of sampling rows. Only after _measure passed.
    cdef Py_ssize_t _fill(self, const int32_t[:, ::1] tokens, const int32_t[:, ::1] block_table,
                          const int64_t[::1] num_computed, const int64_t[::1] num_tokens,
                          const int64_t[::1] slots, const int64_t[::1] num_scheduled) noexcept nogil
