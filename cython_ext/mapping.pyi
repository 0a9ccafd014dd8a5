"""Python view of cython_ext/mapping.pyx (the C contract is mapping.pxd)."""
import numpy as np
import numpy.typing as npt

class StepInputs:
    """One step's packed inputs (runner.py's table). Every array is an int64 numpy VIEW of the
    builder's buffers: valid until the builder's next build(), which overwrites it. Copy to keep."""

    @property
    def positions(self) -> npt.NDArray[np.int64]:
        """[T] position of each packed row: num_computed[slot] + offset in its chunk."""
    @property
    def input_ids(self) -> npt.NDArray[np.int64]:
        """[T] tokens[slot, position]."""
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]:
        """[T] KV write slot: block_table[slot, position // bs] * bs + position % bs."""
    @property
    def query_start(self) -> npt.NDArray[np.int64]:
        """[B] packed row of each scheduled slot's first token."""
    @property
    def context_lens(self) -> npt.NDArray[np.int64]:
        """[B] num_computed + num_scheduled (computed tokens after the step)."""
    @property
    def needs_sample(self) -> npt.NDArray[np.int64]:
        """[B] 1 where context_lens reaches the slot's num_tokens, else 0."""
    @property
    def logits_indices(self) -> npt.NDArray[np.int64]:
        """[S] packed row of the last token of each sampling slot, in slot order."""
    @property
    def sample_slots(self) -> npt.NDArray[np.int64]:
        """[S] the sampling slots (slots where needs_sample), parallel to logits_indices."""
    @property
    def block_tables(self) -> npt.NDArray[np.int64]:
        """[B, ceil(max_context_len / bs)] C-contiguous: block_table[slot, :cols]."""
    @property
    def num_tokens(self) -> int:
        """T = sum(num_scheduled)."""
    @property
    def max_query_len(self) -> int:
        """max(num_scheduled), 0 for an empty step."""
    @property
    def max_context_len(self) -> int:
        """max(context_lens), 0 for an empty step."""

class StepInputBuilder:
    """Fills a step's packed inputs into preallocated int64 buffers in one C loop without the GIL.
    Not thread safe; one per runner."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        """Buffers for up to max_num_tokens rows (grown, doubling, when a step packs more; the
        steady state allocates nothing), max_num_seqs scheduled slots and a block table up to
        max_blocks_per_seq wide. ValueError unless every argument is >= 1."""
    @property
    def max_num_tokens(self) -> int:
        """Current row capacity."""
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_blocks_per_seq(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    def build(
        self,
        tokens: npt.NDArray[np.int32],
        block_table: npt.NDArray[np.int32],
        num_computed: npt.NDArray[np.int64],
        num_tokens: npt.NDArray[np.int64],
        slots: npt.NDArray[np.int64],
        num_scheduled: npt.NDArray[np.int64],
    ) -> StepInputs:
        """The packed inputs of scheduling num_scheduled[b] tokens of each slots[b], from the
        request cache's arrays (tokens [num_slots, width] and block_table [num_slots, blocks]
        int32; num_computed and num_tokens [num_slots] int64; all C-contiguous, else ValueError
        or TypeError from the buffer protocol).

        ValueError, with no output, when a scheduled row would read outside the arrays: a slot out
        of range, num_scheduled < 1, num_computed < 0, computed + scheduled beyond the token
        columns, or more blocks than block_table's columns; also for mismatched lengths or more
        than max_num_seqs slots. Other checks (known tokens, allocated blocks) are the runner's."""
