# distutils: language = c++
# distutils: depends = cython_ext/csrc/sha256.h cython_ext/csrc/sha256_k.h cython_ext/csrc/sha256_shani.c
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

Prefix cache: every full block may carry a 256-bit digest (block hash, below) that commits to its
salt, its whole prefix and its tokens. `_key_to_block` is an index: it maps the digest's first 64
bits (the key) to the block; a lookup compares the full 256-bit digest before it answers, so two
blocks share KV only if their digests are equal. A block has a digest iff the index points back at
it, so evicting (allocate reusing the block) erases exactly one entry. Two digests with the same
key (by chance 2**-64; on purpose a 64-bit second preimage of SHA-256) cannot both be cached: the
first keeps the key and the second stays uncached, which costs a cache miss, never a wrong hit.
"""
from cython.operator cimport dereference as deref
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.number cimport PyNumber_Index
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free as c_free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset
from libcpp.unordered_map cimport unordered_map
from libcpp.utility cimport pair

# ---- block hash -----------------------------------------------------------------------------------
#
# SHA-256 (FIPS 180-4; csrc/sha256.h, written for planserve from the standard) over one message per
# block. Every field starts with its own tag byte and has a fixed or stated length, so no two
# different (salt, parent, tokens) can produce the same message, and a future key (a LoRA id, an
# image hash) gets a new tag rather than sharing bytes with an old one:
#
#     offset   0      1 .. 32     33     34 .. 65      66     67 .. 70          71 ..
#     field    'S'    salt        'P'    parent        'T'    n (uint32 LE)     n token ids (uint32 LE)
#
# parent is the digest of the previous block, all zeros for the first. salt is 256 bits: 0 for the
# global cache, else SHA-256 of the request's cache_salt and (scope "tenant") tenant, made by
# scheduler_service/core/kv_blocks.py. A block of 16 tokens is 135 bytes: 3 SHA-256 compressions.
# tests/scheduler/block_pool_oracle.py repeats this with hashlib.sha256; both must change together.
#
# The compression runs on the CPU's SHA instructions where it has them (csrc/sha256_shani.c),
# else on the portable C; the same digests either way (tests hold both to FIPS 180-4 and hashlib).
# PLANSERVE_SHA256=portable|sha-ni|auto (default auto) picks at import; set_sha256_impl at run time.
cdef extern from "csrc/sha256.h" nogil:
    ctypedef struct ps_sha256_ctx:
        pass
    void ps_sha256_init(ps_sha256_ctx* ctx)
    void ps_sha256_update(ps_sha256_ctx* ctx, const void* data, size_t len)
    void ps_sha256_final(ps_sha256_ctx* ctx, uint8_t* out)
    size_t ps_sha256_padded_len(size_t len)
    void ps_sha256_padded(uint8_t* msg, size_t len, uint8_t* out)
    int ps_sha256_select(int which)
    int ps_sha256_cpu_has_shani()
    int PS_SHA256_HAVE_SHANI

cdef extern from *:
    """
    /* Token ids go in as little-endian uint32: straight from the array on a little-endian host. */
    static void ps_hash_tokens_le(ps_sha256_ctx* ctx, const uint32_t* tokens, size_t n) {
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        ps_sha256_update(ctx, tokens, 4 * n);
    #else
        uint8_t le[4];
        size_t i;
        for (i = 0; i < n; i++) {
            le[0] = (uint8_t)tokens[i]; le[1] = (uint8_t)(tokens[i] >> 8);
            le[2] = (uint8_t)(tokens[i] >> 16); le[3] = (uint8_t)(tokens[i] >> 24);
            ps_sha256_update(ctx, le, 4);
        }
    #endif
    }
    /* The same bytes written into a message buffer (the one-shot path). */
    static void ps_put_tokens_le(uint8_t* dst, const uint32_t* tokens, size_t n) {
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        memcpy(dst, tokens, 4 * n);
    #else
        size_t i;
        for (i = 0; i < n; i++) {
            dst[4 * i] = (uint8_t)tokens[i]; dst[4 * i + 1] = (uint8_t)(tokens[i] >> 8);
            dst[4 * i + 2] = (uint8_t)(tokens[i] >> 16); dst[4 * i + 3] = (uint8_t)(tokens[i] >> 24);
        }
    #endif
    }
    """
    void ps_hash_tokens_le(ps_sha256_ctx* ctx, const uint32_t* tokens, size_t n) nogil
    void ps_put_tokens_le(uint8_t* dst, const uint32_t* tokens, size_t n) nogil

cdef Digest _ZERO  # static storage: all zeros (no parent, no salt)

# Messages up to this many bytes once padded are built whole on the stack and hashed in one call
# (no streaming copies): every block of up to 108 tokens. Longer blocks stream.
cdef enum:
    _ONE_SHOT_BYTES = 512
    _HEADER_BYTES = 71   # 'S' salt 'P' parent 'T' n


cdef void hash_block(const Digest* parent, const Digest* salt, const uint32_t* token_ids,
                     Py_ssize_t num_tokens, Digest* out) noexcept nogil:
    cdef ps_sha256_ctx ctx
    cdef uint8_t msg[_ONE_SHOT_BYTES]
    cdef uint32_t n = <uint32_t>num_tokens
    cdef size_t length = _HEADER_BYTES + 4 * <size_t>num_tokens
    if parent == NULL:
        parent = &_ZERO
    if salt == NULL:
        salt = &_ZERO
    msg[0] = 0x53  # 'S'
    memcpy(&msg[1], salt.b, 32)
    msg[33] = 0x50  # 'P'
    memcpy(&msg[34], parent.b, 32)
    msg[66] = 0x54  # 'T'
    msg[67] = <uint8_t>n
    msg[68] = <uint8_t>(n >> 8)
    msg[69] = <uint8_t>(n >> 16)
    msg[70] = <uint8_t>(n >> 24)
    if ps_sha256_padded_len(length) <= _ONE_SHOT_BYTES:
        ps_put_tokens_le(&msg[_HEADER_BYTES], token_ids, <size_t>num_tokens)
        ps_sha256_padded(msg, length, out.b)
        return
    ps_sha256_init(&ctx)
    ps_sha256_update(&ctx, msg, _HEADER_BYTES)
    ps_hash_tokens_le(&ctx, token_ids, <size_t>num_tokens)
    ps_sha256_final(&ctx, out.b)


# Which compression path: names as set_sha256_impl takes them.
_IMPL_NAMES = ("portable", "sha-ni")


def sha256_impls():
    """The SHA-256 paths this build and CPU run: ("portable",) or ("portable", "sha-ni")."""
    if PS_SHA256_HAVE_SHANI and ps_sha256_cpu_has_shani():
        return _IMPL_NAMES
    return _IMPL_NAMES[:1]


cdef int _impl = ps_sha256_select(-1)


def sha256_impl():
    """The SHA-256 path in use: "portable" or "sha-ni"."""
    return _IMPL_NAMES[_impl]


def set_sha256_impl(str name):
    """Selects the compression path: "auto" (the best this CPU runs), "portable" or "sha-ni".
    Returns the one in use. ValueError for another name, or "sha-ni" where it cannot run. Digests
    are the same on every path; this exists for tests and as an operator's escape hatch."""
    global _impl
    cdef int which
    if name == "auto":
        which = -1
    elif name in _IMPL_NAMES:
        which = _IMPL_NAMES.index(name)
    else:
        raise ValueError(f"SHA-256 path must be one of auto, portable, sha-ni; got {name!r}")
    cdef int got = ps_sha256_select(which)
    if got < 0:
        raise ValueError("SHA-256 path sha-ni: this build or CPU has no SHA instructions "
                         f"(available: {', '.join(sha256_impls())})")
    _impl = got
    return _IMPL_NAMES[_impl]


