"""The scheduler's per-step hot path: per-slot sequence state in C, the running loop, the budget,
block allocation and the plan's packed arrays (DESIGN.md "The scheduler's step rule").

This file is the contract (STYLE.md item 8); step_core.pyx implements it, step_core.pyi is the
Python view. tests/scheduler/oracle_scheduler.py is the pure-Python oracle that must make the same
decisions. Built as C++ because it cimports block_pool (libcpp.unordered_map).
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

from cython_ext.block_pool cimport BlockPool, Digest


# What one running sequence needs per step, indexed by its slot. The buffers (block table, hashes,
# token ids) are kept when the slot is released and reused by the next sequence in it.
cdef struct SlotState:
    int64_t num_tokens              # prompt + generated tokens the scheduler knows
    int64_t num_computed_tokens     # tokens with their KV computed (advanced by update)
    int64_t max_num_tokens          # prompt + max_new_tokens: the most it will ever hold
    int32_t num_lookahead           # speculation: draft tokens granted to each of its decodes
    Digest salt                     # prefix-cache salt (kv_blocks.salt_of; all zeros: none)
    uint32_t epoch                  # bumped on release: plans built before no longer match
    int64_t scheduled_step          # step_id of the last step that scheduled it
    int64_t num_scheduled_tokens    # tokens scheduled in that step
    int32_t num_blocks              # block_ids[0:num_blocks] is the block table
    int32_t num_blocks_sent         # block_ids[0:num_blocks_sent] are known to the model service
    int32_t num_hashed              # block_hashes[0:num_hashed]: leading full blocks, hashed
    int32_t blocks_cap
    int32_t* block_ids
    Digest* block_hashes            # same capacity as block_ids: SHA-256 block digests
    int64_t tokens_cap
    uint32_t* token_ids             # token_ids[0:num_tokens]


cdef class StepCore


# What a Request reads of its slot while it holds one (Request.num_computed_tokens, .block_ids):
# one per slot, made with the core; admit/fork bind the request to it, release unbinds it.
cdef class SlotView:
    cdef StepCore core
    cdef readonly int32_t slot


# The packed arrays of one plan, owned by the plan (plans may run ahead of results).
cdef class PackedPlan:
    cdef readonly Py_ssize_t num_entries
    cdef readonly Py_ssize_t num_block_ids
    cdef uint32_t* slots                 # [num_entries]
    cdef uint32_t* num_scheduled_tokens  # [num_entries]
    cdef uint32_t* num_new_blocks        # [num_entries]
    cdef uint32_t* epochs                # [num_entries] the slot's epoch when scheduled
    cdef uint32_t* new_block_ids         # [num_block_ids]
    cdef readonly bytes wire             # BatchPlan fields 3-6 (packed uint32), wire format


cdef class StepCore:
    cdef BlockPool pool
    cdef readonly int32_t block_size
    cdef readonly int32_t max_num_slots
    cdef readonly int64_t max_prefill_chunk      # 0: no cap
    cdef readonly int64_t decode_reserve_tokens
    cdef readonly bint enable_prefix_caching

    cdef SlotState* _slots               # [max_num_slots]
    cdef list _requests                  # [max_num_slots] the Request in each slot, or None
    cdef tuple _views                    # [max_num_slots] the SlotView of each slot
    cdef int32_t* _running               # [max_num_slots] running slots, admission order
    cdef readonly int32_t num_running
    cdef int32_t* _snap                  # [max_num_slots] the running order a pass iterates
    cdef uint32_t* _snap_epochs

    # The step being built.
    cdef readonly int64_t step_id
    cdef readonly int64_t budget_tokens
    cdef readonly int64_t budget_seqs
    cdef readonly int64_t budget_prefill_chunks
    cdef readonly bint stalled           # a running sequence preempted itself: admit nobody
    cdef Py_ssize_t _n                   # plan entries so far
    cdef Py_ssize_t _nb                  # new block ids so far
    cdef Py_ssize_t _nb_cap
    cdef uint32_t* _out_slots            # [max_num_slots]
    cdef uint32_t* _out_num_scheduled    # [max_num_slots]
    cdef uint32_t* _out_num_new_blocks   # [max_num_slots]
    cdef uint32_t* _out_epochs           # [max_num_slots]
    cdef uint32_t* _out_block_ids        # [_nb_cap]
    cdef uint8_t* _wire                  # [_wire_cap]
    cdef Py_ssize_t _wire_cap

    cdef object _on_blocks_exhausted     # callable(slot) -> bool: preempts the policy's victim
    cdef object _on_scheduled            # policy.on_scheduled, or None when it is the no-op

    cdef SlotState* _state(self, int32_t slot) except NULL
    cdef bint _is_live(self, PackedPlan packed, Py_ssize_t i)
    cdef int _bind(self, int32_t slot, object request) except -1
    cdef int _reserve_slot_buffers(self, SlotState* s, int32_t num_blocks,
                                   int64_t num_tokens) except -1
    cdef int64_t _chunk(self, int64_t num_tokens_to_compute) noexcept nogil
    cdef int64_t _reserve_blocks_of(self, SlotState* s, int64_t num_scheduled) noexcept nogil
    cdef int _schedule_slot(self, int32_t slot, int64_t num_new_tokens,
                            int64_t num_blocks) except -1
    cdef int _cache_full_blocks(self, SlotState* s, int64_t num_real_tokens) except -1
    cdef void _remove_running(self, int32_t slot) noexcept nogil
    cdef int _grow_out_block_ids(self, Py_ssize_t need) except -1
    cdef Py_ssize_t _encode_wire(self) except -1
