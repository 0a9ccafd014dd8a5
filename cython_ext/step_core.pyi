"""Python view of cython_ext/step_core.pyx (the C contract is step_core.pxd)."""
from collections.abc import Callable, Collection, Sequence
from typing import Any, Optional

from cython_ext.block_pool import BlockPool

PHASE_ALL: int       # every running sequence (interleaved)
PHASE_PREFILLS: int  # only sequences with more than one token to compute
PHASE_DECODES: int   # only sequences with exactly one token to compute

def packed_uint32_field(field: int, values: Sequence[int]) -> bytes:
    """A packed repeated uint32 protobuf field of `values` in wire format (b"" for none):
    `Message.MergeFromString` sets it. OverflowError for a value outside uint32."""

class SlotView:
    """A slot's computed count and block table as a Request reads them while it holds the slot
    (Request.slot_view, bound by StepCore.admit/fork, unbound by release). Read-only."""

    @property
    def slot(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def block_ids(self) -> list[int]:
        """The block table (a new list)."""

class PackedPlan:
    """One plan's packed arrays, owned by the plan (C copies)."""

    @property
    def num_entries(self) -> int: ...
    @property
    def num_block_ids(self) -> int: ...
    @property
    def wire(self) -> bytes:
        """BatchPlan fields 3-6 (slots, num_scheduled_tokens, num_new_blocks, new_block_ids) in
        protobuf wire format: `BatchPlan.MergeFromString(wire)` sets them."""
    def arrays(self) -> tuple[list[int], list[int], list[int], list[int]]: ...

class StepCore:
    """Per-slot running state (token counts, block table, prefix hashes, tokens) and the per-step
    loops over running sequences. Not thread safe."""

    block_size: int
    max_num_slots: int
    max_prefill_chunk: int
    decode_reserve_tokens: int
    enable_prefix_caching: bool
    num_running: int
    step_id: int
    budget_tokens: int
    budget_seqs: int
    budget_prefill_chunks: int
    stalled: bool

    def __init__(self, pool: BlockPool, block_size: int, max_num_slots: int,
                 max_prefill_chunk: int = 0, decode_reserve_tokens: int = 0,
                 enable_prefix_caching: bool = True,
                 on_blocks_exhausted: Optional[Callable[[int], bool]] = None,
                 on_scheduled: Optional[Callable[[Any, int], None]] = None) -> None:
        """`on_blocks_exhausted(slot)` preempts a victim when the sequence in `slot` needs more
        blocks than are free and says whether the victim was that sequence; `on_scheduled(request,
        num_tokens)` is called for every scheduled sequence (None: not at all)."""

    # Sequences in and out.
    def admit(self, slot: int, request: Any, token_ids: Sequence[int], num_computed_tokens: int,
              hits: Sequence[int], max_num_tokens: int, salt: int,
              num_lookahead: int = 0) -> None:
        """Starts `request` in `slot` (appended to the running order), sharing the prefix-cache
        hit blocks (increfed here). `salt`: the 256-bit prefix-cache salt (kv_blocks.salt_of).
        `hits`: BlockPool.match_prefix's answer for these tokens and salt, nothing allocated
        since; their digests are taken from the pool, not hashed again (a hit with no digest is
        hashed). ValueError if the slot is taken, a hit id is invalid or the hits cover more
        than the tokens. Binds `request.slot_view` to the slot's SlotView."""
    def fork(self, parent_slot: int, slot: int, request: Any, num_prompt_tokens: int,
             max_num_tokens: int) -> Optional[tuple[int, int]]:
        """Starts `request` in `slot` as a parallel sample sharing the parent's computed prompt
        blocks; it recomputes the last prompt token. Returns the copy-on-write (src, dst) of the
        block that token lands in when the parent already wrote into it, else None. Binds
        `request.slot_view` to the slot's SlotView."""
    def release(self, slot: int) -> None:
        """Frees the slot's blocks in table order and drops it from the running order; its
        request is unbound (slot_view None) with its last computed count set on it."""
    def append_tokens(self, slot: int, token_ids: Sequence[int]) -> None: ...

    # The step.
    def begin_step(self, step_id: int, max_num_batched_tokens: int, max_num_seqs: int) -> None: ...
    def limit_prefill_chunks(self, num_chunks: int) -> None: ...
    def schedule_running(self, phase: int) -> None:
        """One pass over the running sequences in admission order; see step_core.pyx."""
    def schedule_admitted(self, slot: int, num_new_tokens: int, num_blocks: int) -> None: ...
    def chunk(self, num_tokens_to_compute: int) -> int: ...
    @property
    def budget_open(self) -> bool: ...
    def is_scheduled(self, slot: int) -> bool: ...
    def hold(self, slot: int) -> None:
        """Leaves the slot's running sequence out of this step (parked); see step_core.pyx."""
    def decode_reserve_blocks(self) -> int: ...
    def reserve_blocks_of(self, slot: int, num_scheduled: int) -> int: ...
    def end_step(self) -> tuple[list[Any], list[int], list[int], list[int], list[int], PackedPlan]:
        """(requests, slots, num_scheduled_tokens, num_new_blocks, new_block_ids, packed)."""
    def advance(self, packed: PackedPlan, num_sampled_tokens: Sequence[int],
                cache_blocks: bool = True) -> tuple[list[int], list[int]]:
        """Computed counts advance, newly full blocks are hashed and cached (unless cache_blocks
        is False); returns (entry indices, sampled-token offsets) of live entries that sampled
        tokens."""

    # Overlap: plans committed before their results.
    def sampling_entries(self, packed: PackedPlan) -> list[int]:
        """0/1 per entry: whether it samples (for a plan not yet advanced)."""
    def live_entries(self, packed: PackedPlan) -> list[int]:
        """Indices of the entries whose sequence still holds its slot."""
    def add_placeholders(
        self, packed: PackedPlan, expected: Sequence[int], held: Optional[Collection[int]]
    ) -> dict[int, Optional[int]]:
        """A placeholder token for each live sampling entry not held: entry -> its index."""
    def set_token(self, slot: int, index: int, token_id: int) -> None:
        """Overwrites a placeholder token with its real id."""
    def cache_blocks(self, packed: PackedPlan) -> None:
        """The prefix-cache registration advance(cache_blocks=False) skipped."""

    def cache_finished_blocks(self, slot: int, num_real_tokens: int) -> None:
        """Registers the slot's full computed blocks among its first num_real_tokens tokens
        (a sequence finishing while overlap reconciles its plan, before its release)."""

    # Inspection.
    def running_slots(self) -> list[int]: ...
    def block_ids(self, slot: int) -> list[int]: ...
    def block_hashes(self, slot: int) -> list[int]:
        """SHA-256 digests (ints) of the slot's leading full blocks, as BlockPool.block_hashes."""
    def num_computed_tokens(self, slot: int) -> int: ...
    def num_tokens(self, slot: int) -> int: ...
