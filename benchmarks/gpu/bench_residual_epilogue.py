"""A vision block's last step alone on the GPU: the MLP's down projection plus the residual stream, as the fast
vision blocks run it (``x + linear(h, W, b)``: the matrix product with its bias, then an add kernel that reads both
and writes the sum) against the residual taken into the matrix product (``addmm(x + b, h, W.T)``: cuBLAS adds its C
operand in the product's epilogue, and ``x + b`` would come from the norm kernel before it, which writes ``x``
anyway). The second form was measured no faster (RESULTS.md [w]), so the blocks keep the first. Side by side in one
process, at the patch counts of the engine's forwards at each budget:
  qwen2.5-vl  Qwen2.5-VL-7B's tower: 3,456 columns (3,420 padded) down to 1,280
  qwen3-vl    Qwen3-VL-8B's tower: 4,352 columns (4,304 padded) down to 1,152

Each row: microseconds per call (CUDA events over ``--calls`` calls after warm-up) and the largest difference from
the float32 result of each form. Needs only torch:
  python3 benchmarks/gpu/bench_residual_epilogue.py --out residual_epilogue.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.bench_mlp_activation import kernel_bench_args, per_call_us  # noqa: E402

# Patches per forward: 16 images at 0.2 MP, 8 at 1 MP, 2 at 12.8 MP (Qwen2.5-VL's counts on the kit's first images).
PATCHES = {"0.2 MP": 16 * 241 * 4, "1 MP": 8 * 1270 * 4, "12.8 MP": 2 * 5187 * 4}
TOWERS = {"qwen2.5-vl": (3456, 1280), "qwen3-vl": (4352, 1152)}


def separate_add(x, xb, h, weight, bias):
    return x + torch.nn.functional.linear(h, weight, bias)


def in_epilogue(x, xb, h, weight, bias):
    return torch.addmm(xb, h, weight.t())


def main() -> None:
    args = kernel_bench_args(__doc__)

    variants = {"separate_add": separate_add, "in_epilogue": in_epilogue}
    rows, ratios = [], {}
    for tower, (inner, hidden) in TOWERS.items():
        for budget, patches in PATCHES.items():
            gen = torch.Generator(device="cuda").manual_seed(0)
            bf16 = dict(device="cuda", dtype=torch.bfloat16)
            x = torch.randn(patches, hidden, generator=gen, **bf16)
            h = torch.randn(patches, inner, generator=gen, **bf16)
            weight = torch.randn(hidden, inner, generator=gen, **bf16) * inner ** -0.5
            bias = torch.randn(hidden, generator=gen, **bf16)
            xb = x + bias
            inputs = (x, xb, h, weight, bias)
            exact = x.float() + h.float() @ weight.float().t() + bias.float()
            errors = {name: (fn(*inputs).float() - exact).abs().max().item() for name, fn in variants.items()}
            timed = {name: [] for name in variants}
            for round_ in range(args.rounds):
                for name, fn in variants.items():
                    us = per_call_us(lambda: fn(*inputs), args.calls)
                    timed[name].append(us)
                    rows.append({"tower": tower, "budget": budget, "patches": patches, "variant": name,
                                 "round": round_ + 1, "us_per_call": round(us, 1),
                                 "max_abs_error_vs_float32": errors[name]})
                    print("RESULT", json.dumps(rows[-1]), flush=True)
            mean = {name: sum(t) / len(t) for name, t in timed.items()}
            ratios[f"{tower} {budget}"] = round(mean["separate_add"] / mean["in_epilogue"], 3)
            print("SPEEDUP in_epilogue over separate_add", tower, budget, ratios[f"{tower} {budget}"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows, "speedup_in_epilogue": ratios}, indent=1))


if __name__ == "__main__":
    main()
