"""The GPU serving benchmark's parts (bench/bench_gpu_serve.py runs them): the meters read while
serving, the graph-replay ceiling and transformers' static batching (each run as a child process,
so the GPU's memory is whole again for the next phase), and the scripts that bring planserve to a
CUDA machine without network (prepare.sh here, run.sh there)."""
