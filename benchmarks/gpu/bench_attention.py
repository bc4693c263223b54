"""The vision towers' attention alone on the GPU: vLLM's FlashAttention 3 (what the fast vision blocks call, one
packed varlen call per layer) against torch's own packed varlen call (FlashAttention 2, ``torch_varlen``) and
torch's scaled_dot_product_attention backends (cuDNN, flash, memory-efficient) called once per sequence, or once
over a batch of equal windows, side by side in one process.

Two shapes, at the head widths of the towers we run (Qwen2.5-VL: 16 heads of 80; Qwen3-VL and Qwen3.5: 16 of 72):
  full     the full-attention layers: each image one sequence of all its patches (--lengths: patches per image;
           5,120 is about 1 MP, 20,480 about 4 MP, 65,536 the 12.8 MP limit, where the memory-efficient backend
           alone takes minutes), --images of them per call
  window   Qwen2.5-VL's window layers: sequences of 64 patches (8 x 8), --window-tokens patches per call

Each row: microseconds per call (CUDA events over calls for --seconds after warm-up), achieved TFLOPS from the
attention's two matrix products (4 * length^2 * heads * head width per sequence), and the largest difference from
FA3's output; for the full shape also the first call at a length not seen before (a backend that builds a plan per
shape pays it for every new image size). FLOPs count the head width as it is (80, 72): kernels that pad it internally get no credit for it.
Needs torch and vLLM's FA3 (the GPU kit):
  python3 benchmarks/gpu/bench_attention.py --out attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from consumers.infer.vision.attention import VARLEN_KERNELS, pick_vision_attention, windowed_sdpa  # noqa: E402

SDPA_BACKENDS = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def per_sequence(backend):
    """SDPA over each sequence of a packed (tokens, heads, dim) batch (the blocks' own per-window loop), on one
    backend."""
    def attend(q, k, v, bounds, scale):
        with sdpa_kernel([backend]):
            return windowed_sdpa(q, k, v, torch.tensor(bounds), scale)
    return attend


def equal_windows(backend, window: int):
    """SDPA over a batch of equal windows of a packed batch: one call, (windows, heads, window, dim)."""
    def attend(q, k, v, bounds, scale):
        shaped = [t.view(-1, window, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(*shaped, scale=scale)
        return out.transpose(1, 2).reshape(q.shape)
    return attend


def time_calls(fn, seconds: float) -> float:
    """Microseconds per call, by CUDA events over as many calls as fill ``seconds``."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, began = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - began < seconds:
        fn()
        calls += 1
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dims", default="80,72")
    parser.add_argument("--lengths", default="1024,5120,20480")
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--window-tokens", type=int, default=65536)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kernel = VARLEN_KERNELS[pick_vision_attention("cuda", torch.bfloat16, "vllm_fa3")]
    try:  # torch's own varlen flash attention (FlashAttention 2), the same packed call as FA3's
        torch_varlen = VARLEN_KERNELS[pick_vision_attention("cuda", torch.bfloat16, "torch_varlen")]
    except RuntimeError as exc:
        print(f"torch_varlen unavailable: {exc}", flush=True)
        torch_varlen = None
    rows = []
    cases = [("full", int(n), args.images) for n in args.lengths.split(",")]
    cases.append(("window", 64, args.window_tokens // 64))
    for dim in (int(d) for d in args.head_dims.split(",")):
        for shape, length, count in cases:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(length * count, args.heads, dim, generator=gen, device="cuda",
                                   dtype=torch.bfloat16) for _ in range(3))
            bounds = [i * length for i in range(count + 1)]
            cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
            scale = dim ** -0.5
            variants = {"fa3_varlen": lambda: kernel(q, k, v, cu, cu, length, length, scale)}
            if torch_varlen is not None:
                variants["torch_varlen"] = lambda: torch_varlen(q, k, v, cu, cu, length, length, scale)
            for name, backend in SDPA_BACKENDS.items():
                attend = equal_windows(backend, length) if shape == "window" else per_sequence(backend)
                variants[name] = (lambda attend=attend: attend(q, k, v, bounds, scale))
            reference = variants["fa3_varlen"]().float()
            flops = 4 * length * length * args.heads * dim * count
            row = {"shape": shape, "head_dim": dim, "length": length, "sequences": count}
            for name, fn in variants.items():
                try:
                    error = (fn().float() - reference).abs().max().item()
                    us = time_calls(fn, args.seconds)
                    row[name] = {"us": round(us, 1), "tflops": round(flops / us / 1e6, 1),
                                 "max_abs_diff_vs_fa3": round(error, 4)}
                except Exception as exc:  # noqa: BLE001 - a backend that cannot take the shape is a finding
                    row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            if shape == "full":  # a length not seen before: what a backend that plans per shape pays for it
                fresh = length - 32
                for name, backend in SDPA_BACKENDS.items():
                    torch.cuda.synchronize()
                    began = time.perf_counter()
                    try:
                        per_sequence(backend)(q[:fresh], k[:fresh], v[:fresh], [0, fresh], scale)
                        torch.cuda.synchronize()
                        row[name]["first_call_new_length_ms"] = round((time.perf_counter() - began) * 1e3, 1)
                    except Exception:  # noqa: BLE001 - reported above
                        pass
            fa3 = row["fa3_varlen"].get("us")
            row["speed_vs_fa3"] = {name: round(fa3 / r["us"], 3) for name, r in row.items()
                                   if isinstance(r, dict) and "us" in r and name != "fa3_varlen"}
            print("ATTENTION", json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
