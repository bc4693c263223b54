"""The gated MLP's ``silu(gate) * up`` alone on the GPU: the kernel Inductor compiles (what the fast vision blocks run
by default) against the Triton kernel of ``consumers/infer/gated_silu.py`` (``infer.vision_mlp_kernel=triton``) and
eager torch, side by side in one process, on the merged gate/up projection of Qwen2.5-VL-7B's tower (3,456 columns
each, 3,420 padded to 64) at the patch counts of the engine's forwards at each budget.

Each row: microseconds per call (CUDA events over ``--calls`` calls after warm-up), the memory moved per call
(gate and up read, the output written) and the bandwidth that makes; the ratios are against the compiled kernel.
Then the compiled kernel of the two-matrix MLP's activation (Qwen3-VL's GELU), for its bandwidth alone.
Needs only torch and Triton (no vLLM, no transformers):
  python3 benchmarks/gpu/bench_silu_gate.py --out silu_gate.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from consumers.infer.gated_silu import silu_gate_torch, triton_silu_gate  # noqa: E402
from consumers.infer.vision import compiled_in_process  # noqa: E402

# Patches per forward: 16 images at 0.2 MP, 8 at 1 MP, 2 at 12.8 MP (the kit's first images, 5,187 tokens each).
PATCHES = {"0.2 MP": 16 * 241 * 4, "1 MP": 8 * 1270 * 4, "12.8 MP": 2 * 5187 * 4}


def per_call_us(fn, gate_up: torch.Tensor, calls: int) -> float:
    for _ in range(3):
        fn(gate_up)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn(gate_up)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=3456, help="columns of gate (and of up)")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2, help="every variant timed this many times, in turn")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    triton_kernel = triton_silu_gate()
    variants = {"compiled": compiled_in_process(silu_gate_torch), "triton": triton_kernel, "eager": silu_gate_torch}
    rows = []
    for budget, patches in PATCHES.items():
        gate_up = torch.randn(patches, 2 * args.width, device="cuda", dtype=torch.bfloat16)
        want = variants["compiled"](gate_up)
        max_error = (triton_kernel(gate_up).float() - want.float()).abs().max().item()
        moved = gate_up.numel() * gate_up.element_size() * 3 // 2  # read gate and up, write one of their size
        for round_ in range(args.rounds):
            for name, fn in variants.items():
                us = per_call_us(fn, gate_up, args.calls)
                rows.append({"budget": budget, "patches": patches, "variant": name, "round": round_ + 1,
                             "us_per_call": round(us, 1), "mb_moved": round(moved / 1e6, 1),
                             "tb_per_s": round(moved / us / 1e6, 2), "triton_vs_compiled_max_abs_error": max_error})
                print("RESULT", json.dumps(rows[-1]), flush=True)
    ratios = {}
    for budget in PATCHES:
        mean = {name: sum(r["us_per_call"] for r in rows if r["budget"] == budget and r["variant"] == name)
                / args.rounds for name in variants}
        ratios[budget] = {name: round(mean["compiled"] / mean[name], 3) for name in variants}
        print("SPEEDUP over compiled", budget, json.dumps(ratios[budget]), flush=True)
    # The two-matrix MLP's activation (Qwen3-VL-8B's: GELU, tanh form, on its 4,304 columns padded to 4,352), as the
    # compiled blocks run it: does Inductor's kernel move as little of the bandwidth there? One read, one write.
    gelu = compiled_in_process(lambda x: torch.nn.functional.gelu(x, approximate="tanh"))
    for budget, patches in PATCHES.items():
        x = torch.randn(patches, 4352, device="cuda", dtype=torch.bfloat16)
        moved = x.numel() * x.element_size() * 2
        us = per_call_us(gelu, x, args.calls)
        rows.append({"budget": budget, "patches": patches, "variant": "compiled gelu_tanh (4,352 columns)",
                     "us_per_call": round(us, 1), "mb_moved": round(moved / 1e6, 1),
                     "tb_per_s": round(moved / us / 1e6, 2)})
        print("RESULT", json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows, "speedup_over_compiled": ratios}, indent=1))


if __name__ == "__main__":
    main()
