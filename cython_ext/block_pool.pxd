"""The KV block pool: ref counts, an LRU free queue that also holds cached blocks, prefix-hash map.

This file is the contract (STYLE.md item 8): the C layout other Cython modules may cimport.
block_pool.pyx implements it, block_pool.pyi is the Python view. tests/scheduler/block_pool_oracle.py
is the pure-Python oracle that must make the same decisions.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libcpp.unordered_map cimport unordered_map

# libcpp.unordered_map: a module that cimports this one must build as C++ too.


# The block hash: SHA-256 over (salt, parent digest, token ids), each field tagged; see
# block_pool.pyx "block hash" for the byte layout. A digest is 32 bytes, as SHA-256 writes them.
cdef struct Digest:
    uint8_t b[32]

# parent NULL: the first block (all-zero parent); salt NULL: no salt (all zeros). out may be
# parent or salt: both are read in full before out is written.
cdef void hash_block(const Digest* parent, const Digest* salt, const uint32_t* token_ids,
                     Py_ssize_t num_tokens, Digest* out) noexcept nogil
# Python sees a digest or a salt as an int in [0, 2**256) (big-endian); OverflowError names `name`.
cdef int digest_from_int(object value, Digest* out, str name) except -1
cdef object digest_to_int(const Digest* d)


cdef class BlockPool:
    cdef readonly int32_t num_blocks   # block ids are 0 .. num_blocks - 1; block 0 is reserved
    cdef readonly int32_t num_free     # blocks with ref count 0 (all of them sit in the free queue)

    cdef int32_t* _ref                 # [num_blocks] ref count; block 0 is pinned at 1
    cdef int32_t* _prev                # [num_blocks + 1] free-queue links; index num_blocks is the
    cdef int32_t* _next                #   sentinel; -1 = not in the queue
    cdef Digest* _digest               # [num_blocks] the block's digest, valid where _has_hash[b]
    cdef uint8_t* _has_hash            # [num_blocks] 1 iff _key_to_block[key(_digest[b])] == b
    cdef unordered_map[uint64_t, int32_t] _key_to_block  # index: digest key -> block
    cdef int _key_shift                # 64 - key bits; 0 except in tests (set_key_bits_for_tests)
    cdef uint32_t* _scratch            # token ids of one block being hashed (Python callers)
    cdef Py_ssize_t _scratch_cap

    # KV-cache event log (enable_events; block_pool.pyx "event log"): what the step stored,
    # evicted or cleared, in order, drained once per step by take_events.
    cdef uint8_t _record               # 1 once enable_events ran
    cdef uint8_t _clearing             # reset_prefix_cache in progress: one CLEARED, no REMOVED
    cdef uint8_t _ev_lost              # an append could not grow the log: the batch is incomplete
    cdef int32_t _ev_block_size
    cdef Py_ssize_t _ev_n, _ev_cap     # events
    cdef uint8_t* _ev_kind             # [cap] EV_STORED, EV_REMOVED, EV_CLEARED
    cdef Digest* _ev_digest            # [cap] the block's digest (STORED, REMOVED)
    cdef Digest* _ev_parent            # [cap] STORED: the parent's digest, if _ev_has_parent
    cdef uint8_t* _ev_has_parent       # [cap]
    cdef int64_t* _ev_tok_start        # [cap] STORED: its tokens in _ev_tokens
    cdef int32_t* _ev_tok_n            # [cap]
    cdef uint32_t* _ev_tokens          # token ids of the logged STORED blocks, back to back
    cdef int64_t _ev_tok_len, _ev_tok_cap
    # Per block, what a STORED event of it said (to re-announce every cached block after a lost
    # batch): its parent digest and tokens, valid where _blk_logged[b].
    cdef Digest* _blk_parent           # [num_blocks]
    cdef uint8_t* _blk_has_parent      # [num_blocks]
    cdef uint8_t* _blk_logged          # [num_blocks]
    cdef uint32_t* _blk_tokens         # [num_blocks * _ev_block_size]

    # Free queue (O(1) each).
    cdef void _push_tail(self, int32_t block_id) noexcept nogil
    cdef void _unlink(self, int32_t block_id) noexcept nogil
    cdef int32_t _pop_head(self) noexcept nogil

    # Hash map.
    cdef void _evict_hash(self, int32_t block_id) noexcept nogil
    cdef int32_t _lookup(self, const Digest* digest) noexcept nogil   # full-digest hit, or -1
    cdef int _cache(self, int32_t block_id, const Digest* digest) except -1  # 1 cached, 0 not
    # _cache, and a STORED event when the block became cached just now (parent NULL: the first).
    cdef int _cache_logged(self, int32_t block_id, const Digest* digest, const Digest* parent,
                           const uint32_t* token_ids, Py_ssize_t num_tokens) except -1

    # Event log appends; a failed growth sets _ev_lost instead.
    cdef int _ev_reserve(self, Py_ssize_t num_events, int64_t num_tokens) noexcept nogil
    cdef void _log_stored(self, int32_t block_id, const Digest* parent,
                          const uint32_t* token_ids, Py_ssize_t num_tokens) noexcept nogil
    cdef void _log(self, uint8_t kind, const Digest* digest) noexcept nogil
    cdef uint32_t* _tokens_of(self, object token_ids, Py_ssize_t start, Py_ssize_t n) except NULL

    # Ref counts; ids are already validated.
    cdef int32_t _take_head(self) noexcept nogil
    cdef void _incref_one(self, int32_t block_id) noexcept nogil
    cdef void _decref_one(self, int32_t block_id) noexcept nogil
    cdef void _undo_decref(self, int32_t block_id) noexcept nogil

    cdef int32_t _check_id(self, object block_id) except -1
