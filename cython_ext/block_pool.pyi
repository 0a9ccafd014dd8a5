"""Python view of cython_ext/block_pool.pyx (the C contract is block_pool.pxd)."""
from collections.abc import Iterable, Sequence

def sha256(data: bytes) -> bytes:
    """The vendored SHA-256 (csrc/sha256.h, FIPS 180-4) of data: 32 bytes, on the path in use
    (sha256_impl). For tests."""

def sha256_impls() -> tuple[str, ...]:
    """The SHA-256 compression paths this build and CPU run: ("portable",) or ("portable",
    "sha-ni") (x86-64 with the SHA instructions, csrc/sha256_shani.c). Same digests on each."""

def sha256_impl() -> str:
    """The path in use: chosen at import by PLANSERVE_SHA256 (auto, the default: the best this
    CPU runs; portable; sha-ni), or later by set_sha256_impl."""

def set_sha256_impl(name: str) -> str:
    """Selects "auto", "portable" or "sha-ni" and returns the path now in use. ValueError for
    another name, or for "sha-ni" where this build or CPU lacks it (nothing changes then)."""

def block_hash(parent_hash: int, token_ids: Iterable[int], salt: int = 0) -> int:
    """SHA-256 digest, as an int in [0, 2**256), of one full block: chained on `parent_hash`
    (0 for the first block) and salted (block_pool.pyx "block hash" gives the tagged message).
    Token ids must fit uint32, digests and salts [0, 2**256) (else OverflowError)."""

def set_key_bits_for_tests(bits: int) -> None:
    """TEST ONLY: pools built afterwards index digests by their first `bits` bits (1..64;
    production 64), so that unrelated blocks collide in the index. Hits still need the full
    256-bit digest to be equal. ValueError outside [1, 64]."""

class BlockPool:
    """Ref-counted KV blocks with an LRU free queue and a prefix-cache index. Not thread safe.

    Block 0 is reserved: its ref count is pinned at 1, it is never handed out, freed or shared.
    Every block with ref count 0 sits in the free queue, cached (still hashed) or not.
    """

    def __init__(self, num_blocks: int) -> None:
        """Blocks 0 .. num_blocks - 1; ValueError unless 1 <= num_blocks <= 2**31 - 2."""
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free(self) -> int:
        """Blocks with ref count 0, cached or not (the free queue's length)."""
    @property
    def num_usable(self) -> int:
        """num_blocks - 1: every block but the reserved block 0."""
    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix-cache index (held or free)."""
    @property
    def key_bits(self) -> int:
        """Bits of a digest the index keys on: 64 unless set_key_bits_for_tests changed it."""
    def can_allocate(self, n: int) -> bool: ...
    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the head of the free queue (least recently freed first), each with
        ref count 1 and its cached hash, if any, evicted. MemoryError, with nothing taken, if fewer
        than n are free; ValueError if n < 0."""
    def free(self, block_ids: Iterable[int]) -> None:
        """Decrement each id's ref count, in order; a block reaching 0 goes to the tail of the free
        queue (keeping its hash). ValueError for block 0, an id out of range, or a block already at
        ref count 0 (counting repeats in block_ids); on any error the pool is left unchanged."""
    def incref(self, block_ids: Iterable[int]) -> None:
        """Increment each id's ref count (sharing: prefix hits, forks). A block at ref count 0
        (cached, in the free queue) leaves the queue and keeps its hash. ValueError for block 0 or
        an id out of range, with nothing changed."""
    def ref_count(self, block_id: int) -> int:
        """The block's ref count (block 0: 1). ValueError if out of range."""
    def copy_on_write(self, block_id: int) -> int:
        """If the block is shared (ref count > 1): allocate a fresh block, decrement the old one,
        return the new id (the caller asks the model service to copy). Otherwise return block_id.
        ValueError if the block is not held; MemoryError, with nothing changed, if no block is
        free."""
    def cache_block(self, block_id: int, block_hash: int, parent_hash: int | None = None,
                    token_ids: Sequence[int] | None = None) -> bool:
        """Register a held, FULL block under its digest. True if the block is now the one cached
        for the digest (also when it already was); False, with nothing changed, when another
        block already holds that digest or its index key. ValueError if the block is not held or
        is already cached under a different digest. With token_ids (and the parent's digest,
        None for a first block), a block cached just now is logged for the events."""
    def lookup(self, block_hash: int) -> int:
        """The block cached under exactly this digest (all 256 bits compared), or -1."""
    def match_prefix(self, token_ids: Sequence[int], block_size: int, salt: int = 0,
                     num_tokens: int | None = None) -> list[int]:
        """Block ids of the longest chain of cached full blocks matching the start of token_ids
        (or of token_ids[:num_tokens], without a copy; ValueError outside [0, len]). Every
        digest compared in full. Does not incref: the caller increfs what it keeps. Stops
        hashing at the first miss."""
    def num_unheld(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks have ref count 0 (in the free queue: taking them, as prefix
        hits, leaves fewer free). ValueError for an invalid id."""
    def block_hashes(self, token_ids: Sequence[int], block_size: int, salt: int = 0) -> list[int]:
        """The chained digests of every full block of token_ids (what cache_block wants)."""
    def enable_events(self, block_size: int) -> None:
        """Starts the event log (take_events) for blocks of block_size tokens."""
    def take_events(self) -> tuple[list[tuple[int, int | None, int | None, list[int]]], bool]:
        """(events, lost) since the last call, oldest first; empties the log. An event is (kind,
        digest, parent digest or None, token ids): 1 STORED, 2 REMOVED, 3 CLEARED. lost: some
        events were not logged (memory): re-announce the cache with cached_block_events."""
    def cached_block_events(self) -> list[tuple[int, int | None, int | None, list[int]]]:
        """A STORED event for every cached block whose caching was logged, in block order."""
    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block while no block is held (True); else False, no change."""
    def free_queue(self) -> list[int]:
        """The free queue, head (next to be allocated) first. O(num_free): for tests and debugging."""
