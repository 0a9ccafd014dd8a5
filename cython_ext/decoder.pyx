"""A step's decoder layers in one native call (contract: decoder.pxd, csrc/decoder.h).

`DecoderLayers` holds a model's layer table (the packed weights' and norms' addresses, each
layer's KV cache) and runs every layer of a step with one call that releases the GIL: the same
kernel calls, in the same order, as the Python loop of model_service/models/llama.py, without a
Python wrapper and a tensor allocation around each (model_service/models/decoder_loop.py builds it and
keeps the tensors alive). The kernels come from their own extensions by address.
"""
from libc.stdint cimport int64_t, uint16_t, uintptr_t
from libc.math cimport pow
from libc.stdlib cimport calloc, free, malloc

from cython_ext.paged_attention cimport pa_args

from cython_ext import gemm, layer_ops, paged_attention

# dl_op order; each op's kernel module, for its error message.
OPS = ("none", "check_indices", "input_norm", "qkv", "rope", "attention", "o", "post_attention_norm",
       "gate_up", "silu_mul", "down", "lora")
# dl_lora's modules of a layer, in their order (csrc/decoder.cpp)
LORA_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_MESSAGES = {"check_indices": paged_attention, "attention": paged_attention, "input_norm": layer_ops,
             "rope": layer_ops, "post_attention_norm": layer_ops, "silu_mul": layer_ops}


cdef dl_linear _linear(tuple spec):
    """(packed address, bias address or 0, n, k, int8) -> dl_linear."""
    cdef dl_linear w
    w.packed = <const void*><uintptr_t>spec[0]
    w.bias = <const uint16_t*><uintptr_t>spec[1] if spec[1] else NULL
    w.n, w.k, w.int8 = spec[2], spec[3], 1 if spec[4] else 0
    return w


cdef class LoraTable:
    """The loaded adapters' stacked factors (model_service/lora/stacked.py's LoadedStack) as the
    native loop reads them: `set_module` once per adapted module of a layer. Holds addresses, and
    each target's B regrouped by adapter (a copy: csrc/lora_rows.h lr_target.by_block): its
    owner keeps the packed tensors and block arrays alive."""
    cdef lr_module* modules
    cdef lr_target* targets
    cdef int64_t num_layers, capacity, used
    cdef readonly int64_t max_rank

    def __cinit__(self, int64_t num_layers, int64_t num_targets):
        self.modules = <lr_module*>calloc(max(num_layers * 4, 1), sizeof(lr_module))
        self.targets = <lr_target*>calloc(max(num_targets, 1), sizeof(lr_target))
        if self.modules == NULL or self.targets == NULL:
            raise MemoryError()
        self.num_layers, self.capacity = num_layers, num_targets

    def __dealloc__(self):
        cdef int64_t t
        if self.targets != NULL:
            for t in range(self.used):
                free(<void*><uintptr_t>self.targets[t].by_block)
        free(self.modules)
        free(self.targets)

    def set_module(self, int64_t layer, str fused, uintptr_t packed_a, int64_t rank, list targets):
        """Layer `layer`'s fused module (one of LORA_MODULES): A packed [rank, in], and per target
        (packed B [columns, k1 - k0], k0, k1, first column, end column, blocks address, blocks):
        its blocks int64 [blocks, 3] of (lora_id, first rank, end rank), csrc/lora_rows.h."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        if self.used + len(targets) > self.capacity:
            raise IndexError(f"more than the {self.capacity} targets this table was made for")
        cdef lr_module* mod = &self.modules[layer * 4 + LORA_MODULES.index(fused)]
        mod.packed_a, mod.rank = <const uint16_t*>packed_a, rank
        mod.targets, mod.num_targets = &self.targets[self.used], len(targets)
        cdef lr_target* target
        cdef int64_t size
        cdef uint16_t* by_block
        for packed_b, k0, k1, start, end, blocks, num_blocks in targets:
            target = &self.targets[self.used]
            target.packed_b = <const uint16_t*><uintptr_t>packed_b
            target.k0, target.k1, target.start, target.end = k0, k1, start, end
            target.blocks, target.num_blocks = <const lr_block*><uintptr_t>blocks, num_blocks
            target.by_block = NULL
            self.used += 1
            size = lr_by_block_size(target)
            if num_blocks > 0:
                by_block = <uint16_t*>malloc(max(size, 1) * sizeof(uint16_t))
                if by_block == NULL:
                    raise MemoryError()
                target.by_block = by_block
                if size == 0 or lr_regroup_b(target, by_block) != 0:
                    raise ValueError(
                        f"layer {layer} {fused}: a block outside its target's ranks [{k0}, {k1}) "
                        "or at an odd offset")
        self.max_rank = max(self.max_rank, rank)

    def add(self, int64_t layer, str fused, uintptr_t x, int64_t ldx, int64_t in_features, uintptr_t y,
            int64_t ldy, uintptr_t order, uintptr_t groups, int64_t num_groups, uintptr_t row_scale,
            uintptr_t u, int64_t ldu, int isa, int num_threads):
        """One module's products outside the loop (tests: each ISA path against a reference):
        y [*, ldy] += those of x [*, ldx] bfloat16, rows grouped as csrc/lora_rows.h's lr_step."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        cdef lr_module* mod = &self.modules[layer * 4 + LORA_MODULES.index(fused)]
        if mod.packed_a == NULL:
            raise ValueError(f"layer {layer} {fused}: no adapter adapts it")
        cdef lr_step step
        step.order, step.groups, step.num_groups = <const int64_t*>order, <const int64_t*>groups, num_groups
        step.row_scale, step.u, step.ldu = <const float*>row_scale, <uint16_t*>u, ldu
        cdef int code
        with nogil:
            code = lr_add(mod, &step, <const uint16_t*>x, ldx, in_features, <uint16_t*>y, ldy, isa, num_threads)
        if code != 0:
            raise ValueError(f"LoRA products, layer {layer} {fused}: {gemm.error_message(code)}")


