# distutils: language = c++
"""The KV block pool (DESIGN.md "KV blocks"). The contract is block_pool.pxd, the Python view block_pool.pyi.

One pool per scheduler, sized from the model service's Describe reply. Everything per block lives in
C arrays indexed by block id; there is no Python object per block.

Free queue: an intrusive doubly linked list threaded through `_prev` / `_next`, with a sentinel at
index `num_blocks` so that push and unlink never branch on "empty" or "at the end". It holds every
block whose ref count is 0, cached (still has a hash) or not, least recently freed at the head:

    index     1     2     3     4     5   ...   N (sentinel)
    ref       0     1     0     2     0
    queue     S -> [3] <-> [1] <-> [5] <-> S       next[S] = 3 (head), prev[S] = 5 (tail)
    links     blocks 2 and 4 are held: prev = next = -1

    allocate  pops the head (3 here): the block freed longest ago, the cheapest cached KV to lose.
    free      pushes a block whose ref count reaches 0 onto the tail, so recently used cached
              blocks are evicted last.
    incref    of a ref-0 block (a prefix hit on a cached block) unlinks it from the middle.

Prefix cache: every full block may carry a 64-bit hash chained on its parent's hash and salted
(block_hash). `_hash_to_block` maps hash -> block; a block has a hash iff the map points back at it,
so evicting (allocate reusing the block) erases exactly one entry.
"""
from cython.operator cimport dereference as deref
from libc.stdint cimport INT32_MAX, int32_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free as c_free, malloc
from libcpp.unordered_map cimport unordered_map
from libcpp.utility cimport pair

# The block hash: xxHash64's primes and round, folded over (salt, parent hash, token ids, count) in
# one accumulator, then xxHash64's avalanche. Not XXH64 itself (one lane, no length prefix), and not
# collision resistant against an adversary; the salt keeps tenants apart. The oracle repeats it in
# Python with explicit 64-bit masking, so both must change together.
cdef extern from *:
    """
    static const uint64_t PS_P1 = 0x9E3779B185EBCA87ULL;
    static const uint64_t PS_P2 = 0xC2B2AE3D27D4EB4FULL;
    static const uint64_t PS_P3 = 0x165667B19E3779F9ULL;
    static const uint64_t PS_P5 = 0x27D4EB2F165667C5ULL;
    """
    const uint64_t P1 "PS_P1"
    const uint64_t P2 "PS_P2"
    const uint64_t P3 "PS_P3"
    const uint64_t P5 "PS_P5"


cdef inline uint64_t _rotl31(uint64_t x) noexcept nogil:
    return (x << 31) | (x >> 33)


cdef uint64_t hash_round(uint64_t acc, uint64_t value) noexcept nogil:
    return _rotl31(acc + value * P2) * P1


cdef uint64_t hash_seed(uint64_t parent_hash, uint64_t salt) noexcept nogil:
    return hash_round(hash_round(P5, salt), parent_hash)


cdef uint64_t hash_finish(uint64_t acc, uint64_t num_tokens) noexcept nogil:
    acc = hash_round(acc, num_tokens)
    acc ^= acc >> 33
    acc *= P2
    acc ^= acc >> 29
    acc *= P3
    acc ^= acc >> 32
    return acc


def block_hash(uint64_t parent_hash, token_ids, uint64_t salt=0):
    """Hash of one full block: chained on `parent_hash` (0 for the first block) and salted."""
    cdef uint64_t acc = hash_seed(parent_hash, salt)
    cdef uint64_t n = 0
    cdef uint32_t tok
    for t in token_ids:
        tok = t
        acc = hash_round(acc, tok)
        n += 1
    return hash_finish(acc, n)


cdef int _hash_slice(object token_ids, Py_ssize_t start, Py_ssize_t block_size,
                     uint64_t parent_hash, uint64_t salt, uint64_t* out) except -1:
    # The hash of token_ids[start : start + block_size]; the slice is never materialised.
    cdef uint64_t acc = hash_seed(parent_hash, salt)
    cdef uint32_t tok
    cdef Py_ssize_t j
    for j in range(start, start + block_size):
        tok = token_ids[j]
        acc = hash_round(acc, tok)
    out[0] = hash_finish(acc, <uint64_t>block_size)
    return 0