def _select_from_env():
    import os
    name = os.environ.get("PLANSERVE_SHA256", "auto").strip().lower() or "auto"
    set_sha256_impl(name)


_select_from_env()


cdef int digest_from_int(object value, Digest* out, str name) except -1:
    # Python's view of a digest (or salt) is an int in [0, 2**256), big-endian bytes.
    cdef bytes raw
    try:
        raw = PyNumber_Index(value).to_bytes(32, "big")  # TypeError for a non-integer
    except OverflowError:
        raise OverflowError(f"{name} must be in [0, 2**256), got {value}") from None
    memcpy(out.b, PyBytes_AS_STRING(raw), 32)
    return 0


cdef object digest_to_int(const Digest* d):
    return int.from_bytes(PyBytes_FromStringAndSize(<const char*>d.b, 32), "big")


cdef inline uint64_t _digest_key(const Digest* d, int shift) noexcept nogil:
    # The first 64 bits, big-endian, shifted down when tests truncate the key.
    cdef uint64_t k = 0
    cdef int i
    for i in range(8):
        k = (k << 8) | d.b[i]
    return k >> shift


# Test-only: pools built after set_key_bits_for_tests(bits) index digests by their first `bits`
# bits, so unrelated blocks collide in the index and tests can show a collision never shares KV.
cdef int _new_pool_key_bits = 64


