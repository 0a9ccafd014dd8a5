"""Native CPU kernels behind torch-facing modules: packed GEMM, fused layer ops, int8 weights, the
ISA choice."""
