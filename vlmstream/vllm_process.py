"""How a vLLM engine process is started, for every stage that runs one (inference, condense)."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def engine_process_threads(threads: int):
    """Start vLLM's engine process (inside this block) with `threads` torch/OpenMP threads; this process keeps its
    own. vLLM lowers OMP_NUM_THREADS to 1 only when it runs several GPU workers; its one-GPU engine keeps a thread
    per core, and at 0.2 MP those threads spun on 15 of the H200 host's 32 cores (benchmarks/RESULTS.md). libgomp
    reads the variable when it loads, so the engine must be spawned, not forked (vLLM forks unless CUDA is already
    up here). Variables the user exported are kept as they are; 0 leaves vLLM to its own way."""
    if threads <= 0:
        yield
        return
    wanted = {"OMP_NUM_THREADS": str(threads), "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    added = [name for name in wanted if name not in os.environ]
    os.environ.update({name: wanted[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