cdef class BlockPool:
    """Ref-counted KV blocks with an LRU free queue and a prefix-hash map. Not thread safe."""

    def __cinit__(self, num_blocks):
        if not 1 <= num_blocks <= INT32_MAX - 1:
            raise ValueError(f"num_blocks must be in [1, {INT32_MAX - 1}], got {num_blocks}")
        cdef int32_t n = num_blocks
        cdef int32_t sentinel = n
        cdef int32_t b
        self.num_blocks = n
        self.num_free = 0
        self._ref = <int32_t*>calloc(n, sizeof(int32_t))
        self._prev = <int32_t*>malloc((n + 1) * sizeof(int32_t))
        self._next = <int32_t*>malloc((n + 1) * sizeof(int32_t))
        self._hash = <uint64_t*>calloc(n, sizeof(uint64_t))
        self._has_hash = <uint8_t*>calloc(n, sizeof(uint8_t))
        if not (self._ref and self._prev and self._next and self._hash and self._has_hash):
            raise MemoryError(f"cannot allocate block pool arrays for {n} blocks")
        self._prev[sentinel] = sentinel
        self._next[sentinel] = sentinel
        self._ref[0] = 1  # reserved: pinned, never in the queue, never handed out
        self._prev[0] = -1
        self._next[0] = -1
        for b in range(1, n):
            self._push_tail(b)

    def __dealloc__(self):
        c_free(self._ref)
        c_free(self._prev)
        c_free(self._next)
        c_free(self._hash)
        c_free(self._has_hash)

    # ---- free queue -------------------------------------------------------------------------------

    cdef void _push_tail(self, int32_t block_id) noexcept nogil:
        cdef int32_t sentinel = self.num_blocks
        cdef int32_t tail = self._prev[sentinel]
        self._prev[block_id] = tail
        self._next[block_id] = sentinel
        self._next[tail] = block_id
        self._prev[sentinel] = block_id
        self.num_free += 1

    cdef void _unlink(self, int32_t block_id) noexcept nogil:
        cdef int32_t p = self._prev[block_id]
        cdef int32_t q = self._next[block_id]
        self._next[p] = q
        self._prev[q] = p
        self._prev[block_id] = -1
        self._next[block_id] = -1
        self.num_free -= 1

    cdef int32_t _pop_head(self) noexcept nogil:
        # Callers check num_free first.
        cdef int32_t head = self._next[self.num_blocks]
        self._unlink(head)
        return head

    # ---- hash map ---------------------------------------------------------------------------------

    cdef void _evict_hash(self, int32_t block_id) noexcept nogil:
        if self._has_hash[block_id]:
            self._hash_to_block.erase(self._hash[block_id])
            self._has_hash[block_id] = 0

    cdef int32_t _lookup(self, uint64_t block_hash) noexcept nogil:
        cdef unordered_map[uint64_t, int32_t].iterator it
        it = self._hash_to_block.find(block_hash)
        if it == self._hash_to_block.end():
            return -1
        return deref(it).second

    cdef int _register_hash(self, int32_t block_id, uint64_t block_hash) except -1:
        # insert may throw std::bad_alloc (declared except +): it becomes a MemoryError here.
        self._hash_to_block.insert(pair[uint64_t, int32_t](block_hash, block_id))
        self._hash[block_id] = block_hash
        self._has_hash[block_id] = 1
        return 0

    # ---- ref counts -------------------------------------------------------------------------------

    cdef int32_t _take_head(self) noexcept nogil:
        # The head is reused for new content, so whatever it cached is gone.
        cdef int32_t b = self._pop_head()
        self._evict_hash(b)
        self._ref[b] = 1
        return b

    cdef void _incref_one(self, int32_t block_id) noexcept nogil:
        if self._ref[block_id] == 0:
            self._unlink(block_id)  # a cached free block comes back into use, hash kept
        self._ref[block_id] += 1

    cdef void _decref_one(self, int32_t block_id) noexcept nogil:
        self._ref[block_id] -= 1
        if self._ref[block_id] == 0:
            self._push_tail(block_id)

    cdef void _undo_decref(self, int32_t block_id) noexcept nogil:
        # Exact inverse of _decref_one when undone newest first: the block is then at the tail.
        if self._ref[block_id] == 0:
            self._unlink(block_id)
        self._ref[block_id] += 1

    cdef int32_t _check_id(self, object block_id) except -1:
        cdef long long b = block_id
        if b == 0:
            raise ValueError("block 0 is reserved and never handed out")
        if b < 0 or b >= self.num_blocks:
            raise ValueError(f"block id {b} out of range [1, {self.num_blocks})")
        return <int32_t>b

    # ---- Python API -------------------------------------------------------------------------------

    @property
    def num_usable(self):
        return self.num_blocks - 1

    @property
    def num_cached(self):
        return self._hash_to_block.size()

    def can_allocate(self, Py_ssize_t n):
        return 0 <= n <= self.num_free

    def allocate(self, Py_ssize_t n):
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise MemoryError(
                f"cannot allocate {n} KV blocks: {self.num_free} of {self.num_blocks - 1} free")
        cdef list out = []
        cdef Py_ssize_t i
        for i in range(n):
            out.append(self._take_head())
        return out

    def free(self, block_ids):
        # Validate every id first, then decrement in order; a double free found part way undoes
        # the decrements already made (newest first), so an error leaves the pool unchanged.
        ids = block_ids if type(block_ids) is list or type(block_ids) is tuple else list(block_ids)
        cdef Py_ssize_t i, j, n = len(ids)
        cdef int32_t b
        for i in range(n):
            self._check_id(ids[i])
        for i in range(n):
            b = ids[i]
            if self._ref[b] == 0:
                for j in range(i - 1, -1, -1):
                    self._undo_decref(<int32_t>ids[j])
                raise ValueError(f"double free: block {b} has ref count 0")
            self._decref_one(b)

    def incref(self, block_ids):
        ids = block_ids if type(block_ids) is list or type(block_ids) is tuple else list(block_ids)
        cdef Py_ssize_t i, n = len(ids)
        for i in range(n):
            self._check_id(ids[i])
        for i in range(n):
            self._incref_one(<int32_t>ids[i])

    def ref_count(self, block_id):
        cdef long long b = block_id
        if b < 0 or b >= self.num_blocks:
            raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
        return self._ref[b]

    def copy_on_write(self, block_id):
        cdef int32_t b = self._check_id(block_id)
        if self._ref[b] == 0:
            raise ValueError(f"copy_on_write of block {b}, which is not held (ref count 0)")
        if self._ref[b] == 1:
            return b
        if self.num_free == 0:
            raise MemoryError(f"copy_on_write of block {b}: no free KV block")
        cdef int32_t fresh = self._take_head()
        self._ref[b] -= 1  # still >= 1: it stays out of the free queue
        return fresh

    def cache_block(self, block_id, uint64_t block_hash):
        # First block to register a hash wins: a second block with the same content (two requests
        # filled it at once) stays uncached and returns False.
        cdef int32_t b = self._check_id(block_id)
        if self._ref[b] == 0:
            raise ValueError(f"cache_block of block {b}, which is not held (ref count 0)")
        if self._has_hash[b]:
            if self._hash[b] == block_hash:
                return True
            raise ValueError(f"block {b} is already cached under another hash")
        if self._lookup(block_hash) >= 0:
            return False
        self._register_hash(b, block_hash)
        return True

    def lookup(self, uint64_t block_hash):
        return self._lookup(block_hash)

    def match_prefix(self, token_ids, Py_ssize_t block_size, uint64_t salt=0):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        cdef Py_ssize_t i, num_full = len(token_ids) // block_size
        cdef uint64_t parent = 0, h
        cdef int32_t b
        cdef list out = []
        for i in range(num_full):
            _hash_slice(token_ids, i * block_size, block_size, parent, salt, &h)
            b = self._lookup(h)
            if b < 0:
                break
            out.append(b)
            parent = h
        return out

    def block_hashes(self, token_ids, Py_ssize_t block_size, uint64_t salt=0):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        cdef Py_ssize_t i, num_full = len(token_ids) // block_size
        cdef uint64_t parent = 0
        cdef list out = []
        for i in range(num_full):
            _hash_slice(token_ids, i * block_size, block_size, parent, salt, &parent)
            out.append(parent)
        return out

    def free_queue(self):
        cdef int32_t sentinel = self.num_blocks
        cdef int32_t b = self._next[sentinel]
        cdef list out = []
        while b != sentinel:
            out.append(b)
            b = self._next[b]
        return out

    def __repr__(self):
        return (f"BlockPool(num_blocks={self.num_blocks}, num_free={self.num_free}, "
                f"num_cached={self.num_cached})")
