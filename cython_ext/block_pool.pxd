"""The KV block pool: ref counts, an LRU free queue that also holds cached blocks, prefix-hash map.

This file is the contract (STYLE.md item 8): the C layout other Cython modules may cimport.
block_pool.pyx implements it, block_pool.pyi is the Python view. tests/scheduler/block_pool_oracle.py
is the pure-Python oracle that must make the same decisions.
"""
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
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

    # Free queue (O(1) each).
    cdef void _push_tail(self, int32_t block_id) noexcept nogil
    cdef void _unlink(self, int32_t block_id) noexcept nogil
    cdef int32_t _pop_head(self) noexcept nogil

    # Hash map.
    cdef void _evict_hash(self, int32_t block_id) noexcept nogil
    cdef int32_t _lookup(self, const Digest* digest) noexcept nogil   # full-digest hit, or -1
    cdef int _cache(self, int32_t block_id, const Digest* digest) except -1  # 1 cached, 0 not
    cdef uint32_t* _tokens_of(self, object token_ids, Py_ssize_t start, Py_ssize_t n) except NULL

    # Ref counts; ids are already validated.
    cdef int32_t _take_head(self) noexcept nogil
    cdef void _incref_one(self, int32_t block_id) noexcept nogil
    cdef void _decref_one(self, int32_t block_id) noexcept nogil
    cdef void _undo_decref(self, int32_t block_id) noexcept nogil

    cdef int32_t _check_id(self, object block_id) except -1
