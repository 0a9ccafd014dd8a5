"""Pure-Python oracle for cython_ext.block_pool: the same API, the same decisions, written plainly.

The free queue is an OrderedDict (insertion order = free order, head first), the prefix cache two
dicts and the key index. The hash is hashlib.sha256 over the same tagged message as block_pool.pyx
(see its "block hash" table), so for an identical call sequence both give identical digests, block
ids and exceptions (types, not messages). Slow on purpose: clarity over speed.
"""
from __future__ import annotations

import hashlib
import operator
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

INT32_MAX = (1 << 31) - 1
KEY_BITS = 64  # the index key: a digest's first 64 bits (tests may shorten it, as in the pool)


def _as_uint(value: object, bits: int) -> int:
    # Cython's conversion to uintN_t: TypeError for non-integers, OverflowError outside [0, 2**bits).
    v = operator.index(value)
    if not 0 <= v < (1 << bits):
        raise OverflowError(f"{v} does not fit uint{bits}")
    return v


def _as_int(value: object, bits: int) -> int:
    v = operator.index(value)
    if not -(1 << (bits - 1)) <= v < (1 << (bits - 1)):
        raise OverflowError(f"{v} does not fit int{bits}")
    return v


def block_hash(parent_hash: int, token_ids: Iterable[int], salt: int = 0) -> int:
    """SHA-256 of b"S" salt(32, big-endian) b"P" parent(32) b"T" n(uint32 LE) tokens(uint32 LE)."""
    parent_hash = _as_uint(parent_hash, 256)
    salt = _as_uint(salt, 256)
    tokens = [_as_uint(t, 32) for t in token_ids]
    message = (b"S" + salt.to_bytes(32, "big") + b"P" + parent_hash.to_bytes(32, "big")
               + b"T" + struct.pack("<I", len(tokens)) + struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(hashlib.sha256(message).digest(), "big")


def digest_key(digest: int, key_bits: int = KEY_BITS) -> int:
    return digest >> (256 - key_bits)


class OracleBlockPool:
    def __init__(self, num_blocks: int, key_bits: int = KEY_BITS) -> None:
        if not 1 <= num_blocks <= INT32_MAX - 1:
            raise ValueError(f"num_blocks must be in [1, {INT32_MAX - 1}], got {num_blocks}")
        self.num_blocks = operator.index(num_blocks)
        self.ref = [0] * self.num_blocks
        self.ref[0] = 1  # reserved block, pinned
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, self.num_blocks))
        self.key_bits = key_bits
        self.hash_to_block: dict[int, int] = {}   # full digest -> block
        self.block_to_hash: dict[int, int] = {}
        self.keys: set[int] = set()               # index keys in use (first key_bits of a digest)
        # The event log (enable_events): (kind, digest, parent, tokens), kind 1 STORED,
        # 2 REMOVED, 3 CLEARED; and per cached block what its STORED event said.
        self.block_size = 0
        self.events: list[tuple] = []
        self.logged: dict[int, tuple[int | None, list[int]]] = {}

    # ---- helpers ----

    def _check(self, block_id: object) -> int:
        b = _as_int(block_id, 64)
        if b == 0:
            raise ValueError("block 0 is reserved")
        if not 0 < b < self.num_blocks:
            raise ValueError(f"block id {b} out of range")
        return b

    def _evict(self, b: int, log: bool = True) -> None:
        h = self.block_to_hash.pop(b, None)
        if h is not None:
            if self.block_size and log:
                self.events.append((2, h, None, []))
            self.logged.pop(b, None)
            del self.hash_to_block[h]
            self.keys.discard(digest_key(h, self.key_bits))

    # ---- API ----

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached(self) -> int:
        return len(self.hash_to_block)

    def can_allocate(self, n: int) -> bool:
        n = _as_int(n, 64)
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        n = _as_int(n, 64)
        if n < 0:
            raise ValueError("negative n")
        if n > self.num_free:
            raise MemoryError(f"cannot allocate {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            b, _ = self.free_blocks.popitem(last=False)
            self._evict(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        ids = [self._check(b) for b in block_ids]
        for b, count in Counter(ids).items():
            if count > self.ref[b]:
                raise ValueError(f"double free of block {b}")
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_blocks[b] = None  # appended at the tail

    def incref(self, block_ids: Iterable[int]) -> None:
        ids = [self._check(b) for b in block_ids]
        for b in ids:
            if self.ref[b] == 0:
                del self.free_blocks[b]
            self.ref[b] += 1

    def ref_count(self, block_id: int) -> int:
        b = _as_int(block_id, 64)
        if not 0 <= b < self.num_blocks:
            raise ValueError(f"block id {b} out of range")
        return self.ref[b]

    def copy_on_write(self, block_id: int) -> int:
        b = self._check(block_id)
        if self.ref[b] == 0:
            raise ValueError(f"block {b} not held")
        if self.ref[b] == 1:
            return b
        (fresh,) = self.allocate(1)
        self.ref[b] -= 1
        return fresh

    def cache_block(self, block_id: int, block_hash: int, parent_hash: int | None = None,
                    token_ids: Sequence[int] | None = None) -> bool:
        h = _as_uint(block_hash, 256)
        b = self._check(block_id)
        if self.ref[b] == 0:
            raise ValueError(f"block {b} not held")
        parent = None if parent_hash is None else _as_uint(parent_hash, 256)
        tokens = None if token_ids is None else [_as_uint(t, 32) for t in token_ids]
        was_cached = b in self.block_to_hash
        cached = self._cache(b, h)
        if cached and not was_cached and tokens is not None and self.block_size:
            if len(tokens) == self.block_size:
                self.logged[b] = (parent, tokens)
            self.events.append((1, h, parent, tokens))
        return cached

    def _cache(self, b: int, h: int) -> bool:
        if b in self.block_to_hash:
            if self.block_to_hash[b] == h:
                return True
            raise ValueError(f"block {b} already cached under another hash")
        if digest_key(h, self.key_bits) in self.keys:
            return False  # the digest, or another with the same key, is cached already
        self.keys.add(digest_key(h, self.key_bits))
        self.hash_to_block[h] = b
        self.block_to_hash[b] = h
        return True

    def lookup(self, block_hash: int) -> int:
        return self.hash_to_block.get(_as_uint(block_hash, 256), -1)

    def block_hashes(self, token_ids: Sequence[int], block_size: int, salt: int = 0) -> list[int]:
        block_size = _as_int(block_size, 64)
        salt = _as_uint(salt, 256)
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        hashes, parent = [], 0
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            parent = block_hash(parent, token_ids[start : start + block_size], salt)
            hashes.append(parent)
        return hashes

    def match_prefix(self, token_ids: Sequence[int], block_size: int, salt: int = 0,
                     num_tokens: int | None = None) -> list[int]:
        block_size = _as_int(block_size, 64)
        salt = _as_uint(salt, 256)
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if num_tokens is not None:
            if not 0 <= num_tokens <= len(token_ids):
                raise ValueError(f"num_tokens must be in [0, {len(token_ids)}], got {num_tokens}")
            token_ids = token_ids[:num_tokens]
        out, parent = [], 0
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            h = block_hash(parent, token_ids[start : start + block_size], salt)
            b = self.hash_to_block.get(h, -1)
            if b < 0:
                break
            out.append(b)
            parent = h
        return out

    def num_unheld(self, block_ids: Sequence[int]) -> int:
        return sum(1 for b in block_ids if self.ref[self._check(b)] == 0)

    def reset_prefix_cache(self) -> bool:
        if self.num_free != self.num_blocks - 1:
            return False
        for b in list(self.block_to_hash):
            self._evict(b, log=False)
        if self.block_size:
            self.events.append((3, None, None, []))
        return True

    def enable_events(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if self.block_size and block_size != self.block_size:
            raise ValueError("enable_events: already enabled with another block_size")
        self.block_size = block_size

    def take_events(self) -> tuple[list[tuple], bool]:
        events, self.events = self.events, []
        return events, False

    def cached_block_events(self) -> list[tuple]:
        return [(1, self.block_to_hash[b], *self.logged[b])
                for b in sorted(self.logged) if b in self.block_to_hash]

    def free_queue(self) -> list[int]:
        return list(self.free_blocks)