def set_key_bits_for_tests(int bits):
    """TEST ONLY. Index key width for pools built from now on (production: 64, the default)."""
    global _new_pool_key_bits
    if not 1 <= bits <= 64:
        raise ValueError(f"key bits must be in [1, 64], got {bits}")
    _new_pool_key_bits = bits


def sha256(const uint8_t[::1] data not None):
    """The vendored SHA-256 of `data` (bytes): exposed so tests hold it to FIPS 180-4's examples."""
    cdef ps_sha256_ctx ctx
    cdef Digest out
    ps_sha256_init(&ctx)
    if data.shape[0]:
        ps_sha256_update(&ctx, &data[0], data.shape[0])
    ps_sha256_final(&ctx, out.b)
    return PyBytes_FromStringAndSize(<const char*>out.b, 32)


def block_hash(parent_hash, token_ids, salt=0):
    """SHA-256 digest (as an int) of one full block: chained on `parent_hash` (0 for the first
    block) and salted."""
    cdef Digest parent, s, out
    digest_from_int(parent_hash, &parent, "parent_hash")
    digest_from_int(salt, &s, "salt")
    cdef list toks = list(token_ids)
    cdef Py_ssize_t i, n = len(toks)
    cdef uint32_t* buf = <uint32_t*>malloc((n + 1) * sizeof(uint32_t))
    if buf == NULL:
        raise MemoryError("cannot allocate a token buffer")
    try:
        for i in range(n):
            buf[i] = toks[i]
        hash_block(&parent, &s, buf, n, &out)
    finally:
        c_free(buf)
    return digest_to_int(&out)


# Event kinds of the log (take_events): vLLM's BlockStored, BlockRemoved, AllBlocksCleared.
cdef enum:
    EV_STORED = 1
    EV_REMOVED = 2
    EV_CLEARED = 3


