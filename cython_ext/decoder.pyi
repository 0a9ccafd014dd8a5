OPS: tuple[str, ...]
LORA_MODULES: tuple[str, ...]

def lora_isa_supported(isa: int) -> bool: ...

class LoraTable:
    max_rank: int
    def __init__(self, num_layers: int, num_targets: int) -> None: ...
    def set_module(
        self, layer: int, fused: str, packed_a: int, rank: int,
        targets: list[tuple[int, int, int, int, int, int, int]],
    ) -> None: ...
    def add(
        self, layer: int, fused: str, x: int, ldx: int, in_features: int, y: int, ldy: int,
        order: int, groups: int, num_groups: int, row_scale: int, u: int, ldu: int, isa: int,
        num_threads: int,
    ) -> None: ...

class DecoderLayers:
    def __init__(
        self, num_layers: int, *, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
        intermediate: int, eps: float, rope: int, rope_rows: int, gemm_isa: int, layer_ops_isa: int,
        attention_isa: int,
    ) -> None: ...
    def set_layer(
        self, index: int, input_norm: int, post_attention_norm: int,
        qkv: tuple[int, int, int, int, bool], o: tuple[int, int, int, int, bool],
        gate_up: tuple[int, int, int, int, bool], down: tuple[int, int, int, int, bool],
    ) -> None: ...
    def set_caches(self, k_first: int, v_first: int, layer_bytes: int) -> None: ...
    def run(
        self, step_args: int, block_size: int, num_blocks: int, split_positions: int, rows: int,
        positions: int, residual: int, delta: int, x: int, qkv: int, attn: int, gate_up: int,
        act: int, num_threads: int, lora: LoraTable | None = None, order: int = 0,
        groups: int = 0, num_groups: int = 0, row_scale: int = 0, lora_u: int = 0,
    ) -> None: ...
