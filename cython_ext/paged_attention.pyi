"""Python view of cython_ext/paged_attention.pyx (the C contract is paged_attention.pxd)."""
import numpy as np
import numpy.typing as npt

ISAS: tuple[str, ...]
DTYPES: tuple[str, ...]

def isa_supported(name: str) -> bool: ...
def best_isa() -> str: ...

class AttentionStep:
    def __init__(
        self,
        slot_mapping: npt.NDArray[np.int64],
        query_start: npt.NDArray[np.int64],
        num_scheduled: npt.NDArray[np.int64],
        context_lens: npt.NDArray[np.int64],
        block_tables: npt.NDArray[np.int64],
    ) -> None: ...
    @property
    def args_address(self) -> int: ...
    def run(
        self, q: int, k_new: int, v_new: int, k_cache: int, v_cache: int, out: int, *,
        num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
        split_positions: int, scale: float, dtype: int, isa: int, num_threads: int,
        q_row_stride: int = 0, k_new_row_stride: int = 0, v_new_row_stride: int = 0,
    ) -> None: ...
def kernel_addresses() -> dict[str, int]: ...
def error_message(code: int) -> str: ...
