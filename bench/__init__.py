"""planserve's benchmarks: load/ (the `planserve bench` load generator, workloads and reports),
peers/ (the side-by-side runs against vLLM, llama.cpp and transformers), and the bench_*.py
micro-benchmarks beside them.
"""