cdef inline int _grow(void** array, Py_ssize_t count, size_t item_size) noexcept nogil:
    # realloc in place of *array; 0 (and *array unchanged) when memory runs out.
    cdef void* p = realloc(array[0], count * item_size)
    if p == NULL:
        return 0
    array[0] = p
    return 1


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
        self._digest = <Digest*>calloc(n, sizeof(Digest))
        self._has_hash = <uint8_t*>calloc(n, sizeof(uint8_t))
        self._key_shift = 64 - _new_pool_key_bits
        self._scratch = NULL
        self._scratch_cap = 0
        self._record = self._clearing = self._ev_lost = 0
        self._ev_block_size = 0
        self._ev_n = self._ev_cap = 0
        self._ev_tok_len = self._ev_tok_cap = 0
        self._ev_kind = self._ev_has_parent = NULL
        self._ev_digest = self._ev_parent = NULL
        self._ev_tok_start = NULL
        self._ev_tok_n = NULL
        self._ev_tokens = NULL
        self._blk_parent = NULL
        self._blk_has_parent = self._blk_logged = NULL
        self._blk_tokens = NULL
        if not (self._ref and self._prev and self._next and self._digest and self._has_hash):
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
        c_free(self._digest)
        c_free(self._has_hash)
        c_free(self._scratch)
        c_free(self._ev_kind)
        c_free(self._ev_digest)
        c_free(self._ev_parent)
        c_free(self._ev_has_parent)
        c_free(self._ev_tok_start)
        c_free(self._ev_tok_n)
        c_free(self._ev_tokens)
        c_free(self._blk_parent)
        c_free(self._blk_has_parent)
        c_free(self._blk_logged)
        c_free(self._blk_tokens)

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
            if self._record:
                if not self._clearing:
                    self._log(EV_REMOVED, &self._digest[block_id])
                self._blk_logged[block_id] = 0
            self._key_to_block.erase(_digest_key(&self._digest[block_id], self._key_shift))
            self._has_hash[block_id] = 0

    cdef int32_t _lookup(self, const Digest* digest) noexcept nogil:
        # The index finds a candidate by key; only an equal 256-bit digest makes it a hit.
        cdef unordered_map[uint64_t, int32_t].iterator it
        cdef int32_t b
        it = self._key_to_block.find(_digest_key(digest, self._key_shift))
        if it == self._key_to_block.end():
            return -1
        b = deref(it).second
        if memcmp(self._digest[b].b, digest.b, 32) != 0:
            return -1
        return b

    cdef int _cache(self, int32_t block_id, const Digest* digest) except -1:
        # The block is held and full. First block to register a digest (or a key) wins: a second
        # block with the same content (two requests filled it at once), or a different digest
        # whose key is taken, stays uncached (returns 0).
        if self._has_hash[block_id]:
            if memcmp(self._digest[block_id].b, digest.b, 32) == 0:
                return 1
            raise ValueError(f"block {block_id} is already cached under another hash")
        cdef uint64_t key = _digest_key(digest, self._key_shift)
        if self._key_to_block.count(key):
            return 0
        # insert may throw std::bad_alloc: Cython turns it into a MemoryError here.
        self._key_to_block.insert(pair[uint64_t, int32_t](key, block_id))
        self._digest[block_id] = digest[0]
        self._has_hash[block_id] = 1
        return 1

    cdef int _cache_logged(self, int32_t block_id, const Digest* digest, const Digest* parent,
                           const uint32_t* token_ids, Py_ssize_t num_tokens) except -1:
        cdef uint8_t was_cached = self._has_hash[block_id]
        cdef int cached = self._cache(block_id, digest)
        if cached == 1 and not was_cached and self._record:
            self._log_stored(block_id, parent, token_ids, num_tokens)
        return cached

    # ---- event log --------------------------------------------------------------------------------
    #
    # With enable_events, every change of the prefix cache is appended here in the order it
    # happens: STORED when a full block becomes cached (with its parent digest and tokens, as
    # vLLM's BlockStored carries them), REMOVED when a cached block is evicted for reuse, CLEARED
    # for reset_prefix_cache. The scheduler drains it after each step (take_events) into one
    # published batch (scheduler_service/engine/kv_events.py). Appends run inside nogil paths
    # (_evict_hash under _take_head), so a failed growth cannot raise: it sets _ev_lost, and the
    # publisher then clears and re-announces every cached block from the per-block copies.

    cdef int _ev_reserve(self, Py_ssize_t num_events, int64_t num_tokens) noexcept nogil:
        cdef Py_ssize_t cap
        cdef int64_t tok_cap
        if self._ev_lost:
            return 0
        if self._ev_n + num_events > self._ev_cap:
            cap = 2 * self._ev_cap if 2 * self._ev_cap > 64 else 64
            if cap < self._ev_n + num_events:
                cap = self._ev_n + num_events
            if not (_grow(<void**>&self._ev_kind, cap, sizeof(uint8_t))
                    and _grow(<void**>&self._ev_digest, cap, sizeof(Digest))
                    and _grow(<void**>&self._ev_parent, cap, sizeof(Digest))
                    and _grow(<void**>&self._ev_has_parent, cap, sizeof(uint8_t))
                    and _grow(<void**>&self._ev_tok_start, cap, sizeof(int64_t))
                    and _grow(<void**>&self._ev_tok_n, cap, sizeof(int32_t))):
                self._ev_lost = 1
                return 0
            self._ev_cap = cap
        if self._ev_tok_len + num_tokens > self._ev_tok_cap:
            tok_cap = 2 * self._ev_tok_cap if 2 * self._ev_tok_cap > 1024 else 1024
            if tok_cap < self._ev_tok_len + num_tokens:
                tok_cap = self._ev_tok_len + num_tokens
            if not _grow(<void**>&self._ev_tokens, tok_cap, sizeof(uint32_t)):
                self._ev_lost = 1
                return 0
            self._ev_tok_cap = tok_cap
        return 1

    cdef void _log_stored(self, int32_t block_id, const Digest* parent,
                          const uint32_t* token_ids, Py_ssize_t num_tokens) noexcept nogil:
        cdef Py_ssize_t i
        if num_tokens == self._ev_block_size:  # kept for a re-announcement
            memcpy(&self._blk_tokens[<int64_t>block_id * self._ev_block_size], token_ids,
                   num_tokens * sizeof(uint32_t))
            self._blk_has_parent[block_id] = parent != NULL
            if parent != NULL:
                self._blk_parent[block_id] = parent[0]
            self._blk_logged[block_id] = 1
        if not self._ev_reserve(1, num_tokens):
            return
        i = self._ev_n
        self._ev_kind[i] = EV_STORED
        self._ev_digest[i] = self._digest[block_id]
        self._ev_has_parent[i] = parent != NULL
        if parent != NULL:
            self._ev_parent[i] = parent[0]
        self._ev_tok_start[i] = self._ev_tok_len
        self._ev_tok_n[i] = <int32_t>num_tokens
        memcpy(&self._ev_tokens[self._ev_tok_len], token_ids, num_tokens * sizeof(uint32_t))
        self._ev_tok_len += num_tokens
        self._ev_n += 1

    cdef void _log(self, uint8_t kind, const Digest* digest) noexcept nogil:
        cdef Py_ssize_t i
        if not self._ev_reserve(1, 0):
            return
        i = self._ev_n
        self._ev_kind[i] = kind
        if digest != NULL:
            self._ev_digest[i] = digest[0]
        self._ev_has_parent[i] = 0
        self._ev_tok_n[i] = 0
        self._ev_n += 1

    def enable_events(self, int block_size):
        """Starts the event log (take_events) for blocks of `block_size` tokens."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if self._record:
            if block_size != self._ev_block_size:
                raise ValueError("enable_events: already enabled with another block_size")
            return
        self._blk_parent = <Digest*>calloc(self.num_blocks, sizeof(Digest))
        self._blk_has_parent = <uint8_t*>calloc(self.num_blocks, sizeof(uint8_t))
        self._blk_logged = <uint8_t*>calloc(self.num_blocks, sizeof(uint8_t))
        self._blk_tokens = <uint32_t*>calloc(<size_t>self.num_blocks * block_size, sizeof(uint32_t))
        if not (self._blk_parent and self._blk_has_parent and self._blk_logged and self._blk_tokens):
            raise MemoryError("cannot allocate the event log's per-block copies")
        self._ev_block_size = block_size
        self._record = 1

    def take_events(self):
        """(events, lost) since the last call, oldest first, and empties the log. An event is
        (kind, digest, parent digest or None, token ids): kind 1 STORED, 2 REMOVED (digest only),
        3 CLEARED (neither). lost: some events could not be logged (memory); the batch is then
        incomplete and the caller must re-announce the cache (cached_block_events)."""
        cdef Py_ssize_t i
        cdef int64_t j, start
        cdef list events = []
        for i in range(self._ev_n):
            kind = self._ev_kind[i]
            if kind == EV_STORED:
                start = self._ev_tok_start[i]
                events.append((
                    EV_STORED,
                    digest_to_int(&self._ev_digest[i]),
                    digest_to_int(&self._ev_parent[i]) if self._ev_has_parent[i] else None,
                    [self._ev_tokens[j] for j in range(start, start + self._ev_tok_n[i])],
                ))
            elif kind == EV_REMOVED:
                events.append((EV_REMOVED, digest_to_int(&self._ev_digest[i]), None, []))
            else:
                events.append((EV_CLEARED, None, None, []))
        lost = bool(self._ev_lost)
        self._ev_n = 0
        self._ev_tok_len = 0
        self._ev_lost = 0
        return events, lost

    def cached_block_events(self):
        """A STORED event for every cached block whose caching was logged, in block order."""
        cdef int32_t b
        cdef int64_t j, start
        cdef list events = []
        if not self._record:
            return events
        for b in range(1, self.num_blocks):
            if self._has_hash[b] and self._blk_logged[b]:
                start = <int64_t>b * self._ev_block_size
                events.append((
                    EV_STORED,
                    digest_to_int(&self._digest[b]),
                    digest_to_int(&self._blk_parent[b]) if self._blk_has_parent[b] else None,
                    [self._blk_tokens[j] for j in range(start, start + self._ev_block_size)],
                ))
        return events

    cdef uint32_t* _tokens_of(self, object token_ids, Py_ssize_t start,
                              Py_ssize_t n) except NULL:
        # token_ids[start : start + n] as uint32 in a scratch buffer the pool keeps. A list (what
        # the scheduler passes) is read item by item without the generic indexing call.
        cdef void* p
        cdef Py_ssize_t j
        cdef list as_list
        if n > self._scratch_cap:
            p = realloc(self._scratch, n * sizeof(uint32_t))
            if p == NULL:
                raise MemoryError("cannot grow the block pool's token buffer")
            self._scratch = <uint32_t*>p
            self._scratch_cap = n
        if type(token_ids) is list:
            as_list = <list>token_ids
            if start + n > len(as_list):
                raise IndexError("list index out of range")
            for j in range(n):
                self._scratch[j] = as_list[start + j]
        else:
            for j in range(n):
                self._scratch[j] = token_ids[start + j]
        return self._scratch

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
        return self._key_to_block.size()

    @property
    def key_bits(self):
        return 64 - self._key_shift

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

    def cache_block(self, block_id, block_hash, parent_hash=None, token_ids=None):
        cdef Digest d, parent
        cdef uint32_t* tokens
        digest_from_int(block_hash, &d, "block_hash")
        cdef int32_t b = self._check_id(block_id)
        if self._ref[b] == 0:
            raise ValueError(f"cache_block of block {b}, which is not held (ref count 0)")
        if token_ids is None:
            return self._cache(b, &d) == 1
        if parent_hash is not None:
            digest_from_int(parent_hash, &parent, "parent_hash")
        tokens = self._tokens_of(token_ids, 0, len(token_ids))
        return self._cache_logged(b, &d, &parent if parent_hash is not None else NULL, tokens,
                                  len(token_ids)) == 1

    def lookup(self, block_hash):
        cdef Digest d
        digest_from_int(block_hash, &d, "block_hash")
        return self._lookup(&d)

    def match_prefix(self, token_ids, Py_ssize_t block_size, salt=0, num_tokens=None):
        # num_tokens: match within token_ids[:num_tokens] without the caller copying a slice.
        cdef Digest s, h, parent
        digest_from_int(salt, &s, "salt")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        cdef Py_ssize_t n = len(token_ids)
        if num_tokens is not None:
            if not 0 <= num_tokens <= n:
                raise ValueError(f"num_tokens must be in [0, {n}], got {num_tokens}")
            n = num_tokens
        cdef Py_ssize_t i, num_full = n // block_size
        cdef int32_t b
        cdef uint32_t* toks
        cdef list out = []
        for i in range(num_full):
            toks = self._tokens_of(token_ids, i * block_size, block_size)
            hash_block(&parent if i > 0 else NULL, &s, toks, block_size, &h)
            b = self._lookup(&h)
            if b < 0:
                break
            out.append(b)
            parent = h
        return out

    def block_hashes(self, token_ids, Py_ssize_t block_size, salt=0):
        cdef Digest s, h, parent
        digest_from_int(salt, &s, "salt")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        cdef Py_ssize_t i, num_full = len(token_ids) // block_size
        cdef uint32_t* toks
        cdef list out = []
        for i in range(num_full):
            toks = self._tokens_of(token_ids, i * block_size, block_size)
            hash_block(&parent if i > 0 else NULL, &s, toks, block_size, &h)
            out.append(digest_to_int(&h))
            parent = h
        return out

    def num_unheld(self, block_ids):
        # How many of these blocks have ref count 0 (taking them would shrink num_free): one C
        # loop instead of a ref_count call per prefix hit.
        ids = block_ids if type(block_ids) is list or type(block_ids) is tuple else list(block_ids)
        cdef Py_ssize_t i, count = 0, n = len(ids)
        for i in range(n):
            if self._ref[self._check_id(ids[i])] == 0:
                count += 1
        return count

    def reset_prefix_cache(self):
        """Forgets every cached block (the hash index empties), as vLLM's reset_prefix_cache: only
        while no block is held, else False and nothing changes (a held block's hash would then
        be missing from the index while a sequence still counts it as cached)."""
        cdef int32_t b
        if self.num_free != self.num_blocks - 1:
            return False
        self._clearing = 1  # one CLEARED event, not a REMOVED per block
        for b in range(1, self.num_blocks):
            self._evict_hash(b)
        self._clearing = 0
        if self._record:
            self._log(EV_CLEARED, NULL)
        return True

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
