"""Does the CPU engine's resident memory stay flat? The transformers engine on the tiny model, batches of random-size
images for a while, its RSS read every --every seconds; variants side by side (one process each, at the same time,
one torch thread each), so the machine's load falls on all of them alike.

Variants (glibc malloc settings, applied in the process before the engine starts):
  arenas2      what `vlmstream infer` does on the CPU: at most 2 malloc arenas (engine.CPU_MALLOC_ARENAS)
  mmap1m       the same, and allocations of 1 MiB or more always mmapped (M_MMAP_THRESHOLD fixed at 1 MiB): glibc
               otherwise raises its threshold after the first large free, then serves large tensors from the heap
               and keeps the freed pages
  mmap4m, mmap16m  the same at 4 and 16 MiB

    python benchmarks/bench_cpu_memory.py [--seconds 150] [--variants arenas2,mmap1m] [--every 15]

Prints one JSON line per variant (RSS per reading, batches done) and a table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
VARIANTS = {"arenas2": {}, "mmap1m": {"mmap_threshold": 1 << 20}, "mmap4m": {"mmap_threshold": 4 << 20},
            "mmap16m": {"mmap_threshold": 16 << 20}}


def child(variant: str, seconds: float, every: float, seed: int) -> None:
    import numpy as np
    import torch

    from consumers.infer.engine import InferenceRequest, cap_malloc_arenas
    from consumers.infer.tiny_model import default_tiny_model_dir
    from consumers.infer.transformers_engine import TransformersEngine
    from vlmstream.config import InferSettings
    from vlmstream.profiling import resident_mb

    torch.set_num_threads(1)
    cap_malloc_arenas(2)
    threshold = VARIANTS[variant].get("mmap_threshold")
    if threshold:
        ctypes.CDLL(None).mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(threshold))
    rng = random.Random(seed)
    pixels = np.random.default_rng(seed).integers(0, 256, (448, 448, 3), dtype=np.uint8)

    def image() -> np.ndarray:  # a random exact size up to 0.2 MP (multiples of 28), as decode ships them
        h, w = rng.randint(2, 16) * 28, rng.randint(2, 16) * 28
        return np.ascontiguousarray(pixels[:h, :w])

    readings, batches = [], 0
    with TransformersEngine(default_tiny_model_dir(), InferSettings(batch_size=8), device="cpu",
                            ignore_eos=True) as engine:
        started = time.monotonic()
        next_reading = started
        while time.monotonic() - started < seconds:
            images = [image() for _ in range(8)]
            engine.submit([InferenceRequest(f"b{batches}-{i}", im, (1, im.shape[0] // 14, im.shape[1] // 14),
                                            "Describe this image.", 8, want_embedding=True)
                           for i, im in enumerate(images)])
            got = 0
            while got < len(images):
                got += len(engine.poll(5))
            batches += 1
            if time.monotonic() >= next_reading:
                readings.append([round(time.monotonic() - started), round(resident_mb())])
                next_reading += every
        readings.append([round(time.monotonic() - started), round(resident_mb())])
    print(json.dumps({"variant": variant, "batches": batches, "rss_mb": readings}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--every", type=float, default=15.0)
    ap.add_argument("--variants", default="arenas2,mmap1m")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.seconds, args.every, args.seed)
        return
    procs = [subprocess.Popen([sys.executable, __file__, "--child", v, "--seconds", str(args.seconds),
                               "--every", str(args.every), "--seed", str(args.seed)],
                              stdout=subprocess.PIPE, text=True,
                              env={**{k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"},
                                   "OMP_NUM_THREADS": "1"})
             for v in args.variants.split(",")]
    rows = []
    for proc in procs:
        out, _ = proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if not lines:
            raise SystemExit(f"a variant failed (exit {proc.returncode})")
        rows.append(json.loads(lines[-1]))
        print(lines[-1])
    print("\n| variant | batches | RSS first reading MB | RSS last MB | growth MB | RSS at each reading |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        series = [mb for _, mb in r["rss_mb"]]
        print(f"| {r['variant']} | {r['batches']} | {series[0]} | {series[-1]} | {series[-1] - series[0]:+d} | "
              f"{', '.join(map(str, series))} |")


if __name__ == "__main__":
    main()
