"""Host swap space as the scheduler hands it out: preemption by swap instead of recompute.

The model service holds DescribeResponse.num_swap_blocks blocks of host memory, ids
[0, num_swap_blocks). When a running sequence must make room and enough swap blocks are free, its
computed KV (the first ceil(num_computed_tokens / block_size) device blocks) is copied out
(BatchPlan.swap_out_src -> swap_out_dst) before the step's forward, its device blocks are freed
and it waits with its computed count kept. On resume it is registered again as a NewSequence with
num_computed_tokens = that count, its fresh device blocks are filled by a swap-in
(swap_in_src -> swap_in_dst) and it carries on from there: nothing is recomputed.

Lifetimes of swap blocks, per plan:

    swap-out   allocated here, written by the plan's swap_out          (held by the request)
    swap-in    read by the plan's swap_in; free again only once that plan is built, so no
               swap-out of the same plan can overwrite them before they are read
    abort      a waiting swapped request that ends frees its blocks at once (nobody reads them)
"""

from __future__ import annotations

from scheduler_service.core.request import Request


class SwapSpace:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # lowest id at the end: popped first
        self._held: dict[Request, list[int]] = {}  # swapped-out requests -> their host blocks
        self._freed_after_plan: list[int] = []
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Requests whose KV sits in swap space."""
        return len(self._held)

    def can_swap_out(self, num_blocks: int) -> bool:
        return 0 < num_blocks <= len(self._free)

    def swap_out(self, request: Request, num_blocks: int) -> list[int]:
        """Allocates the host blocks that receive the request's first num_blocks device blocks."""
        if request in self._held:
            raise ValueError(f"request {request.request_id} is already swapped out")
        if not self.can_swap_out(num_blocks):
            raise MemoryError(f"{num_blocks} swap blocks wanted, {len(self._free)} free")
        host = [self._free.pop() for _ in range(num_blocks)]
        self._held[request] = host
        self.num_swap_outs += 1
        self.num_blocks_swapped_out += num_blocks
        return host

    def held_blocks(self, request: Request) -> list[int] | None:
        """The host blocks holding a swapped-out request's KV (None: not swapped out)."""
        return self._held.get(request)

    def swap_in(self, request: Request) -> list[int]:
        """The request resumes: its host blocks are read by the plan being built and become
        free once it is (end_plan)."""
        host = self._held.pop(request)
        self._freed_after_plan.extend(host)
        self.num_swap_ins += 1
        self.num_blocks_swapped_in += len(host)
        return host

    def discard(self, request: Request) -> None:
        """A swapped-out request ends without resuming: its blocks are free now."""
        host = self._held.pop(request, None)
        if host:
            self._free.extend(reversed(host))

    def discard_all(self) -> list[Request]:
        """The model service lost its swap space (it restarted): every swapped-out request
        must be recomputed. Returns them."""
        requests = list(self._held)
        self._held.clear()
        self._freed_after_plan.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        return requests

    def end_plan(self) -> None:
        """The plan is built: blocks its swap-ins read may be written by the next one."""
        if self._freed_after_plan:
            self._free.extend(reversed(self._freed_after_plan))
            self._freed_after_plan.clear()
