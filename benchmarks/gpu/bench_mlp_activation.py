"""A vision block's MLP activation alone on the GPU: the kernel Inductor compiles (what the fast vision blocks run
where Triton does not import) against the Triton kernels of ``consumers/infer/vision/mlp_activation.py`` and eager
torch, side by side in one process, at the patch counts of the engine's forwards at each budget:
  silu_gate   Qwen2.5-VL-7B's gated MLP, silu(gate) * up on its merged (patches, 2 x 3,456) projection
  gelu_tanh   Qwen3-VL-8B's GELU (tanh form) on its 4,304 columns padded to 4,352
  quick_gelu  Qwen2-VL-7B's quick GELU on its 5,120 columns

Each row: microseconds per call (CUDA events over ``--calls`` calls after warm-up), the memory moved per call
(inputs read, output written) and the bandwidth that makes, and the largest difference between the Triton kernel's
output and the compiled kernel's; the ratios are against the compiled kernel. Needs only torch and Triton (no vLLM,
no transformers):
  python3 benchmarks/gpu/bench_mlp_activation.py --out mlp_activation.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from consumers.infer.vision.blocks import compiled_in_process  # noqa: E402
from consumers.infer.vision.mlp_activation import gelu_tanh, quick_gelu, silu_gate, triton_kernels  # noqa: E402

# Patches per forward: 16 images at 0.2 MP, 8 at 1 MP, 2 at 12.8 MP (Qwen2.5-VL's counts on the kit's first images).
PATCHES = {"0.2 MP": 16 * 241 * 4, "1 MP": 8 * 1270 * 4, "12.8 MP": 2 * 5187 * 4}


def per_call_us(call, calls: int) -> float:
    """Microseconds per ``call()`` on the GPU: CUDA events around ``calls`` calls, after three to warm up."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def kernel_bench_args(description: str) -> argparse.Namespace:
    """The command line of a kernel-alone benchmark: calls per timing, rounds, the JSON file to write."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2, help="every variant timed this many times, in turn")
    ap.add_argument("--out", default="")
    return ap.parse_args()


def time_against_compiled(args: argparse.Namespace, variants: dict, call, moved: int, row: dict,
                          rows: list) -> dict:
    """Each variant (``call(fn)`` runs it) timed ``args.rounds`` times in turn, a row each (``row``'s fields, then
    the variant's timing and the bandwidth that ``moved`` bytes a call make), printed and appended to ``rows``;
    returns each variant's speed against the compiled one."""
    timed = {name: [] for name in variants}
    for round_ in range(args.rounds):
        for name, fn in variants.items():
            us = per_call_us(lambda fn=fn: call(fn), args.calls)
            timed[name].append(us)
            rows.append({**row, "variant": name, "round": round_ + 1, "us_per_call": round(us, 1),
                         "mb_moved": round(moved / 1e6, 1), "tb_per_s": round(moved / us / 1e6, 2)})
            print("RESULT", json.dumps(rows[-1]), flush=True)
    mean = {name: sum(t) / len(t) for name, t in timed.items()}
    return {name: round(mean["compiled"] / mean[name], 3) for name in variants}


def write_report(path: str, rows: list, speedups: dict) -> None:
    if path:
        Path(path).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "rows": rows, "speedup_over_compiled": speedups}, indent=1))


def main() -> None:
    args = kernel_bench_args(__doc__)

    kernels = triton_kernels()
    # activation: (torch function, Triton kernel, input columns, output columns)
    activations = {"silu_gate": (silu_gate, kernels.silu_gate, 2 * 3456, 3456),
                   "gelu_tanh": (gelu_tanh, kernels.gelu_tanh, 4352, 4352),
                   "quick_gelu": (quick_gelu, kernels.quick_gelu, 5120, 5120)}
    rows, ratios = [], {}
    for activation, (reference, kernel, columns_in, columns_out) in activations.items():
        variants = {"compiled": compiled_in_process(reference), "triton": kernel, "eager": reference}
        for budget, patches in PATCHES.items():
            x = torch.randn(patches, columns_in, device="cuda", dtype=torch.bfloat16)
            max_error = (kernel(x).float() - variants["compiled"](x).float()).abs().max().item()
            moved = patches * (columns_in + columns_out) * x.element_size()
            ratios[f"{activation} {budget}"] = time_against_compiled(
                args, variants, lambda fn, x=x: fn(x), moved, {"activation": activation, "budget": budget,
                                                              "patches": patches,
                                                              "triton_vs_compiled_max_abs_error": max_error}, rows)
            print("SPEEDUP over compiled", activation, budget, json.dumps(ratios[f"{activation} {budget}"]), flush=True)
    write_report(args.out, rows, ratios)


if __name__ == "__main__":
    main()
