"""A Qwen family's vision tower alone on the GPU (Qwen2.5-VL-7B's, Qwen3-VL-8B's, any checkpoint folder's): how
fast our encoder turns exact-size images into tokens.

Variants, side by side in one process on the same images (random weights: same compute as real ones), named
<blocks>+<attention>:
  transformers+...  transformers' blocks as they ship (patch embedding as a matrix product;
                    benchmarks/reference_tower.py)
  fast+...          FastVisionBlocks (Qwen2.5-VL's RMSNorm blocks or the LayerNorm blocks of Qwen2-VL, Qwen3-VL and
                    Qwen3.5), compiled, q/k/v split and rotated by the Triton kernel, the norms and the MLP's
                    activation (silu(gate) * up or a GELU) by others (what VisionEncoder runs on CUDA;
                    consumers/infer/vision/qkv_rotary.py, block_norm.py, mlp_activation.py)
with attention vllm_fa3 (vLLM's FlashAttention 3), torch_varlen (torch's varlen flash) or sdpa. Each timing covers
GPU patchify + tower forward + merger for a batch of images, synchronised, after warm-up; it prints ms per image
and images/s per budget with the spread of its timed passes, then the same number of passes queued back to back
with one wait at the end (``queued_ms_per_image``, ``queued_share_of_h200_bf16_peak``: the host prepares a pass
while the GPU runs the one before, as the pipeline's tower does), then torch.profiler tables (by GPU and by CPU time) of
where one such pass of each variant spends its time: the timed encoder itself while it is the latest made
(``timed_encoder``), so that a process's first encoder is profiled in the state that was timed, with that pass's
kernels' GPU ms per image and the share of the bf16 peak they reach by it (``KERNEL TIME``: the kernels' own
efficiency, apart from the gaps the host leaves between them), and where the GPU sat idle inside that pass
(``DEVICE GAPS``: span, busy, idle, the gaps by size and the largest with the activity either side). ``--rounds 2``
times every variant twice, the second round in reverse order.

Each row says how many blocks ran the fast forward (``fast_blocks``), whether they were compiled, and which of their
steps ran a Triton kernel (``kernels``).

Usage (device, after scripts/gpu/unpack_device.sh and `source scripts/gpu/env.sh`):
  python3 benchmarks/gpu/bench_vision_tower.py --model /root/model --imgs /root/imgs --out $OUT/tower.json
  python3 benchmarks/gpu/bench_vision_tower.py --model qwen3-vl-8b --imgs /root/imgs --out $OUT/tower_qwen3.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

from benchmarks.images import exact_size_images  # noqa: E402 - after the path insert
from benchmarks.model7b import GPU_MODELS  # noqa: E402
from benchmarks.reference_tower import TransformersBlocksEncoder  # noqa: E402
from consumers.infer.vision.blocks import block_kernels  # noqa: E402
from consumers.infer.vision.checkpoint import load_vision_tower  # noqa: E402
from consumers.infer.vision.encoder import VisionEncoder  # noqa: E402
from consumers.infer.vision.pixels import patchify_batch  # noqa: E402
from vlmstream.models.registry import family_of  # noqa: E402
from tower_flops import H200_DENSE_BF16_TFLOPS, tower_flops  # noqa: E402 - benchmarks/gpu is on sys.path

BUDGETS = {"256": 256 * 28 * 28, "1280": 1280 * 28 * 28, "default": 16384 * 28 * 28}
# Images per forward: what the engine's encoder thread batches at each budget (bounded by patches per call).
BATCH = {"256": 16, "1280": 8, "default": 2}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def achieved(row: dict, flops_per_image: float) -> dict:
    """``row`` with the tower's achieved TFLOPS (matrix products only, tower_flops.py) and its share of the H200's
    dense bf16 peak."""
    if "ms_per_image" not in row:
        return row
    out = {**row, "gflop_per_image": round(flops_per_image / 1e9, 1)}
    for prefix in ("", "queued_"):
        if f"{prefix}ms_per_image" in row:
            rate = flops_per_image / (row[f"{prefix}ms_per_image"] / 1e3) / 1e12
            out[f"{prefix}tflops"] = round(rate, 1)
            out[f"{prefix}share_of_h200_bf16_peak"] = round(rate / H200_DENSE_BF16_TFLOPS, 3)
    return out


def mean_flops(config: dict, images: list[np.ndarray], patch: int) -> float:
    """The tower's FLOPs per image over exact-size ``images`` (tower_flops.py)."""
    return tower_flops(config, [(1, im.shape[0] // patch, im.shape[1] // patch) for im in images]) / len(images)


def by_kernel_time(kernel_us: float | None, images: list[np.ndarray], config: dict, patch: int) -> dict:
    """The profiled pass's kernels' GPU ms per image and the share of the bf16 peak they reach by that time alone:
    beside the wall-clock share, it tells the kernels' own efficiency from the gaps between them (the host's
    launches, copies and waits)."""
    if not kernel_us:
        return {}
    ms = kernel_us / 1e3 / len(images)
    share = achieved({"ms_per_image": ms}, mean_flops(config, images, patch))["share_of_h200_bf16_peak"]
    return {"kernel_ms_per_image": round(ms, 2), "share_of_h200_bf16_peak_by_kernel_time": share}


def pass_over(encoder: VisionEncoder, images: list[np.ndarray], batch: int):
    """One pass over ``images`` in forwards of ``batch`` images (GPU patchify + tower), as a callable."""
    groups = [images[i:i + batch] for i in range(0, len(images), batch)]

    def one_pass():
        for g in groups:
            pixel_values, grid_thw = patchify_batch(g, encoder.device, encoder.dtype, encoder.family)
            encoder.encode_patches(pixel_values, grid_thw)

    return one_pass


def images_per_budget(asked: str, largest_batch: int) -> int | None:
    """--images as exact_size_images' count: None for 'all', one of each image of the folder."""
    if asked == "all":
        return None
    return int(asked) if asked else 2 * largest_batch


def time_encoder(encoder: VisionEncoder, images: list[np.ndarray], batch: int, min_seconds: float) -> dict:
    one_pass = pass_over(encoder, images, batch)
    one_pass()  # warm-up: kernels chosen, allocator grown
    synchronize(encoder.device)
    pass_ms: list[float] = []
    started = time.perf_counter()
    while True:
        begun = time.perf_counter()
        one_pass()
        synchronize(encoder.device)
        pass_ms.append((time.perf_counter() - begun) * 1e3)
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds:
            break
    n = len(pass_ms) * len(images)
    # The same number of passes again, queued back to back with one wait at the end. The pipeline's tower queues its
    # next pass before it waits for the last (TowerPass, vision/outputs.py), so the host prepares a pass (patchify,
    # index tensors, launches) while the GPU runs the one before; the synchronised passes above pay that preparation
    # between passes, with the GPU idle.
    synchronize(encoder.device)
    queued_from = time.perf_counter()
    for _ in pass_ms:
        one_pass()
    synchronize(encoder.device)
    queued = time.perf_counter() - queued_from
    # A clock that is still settling (a compile or a kernel choice finishing late) shows as a first pass far
    # from the fastest; a steady one as first, fastest and slowest close together.
    return {"ms_per_image": round(elapsed / n * 1e3, 2), "img_per_s": round(n / elapsed, 1), "images": n,
            "queued_ms_per_image": round(queued / n * 1e3, 2),
            "batch": batch, "pass_ms_first": round(pass_ms[0], 1), "pass_ms_min": round(min(pass_ms), 1),
            "pass_ms_max": round(max(pass_ms), 1), "passes": len(pass_ms),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
            if encoder.device.type == "cuda" else None,
            # Wall-clock bounds, to line the timing up with what else ran on the host then.
            "timed_from": time.strftime("%H:%M:%S", time.localtime(time.time() - elapsed)),
            "timed_to": time.strftime("%H:%M:%S")}


# The <blocks> half of a variant's name (module docstring).
BLOCKS = {"transformers": TransformersBlocksEncoder, "fast": VisionEncoder}


def make_encoder(tower, device: torch.device, dtype: torch.dtype, variant: str) -> VisionEncoder:
    """The encoder a variant name (``<blocks>+<attention>``, module docstring) describes."""
    blocks, attention = variant.split("+")
    if blocks not in BLOCKS:
        raise SystemExit(f"--variants: no blocks named {blocks!r} (one of {', '.join(BLOCKS)})")
    return BLOCKS[blocks](tower, device, dtype, attention=attention)


def in_rounds(variants: list[str], rounds: int) -> list[tuple[str, str]]:
    """(variant, its key) for each timing: the variants in the order given, then reversed, and so on for
    ``rounds`` rounds, so that no variant always runs first in the process (keys of later rounds end " r2", ...)."""
    order: list[tuple[str, str]] = []
    for r in range(rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            order.append((v, v if r == 0 else f"{v} r{r + 1}"))
    return order


def kernel_time_us(averages) -> float | None:
    """The GPU time of a profile's kernels, as torch's table totals it (the events on the device, not the operators
    that launched them, whose device time repeats their kernels'); None without device events."""
    from torch.autograd import DeviceType

    kernels = [e for e in averages if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    return sum(e.self_device_time_total for e in kernels) if kernels else None


def device_gaps(events, largest: int = 8) -> dict | None:
    """Where the GPU sat idle inside a profiled pass: its device activity (kernels, copies, memsets) as intervals
    on the timeline, their union (busy), the span from the first start to the last end, the idle time in between, how
    many gaps of each size, and the largest gaps with the activity on either side. None without device events.
    A pass whose span is far above its kernels' time has its loss here: between kernels, not in them. The profiler
    slows the host that launches the kernels, so these gaps can be longer than an unprofiled pass's."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    if not spans:
        return None
    # Overlapping activity (two streams, a copy beside a kernel) merges into one busy block: [start, end, the
    # activity that opened it, the one that ends it].
    blocks: list[list] = []
    for start, end, name in spans:
        if blocks and start <= blocks[-1][1]:
            if end >= blocks[-1][1]:
                blocks[-1][1], blocks[-1][3] = end, name
        else:
            blocks.append([start, end, name, name])
    busy = sum(end - start for start, end, _, _ in blocks)
    span = blocks[-1][1] - blocks[0][0]
    gaps = [(after[0] - before[1], before[3], after[2]) for before, after in zip(blocks, blocks[1:])]
    sizes = {"under 5 us": 0, "5-20 us": 0, "20-100 us": 0, "100 us and over": 0}
    for gap, _, _ in gaps:
        key = ("under 5 us" if gap < 5 else "5-20 us" if gap < 20 else "20-100 us" if gap < 100
               else "100 us and over")
        sizes[key] += 1
    top = sorted(gaps, reverse=True)[:largest]
    return {"span_us": round(span, 1), "busy_us": round(busy, 1), "idle_us": round(span - busy, 1),
            "gaps_by_size": sizes,
            "largest": [{"us": round(g, 1), "after": a[:80], "before": b[:80]} for g, a, b in top]}


def profile_table(encoder: VisionEncoder, images: list[np.ndarray], batch: int,
                  rows: int = 15) -> tuple[str, float | None, dict | None]:
    """Where one pass over ``images`` (forwards of ``batch`` images, as a timed pass runs them) spends its time, and
    its kernels' GPU time in µs (None on the CPU), and where the GPU sat idle during the pass (``device_gaps``)."""
    from torch.profiler import ProfilerActivity, profile

    one_pass = pass_over(encoder, images, batch)
    one_pass()
    synchronize(encoder.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if encoder.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        one_pass()
        synchronize(encoder.device)
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    if encoder.device.type == "cuda":
        # Both sides: where the GPU's kernels spend their time, and where the thread that launches them does. A
        # pass whose wall time is far above its kernels' time is bound by the second table (launches, copies, waits).
        table = averages.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60) + \
            "\nBy self CPU time:\n" + table
    return table, kernel_time_us(averages), device_gaps(prof.events())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/root/model", help="a checkpoint folder, or the name of a GPU model whose "
                    f"config is written here (random weights): {', '.join(sorted(GPU_MODELS))}")
    ap.add_argument("--imgs", default="/root/imgs")
    ap.add_argument("--budgets", default="256,1280,default")
    ap.add_argument("--variants", default="transformers+vllm_fa3,fast+vllm_fa3,fast+torch_varlen")
    ap.add_argument("--seconds", type=float, default=4.0, help="Minimum timed seconds per variant and budget.")
    ap.add_argument("--batches", default="", help="comma list of images per forward, each timed (default: what the "
                    "engine batches at each budget)")
    ap.add_argument("--images", default="", help="images timed at each budget: a count (the folder's first, by name, "
                    "repeated to fill), or 'all': every image of the folder, the mix gpu_bench's documents cycle "
                    "through, so that GFLOP per image and TFLOPS compare with its tower_tflops_in_engine (default: "
                    "twice the largest batch)")
    ap.add_argument("--rounds", type=int, default=1, help="time the variants this many times, every other round in "
                    "reverse order (an order effect shows as a variant's rounds disagreeing)")
    ap.add_argument("--profile-budget", default="1280", help="budget of the profiler tables (by self GPU time and by "
                    "self CPU time); empty: none")
    ap.add_argument("--out", default="tower.json")
    ap.add_argument("--device", default="cuda", help="cpu runs the same code in float32 (a plumbing check)")
    args = ap.parse_args()

    if args.model in GPU_MODELS:
        args.model = str(GPU_MODELS[args.model](f"/tmp/vlmstream-{args.model}"))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tower, _ = load_vision_tower(args.model, device, dtype)
    config = json.loads((Path(args.model) / "config.json").read_text())
    patch = config["vision_config"]["patch_size"]
    family = family_of(args.model)
    variants = args.variants.split(",")
    report: dict = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "budgets": {}}
    # (variant, encoder) of the latest encoder made, while it is one timed at the profile budget: profiled again, its
    # table shows the state that was timed, without another compile. Every encoder installs its forwards on the
    # shared tower's blocks, so only the latest one made can be profiled as it was timed.
    timed_latest: tuple[str, VisionEncoder] | None = None
    for budget in args.budgets.split(","):
        batches = [int(b) for b in args.batches.split(",")] if args.batches else [BATCH[budget]]
        images = exact_size_images(args.imgs, images_per_budget(args.images, max(batches)), BUDGETS[budget],
                                   factor=family.factor)
        rows = report["budgets"][budget] = {"mean_visual_tokens": round(float(np.mean(
            [im.shape[0] * im.shape[1] / family.factor ** 2 for im in images])), 1)}
        flops_per_image = mean_flops(config, images, patch)
        for variant, variant_key in in_rounds(variants, args.rounds):
            attention = variant.split("+")[1]
            if budget == "default" and attention == "sdpa":
                rows[variant_key] = {"skipped": "per-window Python loop: minutes per image at 12.8 MP"}
                continue
            for batch in batches:
                key = f"{variant_key} x{batch}" if args.batches else variant_key
                try:
                    timed_latest = None
                    encoder = make_encoder(tower, device, dtype, variant)
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    rows[key] = {**achieved(time_encoder(encoder, images, batch, args.seconds), flops_per_image),
                                 "fast_blocks": encoder.fast.replaced if encoder.fast else 0,
                                 "compiled": encoder.compiled, "kernels": block_kernels(encoder.fast),
                                 "window_attention": encoder.window_attention}
                    if budget == args.profile_budget and batch == BATCH[budget]:
                        timed_latest = (variant, encoder)
                except Exception as exc:  # noqa: BLE001 - one variant failing must not hide the others
                    rows[key] = {"error": repr(exc)[:400]}
                print("RESULT", budget, key, json.dumps(rows[key]), flush=True)
                Path(args.out).write_text(json.dumps(report, indent=1))
    budget = args.profile_budget
    if not budget:
        return
    report["profile"] = {"budget": budget}
    for variant in variants:
        timed = timed_latest is not None and timed_latest[0] == variant
        encoder = timed_latest[1] if timed else make_encoder(tower, device, dtype, variant)
        timed_latest = None
        # The timed passes' images (twice a batch), so that the table accounts for what a timed pass spends.
        images = exact_size_images(args.imgs, BATCH[budget] * 2, BUDGETS[budget], factor=family.factor)
        table, kernel_us, gaps = profile_table(encoder, images, BATCH[budget])
        kernel_time = by_kernel_time(kernel_us, images, config, patch)
        report["profile"][variant] = {"attention": encoder.attention, "compiled": encoder.compiled,
                                      "timed_encoder": timed, "table": table, **kernel_time, "device_gaps": gaps}
        print(f"PROFILE {variant}, budget {budget}, attention {encoder.attention}\n{table}", flush=True)
        print("KERNEL TIME", variant, budget, json.dumps(kernel_time), flush=True)
        print("DEVICE GAPS", variant, budget, json.dumps(gaps), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
