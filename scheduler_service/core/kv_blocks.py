"""The scheduler's KV blocks: the Cython block pool and prefix-cache lookups for waiting requests.

A running request holds ceil(num_computed_tokens / block_size) blocks after each step; its table
lives in cython_ext/step_core.pyx (per slot, read through Request.block_ids), is append-only while
it runs and released whole when it finishes, is aborted or is preempted. Every block that fills up
is registered (by step_core, in update) under a SHA-256 digest chained on its parent and salted
(salt_of: the request's cache_salt, and its tenant when the scope is "tenant"); released blocks
stay in the pool's LRU free queue with their digest, so a later request (or the same one, resumed
after preemption) starting with the same tokens and salt picks them up instead of computing them
again. This module answers the questions asked before a request runs: which cached blocks would
it start with.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import struct

from cython_ext.block_pool import BlockPool, block_hash
from scheduler_service.core.request import Request

# First blocks of LoRA requests remembered for the KV-cache events (least recent dropped).
_MAX_LORA_ROOTS = 4096


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=4096)
def salt_of(cache_salt: str, tenant: str | None = None, lora: str = "") -> int:
    """The 256-bit prefix-cache salt (what BlockPool and StepCore take) of a request's cache_salt,
    of its tenant when the cache is tenant-scoped (tenant not None), and of its LoRA adapter
    (`lora`: "name#id", empty for the base model), so that two adapters never share KV.

    0, shared by every such request, for no cache_salt and no adapter in the global scope;
    otherwise SHA-256 of the tagged, length-prefixed strings, so ("ab", "c") and ("a", "bc")
    differ and a tenant-scoped salt never equals a global one:
    b"C" len(uint32 LE) cache_salt  [b"N" len tenant]  [b"L" len lora]  (UTF-8).
    """
    if not cache_salt and tenant is None and not lora:
        return 0
    message = b"C" + struct.pack("<I", len(cache_salt.encode())) + cache_salt.encode()
    if tenant is not None:
        message += b"N" + struct.pack("<I", len(tenant.encode())) + tenant.encode()
    if lora:
        message += b"L" + struct.pack("<I", len(lora.encode())) + lora.encode()
    return int.from_bytes(hashlib.sha256(message).digest(), "big")


def lora_key(request: Request) -> str:
    """The adapter's part of the salt: its name and id (ids are never reused, so an adapter
    loaded again under an old name never finds the old one's KV); "" for the base model."""
    return f"{request.lora_name}#{request.lora_id}" if request.lora_name else ""


class KVBlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        prefix_cache_scope: str = "global",
    ):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_scope = prefix_cache_scope
        self.logs_events = False  # the pool logs KV-cache events (engine/kv_events.py)
        # With events: the first-block digest of recent LoRA requests -> (lora_id, lora_name),
        # so that the events can name the adapter of the chains they start (kv_events.py).
        self.lora_roots: collections.OrderedDict[int, tuple[int, str]] = collections.OrderedDict()

    def enable_events(self) -> None:
        """The pool logs its prefix cache's changes, and so does every pool that replaces it."""
        self.logs_events = True
        self.pool.enable_events(self.block_size)

    def replace_pool(self, num_blocks: int) -> None:
        """A new, empty pool (the model service restarted: the cached KV is gone)."""
        self.pool = BlockPool(num_blocks)
        if self.logs_events:
            self.pool.enable_events(self.block_size)

    def salt(self, request: Request) -> int:
        """The request's prefix-cache salt under this manager's scope (see salt_of)."""
        tenant = request.tenant if self.prefix_cache_scope == "tenant" else None
        return salt_of(request.cache_salt, tenant, lora_key(request))

    def note_lora_root(self, request: Request) -> None:
        """With events: remembers the digest the first block of a LoRA request will have."""
        token_ids = request.all_token_ids
        if len(token_ids) < self.block_size:
            return
        digest = block_hash(0, token_ids[: self.block_size], self.salt(request))
        self.lora_roots[digest] = (request.lora_id, request.lora_name)
        self.lora_roots.move_to_end(digest)
        if len(self.lora_roots) > _MAX_LORA_ROOTS:
            self.lora_roots.popitem(last=False)

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

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; only while no sequence holds a block (else False)."""
        return self.pool.reset_prefix_cache()

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
        hits = self.pool.match_prefix(
            token_ids, self.block_size, self.salt(request), len(token_ids) - 1
        )
        return hits, self.pool.num_unheld(hits)

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Prompt tokens a waiting request would find cached (the `lpm` policy's key)."""
        hits, _ = self.find_cached_prefix(request)
        return len(hits) * self.block_size
