"""The scheduler's KV blocks: the Cython block pool and prefix-cache lookups for waiting requests.

A running request holds ceil(num_computed_tokens / block_size) blocks after each step; its table
lives in cython_ext/step_core.pyx (per slot, mirrored to Request.block_ids), is append-only while
it runs and released whole when it finishes, is aborted or is preempted. Every block that fills up
is registered (by step_core, in update) under a hash chained on its parent and salted by the
request's cache_salt; released blocks stay in the pool's LRU free queue with their hash, so a
later request (or the same one, resumed after preemption) starting with the same tokens picks
them up instead of computing them again. This module answers the questions asked before a
request runs: which cached blocks would it start with.
"""
from __future__ import annotations

import hashlib

from cython_ext.block_pool import BlockPool
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

    # ---- prefix caching -------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks matching the start of a request that holds no block yet.

        Returns (block ids, how many of them sit in the free queue, i.e. would stop being free
        once taken). The last token is never matched: a step must compute at least one token
        to sample from, and it must not write into a shared block.
        """
        if not self.enable_prefix_caching or request.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position computed.
            return [], 0
        token_ids = request.all_token_ids
        hits = self.pool.match_prefix(token_ids[:len(token_ids) - 1], self.block_size,
                                      salt_of(request.cache_salt))
        return hits, sum(1 for block in hits if self.pool.ref_count(block) == 0)

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Prompt tokens a waiting request would find cached (the `lpm` policy's key)."""
        hits, _ = self.find_cached_prefix(request)
        return len(hits) * self.block_size
