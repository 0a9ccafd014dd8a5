"""One step around the forward: plan checks, slot state, sampling, logits, the KV budget,
profiling, CUDA graphs."""
