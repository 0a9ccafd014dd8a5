"""The KV block pool: ref counts, an LRU free queue that also holds cached blocks, prefix-hash map.

This file is the contract (STYLE.md item 8): the C layout other Cython modules may cimport.
block_pool.pyx implements it, block_pool.pyi is the Python view. tests/scheduler/block_pool_oracle.py
is the pure-Python oracle that must make the same decisions.
"""
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from libcpp.unordered_map cimport unordered_map

# libcpp.unordered_map: a module that cimports this one must build as C++ too.


# The chained, salted 64-bit block hash (xxHash64-style rounds, see block_pool.pyx).
cdef uint64_t hash_seed(uint64_t parent_hash, uint64_t salt) noexcept nogil
cdef uint64_t hash_round(uint64_t acc, uint64_t value) noexcept nogil
cdef uint64_t hash_finish(uint64_t acc, uint64_t num_tokens) noexcept nogil


cdef class BlockPool:
    cdef readonly int32_t num_blocks   # block ids are 0 .. num_blocks - 1; block 0 is reserved
    cdef readonly int32_t num_free     # blocks with ref count 0 (all of them sit in the free queue)

    cdef int32_t* _ref                 # [num_blocks] ref count; block 0 is pinned at 1
    cdef int32_t* _prev                # [num_blocks + 1] free-queue links; index num_blocks is the
    cdef int32_t* _next                #   sentinel; -1 = not in the queue
    cdef uint64_t* _hash               # [num_blocks] the block's hash, valid where _has_hash[b]
    cdef uint8_t* _has_hash            # [num_blocks] 1 iff _hash_to_block[_hash[b]] == b
    cdef unordered_map[uint64_t, int32_t] _hash_to_block

    # Free queue (O(1) each).
    cdef void _push_tail(self, int32_t block_id) noexcept nogil
    cdef void _unlink(self, int32_t block_id) noexcept nogil
    cdef int32_t _pop_head(self) noexcept nogil

    # Hash map.
    cdef void _evict_hash(self, int32_t block_id) noexcept nogil
    cdef int32_t _lookup(self, uint64_t block_hash) noexcept nogil
    cdef int _register_hash(self, int32_t block_id, uint64_t block_hash) except -1

    # Ref counts; ids are already validated.
    cdef int32_t _take_head(self) noexcept nogil
    cdef void _incref_one(self, int32_t block_id) noexcept nogil
    cdef void _decref_one(self, int32_t block_id) noexcept nogil
    cdef void _undo_decref(self, int32_t block_id) noexcept nogil

    cdef int32_t _check_id(self, object block_id) except -1