def lora_isa_supported(int isa):
    """Whether this CPU runs the per-row LoRA products' path `isa` (an index into gemm.ISAS)."""
    return lr_isa_supported(isa) != 0


cdef class DecoderLayers:
    """The layer table of one model: `set_layer` each layer once, `set_caches` when the KV cache
    is (re)made, then `run` once per step."""
    cdef dl_kernels kernels
    cdef dl_model model
    cdef dl_layer* layers

    def __cinit__(self, int64_t num_layers, *args, **kwargs):
        self.layers = <dl_layer*>calloc(max(num_layers, 1), sizeof(dl_layer))
        if self.layers == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.layers)

    def __init__(self, int64_t num_layers, *, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, int64_t intermediate, float eps, uintptr_t rope, int64_t rope_rows,
                 int gemm_isa, int layer_ops_isa, int attention_isa):
        """Shapes of the model, its float32 RoPE table [rope_rows, head_dim] (address) and each
        kernel's ISA index (into gemm.ISAS, layer_ops.ISAS, paged_attention.ISAS)."""
        addresses = {**gemm.kernel_addresses(), **layer_ops.kernel_addresses(),
                     **paged_attention.kernel_addresses()}
        self.kernels.linear_bf16 = <dl_linear_bf16_fn><uintptr_t>addresses["linear_bf16"]
        self.kernels.linear_int8 = <dl_linear_int8_fn><uintptr_t>addresses["linear_int8"]
        self.kernels.add_rms_norm = <dl_add_rms_norm_fn><uintptr_t>addresses["add_rms_norm"]
        self.kernels.rope = <dl_rope_fn><uintptr_t>addresses["rope"]
        self.kernels.silu_mul = <dl_silu_mul_fn><uintptr_t>addresses["silu_mul"]
        self.kernels.attention = <dl_attention_fn><uintptr_t>addresses["paged_attention"]
        self.kernels.check_indices = <dl_check_indices_fn><uintptr_t>addresses["check_indices"]
        self.model.num_layers = num_layers
        self.model.hidden, self.model.intermediate = hidden, intermediate
        self.model.num_heads, self.model.num_kv_heads, self.model.head_dim = num_heads, num_kv_heads, head_dim
        self.model.eps = eps
        self.model.scale = <float>pow(<double>head_dim, -0.5)  # as Python's head_dim ** -0.5
        self.model.rope, self.model.rope_rows = <const float*>rope, rope_rows
        self.model.gemm_isa, self.model.layer_ops_isa = gemm_isa, layer_ops_isa
        self.model.attention_isa = attention_isa
        self.model.layers = self.layers

    def set_layer(self, int64_t index, uintptr_t input_norm, uintptr_t post_attention_norm, tuple qkv, tuple o,
                  tuple gate_up, tuple down):
        """Layer `index`: its norms' bfloat16 weights and its four linears, each
        (packed, bias or 0, out features, in features, int8)."""
        if not 0 <= index < self.model.num_layers:
            raise IndexError(f"layer {index} outside 0..{self.model.num_layers - 1}")
        cdef dl_layer* layer = &self.layers[index]
        layer.input_norm = <const uint16_t*>input_norm
        layer.post_attention_norm = <const uint16_t*>post_attention_norm
        layer.qkv, layer.o = _linear(qkv), _linear(o)
        layer.gate_up, layer.down = _linear(gate_up), _linear(down)

    def set_caches(self, uintptr_t k_first, uintptr_t v_first, int64_t layer_bytes):
        """Layer i's K/V caches start layer_bytes * i past the first layer's."""
        cdef int64_t i
        for i in range(self.model.num_layers):
            self.layers[i].k_cache = <void*>(k_first + i * layer_bytes)
            self.layers[i].v_cache = <void*>(v_first + i * layer_bytes)

    def run(self, uintptr_t step_args, int64_t block_size, int64_t num_blocks, int64_t split_positions,
            int64_t rows, uintptr_t positions, uintptr_t residual, uintptr_t delta, uintptr_t x, uintptr_t qkv,
            uintptr_t attn, uintptr_t gate_up, uintptr_t act, int num_threads, LoraTable lora=None,
            uintptr_t order=0, uintptr_t groups=0, int64_t num_groups=0, uintptr_t row_scale=0, uintptr_t lora_u=0):
        """Every layer over `rows` token rows: step_args is the step's AttentionStep.args_address;
        the buffers' addresses as csrc/decoder.h lays them out. On return `delta` holds the last
        layer's MLP output, not yet added into `residual`. With `lora`, the rows by adapter (order
        int64 [rows], groups int64 [num_groups, 3], csrc/lora_rows.h), each row's scale (float32
        [rows]) and the scratch buffer u (bfloat16 [rows, lora.max_rank])."""
        cdef pa_args step = (<pa_args*>step_args)[0]
        cdef dl_buffers b
        cdef dl_lora adapters
        b.lora = NULL
        if lora is not None:
            adapters.modules = lora.modules
            adapters.step.order, adapters.step.groups = <const int64_t*>order, <const int64_t*>groups
            adapters.step.num_groups, adapters.step.row_scale = num_groups, <const float*>row_scale
            adapters.step.u, adapters.step.ldu = <uint16_t*>lora_u, lora.max_rank
            b.lora = &adapters
        cdef int code, op
        cdef int64_t layer
        step.block_size, step.num_blocks, step.split_positions = block_size, num_blocks, split_positions
        b.rows, b.positions = rows, <const int64_t*>positions
        b.residual, b.delta, b.x, b.qkv = <void*>residual, <void*>delta, <void*>x, <void*>qkv
        b.attn, b.gate_up, b.act = <void*>attn, <void*>gate_up, <void*>act
        with nogil:
            code = dl_run_layers(&self.kernels, &self.model, &step, &b, num_threads, &op, &layer)
        if code != 0:
            name = OPS[op]
            message = _MESSAGES.get(name, gemm).error_message(code)
            where = f"layer {layer} {name}" if layer >= 0 else name
            raise ValueError(f"decoder loop, {where}: {message}")
