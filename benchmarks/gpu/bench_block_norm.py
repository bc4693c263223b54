"""A vision block's norms alone on the GPU: the kernels Inductor compiles (what the fast vision blocks run where
Triton does not import) against the Triton kernels of ``consumers/infer/vision/block_norm.py`` and eager torch,
side by side in one process, at the patch counts of the engine's forwards at each budget:
  rms_norm        Qwen2.5-VL-7B's norm before the attention's projection (1,280 wide, no bias)
  add_rms_norm    its residual add and norm before the MLP
  layer_norm      Qwen3-VL-8B's (1,152 wide, with a bias)
  add_layer_norm  its residual add and norm

Each row: microseconds per call (CUDA events over ``--calls`` calls after warm-up), the memory moved per call
(inputs read, outputs written, once each) and the bandwidth that makes, and the largest difference between the
Triton kernel's output and the compiled kernel's; the ratios are against the compiled kernel. Needs only torch and
Triton (no vLLM, no transformers):
  python3 benchmarks/gpu/bench_block_norm.py --out block_norm.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.bench_mlp_activation import (  # noqa: E402
    PATCHES, kernel_bench_args, time_against_compiled, write_report)
from consumers.infer.vision.block_norm import add_norm, norm, triton_kernels  # noqa: E402
from consumers.infer.vision.blocks import compiled_in_process  # noqa: E402


def main() -> None:
    args = kernel_bench_args(__doc__)
    kernels = triton_kernels()
    # case: (torch function, Triton kernel, width, with a bias, with the residual add)
    cases = {"rms_norm": (norm, kernels.norm, 1280, False, False),
             "add_rms_norm": (add_norm, kernels.add_norm, 1280, False, True),
             "layer_norm": (norm, kernels.norm, 1152, True, False),
             "add_layer_norm": (add_norm, kernels.add_norm, 1152, True, True)}
    rows, ratios = [], {}
    for case, (reference, kernel, width, with_bias, with_add) in cases.items():
        variants = {"compiled": compiled_in_process(reference), "triton": kernel, "eager": reference}
        for budget, patches in PATCHES.items():
            gen = torch.Generator(device="cuda").manual_seed(0)
            bf16 = dict(device="cuda", dtype=torch.bfloat16)
            x = torch.randn(patches, width, generator=gen, **bf16)
            weight = 1 + 0.1 * torch.randn(width, generator=gen, **bf16)
            bias = 0.1 * torch.randn(width, generator=gen, **bf16) if with_bias else None
            inputs = (x, torch.randn(patches, width, generator=gen, **bf16)) if with_add else (x,)

            def call(fn, inputs=inputs, weight=weight, bias=bias):
                return fn(*inputs, weight, bias, 1e-6)

            outputs = {name: call(fn) for name, fn in variants.items() if name != "eager"}
            max_error = max((a.float() - b.float()).abs().max().item() for a, b in zip(
                *(o if with_add else (o,) for o in outputs.values())))
            moved = patches * width * x.element_size() * (4 if with_add else 2)
            ratios[f"{case} {budget}"] = time_against_compiled(
                args, variants, call, moved, {"case": case, "budget": budget, "patches": patches,
                                              "triton_vs_compiled_max_abs_error": max_error}, rows)
            print("SPEEDUP over compiled", case, budget, json.dumps(ratios[f"{case} {budget}"]), flush=True)
    write_report(args.out, rows, ratios)


if __name__ == "__main__":
    main()
