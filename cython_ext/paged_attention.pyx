"""Paged attention kernel over a packed mixed batch (contract: paged_attention.pxd).

One AttentionStep per forward step holds the step's index arrays (shared by every layer); its
run() is one layer's call: write the step's K/V rows into the cache, attend every query row in
place through the block table. Tensors cross as raw addresses (torch stays out of this module, so
the package builds without torch headers); model_service/attention/paged.py checks dtypes, shapes and
contiguity before handing addresses over.
"""
from libc.stdint cimport int64_t, uintptr_t

import numpy as np

ISAS = ("portable", "avx2", "avx512", "avx512_bf16")  # pa_isa order: by preference
DTYPES = ("float32", "bfloat16")


def isa_supported(str name) -> bool:
    """Whether this build has ISA path `name` (one of ISAS) and this CPU runs it."""
    return pa_isa_supported(ISAS.index(name)) == 1


def best_isa() -> str:
    """The fastest path this build and CPU support."""
    for name in reversed(ISAS):
        if isa_supported(name):
            return name
    return "portable"


def kernel_addresses() -> dict:
    """The kernel's entry points' addresses, for the native decoder loop (cython_ext/decoder.pyx)."""
    return {"paged_attention": <uintptr_t>&pa_paged_attention, "check_indices": <uintptr_t>&pa_check_indices}


def error_message(int code) -> str:
    return pa_error_message(code).decode()


cdef const int64_t* _address(object array):
    cdef const int64_t[::1] view = array
    return &view[0] if view.shape[0] else <const int64_t*>NULL


cdef class AttentionStep:
    """The step's indices: slot_mapping [T], query_start / num_scheduled / context_lens [B] and
    block_tables [B, MB], C-contiguous int64 numpy arrays (kept alive here), shared by every
    layer of the step (and by a draft model's layers)."""

    def __init__(self, slot_mapping, query_start, num_scheduled, context_lens, block_tables):
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in
                  (slot_mapping, query_start, num_scheduled, context_lens)]
        tables = np.ascontiguousarray(block_tables, dtype=np.int64)
        if tables.ndim != 2 or tables.shape[0] != arrays[1].shape[0]:
            raise ValueError(f"block_tables: shape {tables.shape}, expected [{arrays[1].shape[0]}, max_blocks]")
        if not (arrays[1].shape[0] == arrays[2].shape[0] == arrays[3].shape[0]):
            raise ValueError("query_start, num_scheduled, context_lens: lengths differ")
        self._keep = (arrays, tables)
        self.args.slot_mapping = _address(arrays[0])
        self.args.query_start = _address(arrays[1])
        self.args.num_scheduled = _address(arrays[2])
        self.args.context_lens = _address(arrays[3])
        self.args.block_tables = _address(tables.reshape(-1)) if tables.size else NULL
        self.args.num_tokens = arrays[0].shape[0]
        self.args.num_seqs = arrays[1].shape[0]
        self.args.max_blocks_per_seq = tables.shape[1]
        self.checked_blocks = -1
        self.checked_block_size = -1

    @property
    def args_address(self) -> int:
        """The address of the step's pa_args (the indices; valid while this object lives), for
        the native decoder loop, which fills the per-layer fields in a copy."""
        return <uintptr_t>&self.args

    def run(self, uintptr_t q, uintptr_t k_new, uintptr_t v_new, uintptr_t k_cache, uintptr_t v_cache,
            uintptr_t out, *, int num_heads, int num_kv_heads, int head_dim, int block_size,
            int64_t num_blocks, int split_positions, float scale, int dtype, int isa, int num_threads,
            int64_t q_row_stride=0, int64_t k_new_row_stride=0, int64_t v_new_row_stride=0):
        """One layer: addresses of q/out [T, H, D], k_new/v_new [T, KVH, D] (0: write nothing),
        k_cache/v_cache [NB, KVH, BS, D], all C-contiguous except that q, k_new and v_new rows may
        lie *_row_stride elements apart (0: contiguous; views of a fused QKV output are not);
        dtype an index into DTYPES, isa into
        ISAS. The indices are checked against the cache on the first call (and whenever the
        cache's shape differs), not on every layer."""
        cdef pa_args a = self.args
        cdef int code
        a.q = <const void*>q
        a.k_new = <const void*>k_new if k_new else NULL
        a.v_new = <const void*>v_new if v_new else NULL
        a.k_cache = <void*>k_cache
        a.v_cache = <void*>v_cache
        a.out = <void*>out
        a.num_heads = num_heads
        a.num_kv_heads = num_kv_heads
        a.head_dim = head_dim
        a.block_size = block_size
        a.num_blocks = num_blocks
        a.split_positions = split_positions
        a.scale = scale
        a.dtype = dtype
        a.num_threads = num_threads
        a.q_row_stride = q_row_stride or num_heads * head_dim
        a.k_new_row_stride = k_new_row_stride or num_kv_heads * head_dim
        a.v_new_row_stride = v_new_row_stride or num_kv_heads * head_dim
        with nogil:
            code = 0
            if a.num_blocks != self.checked_blocks or a.block_size != self.checked_block_size:
                code = pa_check_indices(&a)
                if code == 0:
                    self.checked_blocks, self.checked_block_size = a.num_blocks, a.block_size
            if code == 0:
                code = pa_paged_attention(&a, isa)
        if code != 0:
            raise ValueError(f"paged attention: {pa_error_message(code).decode()}")
