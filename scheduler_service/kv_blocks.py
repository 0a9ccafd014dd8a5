"""Per-request block tables on top of the Cython block pool, with automatic prefix caching.

A request holds ceil(num_computed_tokens / block_size) blocks after each step; its table is
append-only while it runs and released whole when it finishes, is aborted or is preempted.
Every block that fills up is registered under a hash chained on its parent and salted by the
request's cache_salt; released blocks stay in the pool's LRU free queue with their hash, so a
later request (or the same one, resumed after preemption) starting with the same tokens picks
them up instead of computing them again.
"""
from __future__ import annotations

import hashlib

from cython_ext.block_pool import BlockPool, block_hash
from scheduler_service.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def salt_of(cache_salt: str) -> int:
    """The 64-bit salt of a cache_salt string; 0 (shared by every unsalted request) for ""."""
    if not cache_salt:
        return 0
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "little")


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_usable_blocks(self) -> int:
        """Every block but the reserved block 0."""
        return self.pool.num_usable

    @property
    def capacity_tokens(self) -> int:
        return self.num_usable_blocks * self.block_size

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to append so that the request can hold `num_new_tokens` more computed tokens."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        return max(cdiv(num_tokens, self.block_size) - len(request.block_ids), 0)

    def can_allocate(self, num_blocks: int) -> bool:
        return self.pool.can_allocate(num_blocks)

    def allocate(self, request: Request, num_blocks: int) -> list[int]:
        new_block_ids = self.pool.allocate(num_blocks) if num_blocks else []
        request.block_ids.extend(new_block_ids)
        return new_block_ids

    # ---- prefix caching -------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks matching the start of a request that holds no block yet.

        Returns (block ids, how many of them sit in the free queue, i.e. would stop being free
        once taken). The last token is never matched: a step must compute at least one token
        to sample from, and it must not write into a shared block.
        """
        if not self.enable_prefix_caching:
            return [], 0
        token_ids = request.all_token_ids
        hits = self.pool.match_prefix(token_ids[:len(token_ids) - 1], self.block_size,
                                      salt_of(request.cache_salt))
        return hits, sum(1 for block in hits if self.pool.ref_count(block) == 0)

    def take_cached_prefix(self, request: Request, hits: list[int]) -> None:
        """Shares the hit blocks with the request; their tokens count as computed."""
        self.pool.incref(hits)
        num_tokens = len(hits) * self.block_size
        request.block_ids = list(hits)
        # The request's next blocks chain on the hashes of these.
        request.block_hashes = self.pool.block_hashes(
            request.all_token_ids[:num_tokens], self.block_size, salt_of(request.cache_salt))
        request.num_computed_tokens = num_tokens

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Prompt tokens a waiting request would find cached (the `lpm` policy's key)."""
        hits, _ = self.find_cached_prefix(request)
        return len(hits) * self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        """Registers every block of the request that is full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= len(request.block_hashes):
            return
        token_ids = request.all_token_ids
        salt = salt_of(request.cache_salt)
        parent = request.block_hashes[-1] if request.block_hashes else 0
        for index in range(len(request.block_hashes), num_full):
            start = index * self.block_size
            parent = block_hash(parent, token_ids[start:start + self.block_size], salt)
            self.pool.cache_block(request.block_ids[index], parent)
            request.block_hashes.append(parent)

    def free(self, request: Request) -> None:
        if request.block_ids:
            self.pool.free(request.block_ids)
            request.block_ids = []
        request.block_hashes = []
