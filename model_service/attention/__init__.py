"""Paged attention: the one dispatch (native CPU kernel, Triton on CUDA, torch fallback) and the
paged KV cache."""
