"""Per-request block tables on top of the Cython block pool.

A request holds ceil(num_computed_tokens / block_size) blocks after each step; the tables are
append-only while it runs and dropped whole when it finishes, is aborted or is preempted.
"""
from __future__ import annotations

from cython_ext.block_pool import BlockPool
from scheduler_service.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_usable_blocks(self) -> int:
        """Every block but the reserved block 0."""
        return self.pool.num_blocks - 1

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

    def free(self, request: Request) -> None:
        if request.block_ids:
            self.pool.free(request.block_ids)
            request.block_ids = []
