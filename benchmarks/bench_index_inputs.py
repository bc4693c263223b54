"""Host time of a vision forward's index tensors: transformers' vision_utils deriving them for the whole batch (what
the tower's forward would do, and what VisionEncoder did before it kept each grid's part) against
``VisionEncoder._index_inputs`` assembling them from each image grid's kept part (``GridIndexParts``), side by side
in one process, alternating per round. One CPU thread, as in the inference consumer's encoder thread and in vLLM's
engine process, where this host time comes before the tower's kernels are queued.

The batches are the real images' grids: each file of --images resized by the family's own ``smart_resize`` at each
budget, grouped as the engine groups them (up to 65,536 patches per forward). The kept parts start empty in every
round, so the first batch of a round pays for the grids it introduces.

    python benchmarks/bench_index_inputs.py [--images DIR] [--budgets 256,1280,default] [--rounds 3]

Index tensors do not depend on the tower's width: the tiny models' towers (same window, patch and merge sizes as
the released ones) stand in for the 7B/8B ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def batches_of_grids(images: list[Path], family, max_pixels: int, per_call: int = 65536) -> list[list[tuple]]:
    from PIL import Image

    grids = []
    for path in images:
        with Image.open(path) as im:
            width, height = im.size
        h, w = family.target_size(height, width, max_pixels=max_pixels)
        grids.append((1, h // family.patch_size, w // family.patch_size))
    batches, current, patches = [], [], 0
    for grid in grids:
        if current and patches + grid[1] * grid[2] > per_call:
            batches.append(current)
            current, patches = [], 0
        current.append(grid)
        patches += grid[1] * grid[2]
    return batches + ([current] if current else [])


def derive_whole_batch(encoder, grid):
    """transformers' derivation over the batch, as the tower's forward makes it when given nothing."""
    from transformers import vision_utils as vu

    visual = encoder.visual
    vu.get_vision_position_ids(grid, visual.spatial_merge_size)
    vu.get_vision_cu_seqlens(grid)
    if hasattr(visual, "num_grid_per_side"):
        vu.get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size)
    if encoder.windowed:
        vu.get_vision_window_index(grid, spatial_merge_size=visual.spatial_merge_size,
                                   window_size=visual.window_size, patch_size=visual.patch_size)


def main() -> None:
    import torch

    from consumers.infer.tiny_model import default_tiny_model_dir, write_tiny_family_model
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.encoder import GridIndexParts, VisionEncoder
    from vlmstream.models.registry import family_of

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", default="/work/shared/corpus")
    ap.add_argument("--budgets", default="256,1280,default", help="tokens (x 28*28 or 32*32 px) or 'default'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--limit", type=int, default=200, help="at most this many images")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    images = sorted(p for p in Path(args.images).rglob("*") if p.suffix.lower() in SUFFIXES)[:args.limit]
    if not images:
        sys.exit(f"no images under {args.images}")
    work = Path(tempfile.mkdtemp(prefix="bench-index-"))
    models = {"qwen2.5-vl": default_tiny_model_dir(), "qwen3-vl": write_tiny_family_model(work / "q3", "qwen3-vl")}
    rows = []
    for name, path in models.items():
        family = family_of(path)
        tower, _ = load_vision_tower(path, "cpu", torch.float32)
        encoder = VisionEncoder(tower, "cpu", torch.float32, attention="sdpa")
        for budget in args.budgets.split(","):
            unit = family.factor ** 2
            max_pixels = family.max_pixels if budget == "default" else int(budget) * unit
            batches = [torch.tensor(b) for b in batches_of_grids(images, family, max_pixels)]
            # derived: transformers over each batch; kept: the parts start empty (the set's first pass); warm: the
            # same batches again with the parts kept (a long run, where every grid has been seen).
            times = {"derived": [], "kept": [], "warm": []}
            for round_ in range(args.rounds):
                order = ("derived", "kept") if round_ % 2 == 0 else ("kept", "derived")
                for arm in order:
                    passes = ("kept", "warm") if arm == "kept" else ("derived",)
                    encoder._grid_parts = GridIndexParts(encoder._image_index_parts)
                    for timed in passes:
                        started = time.perf_counter()
                        for grid in batches:
                            if arm == "derived":
                                derive_whole_batch(encoder, grid)
                            else:
                                encoder._index_inputs(grid)
                        times[timed].append((time.perf_counter() - started) * 1e3 / len(images))
            derived, kept, warm = (min(times[k]) for k in ("derived", "kept", "warm"))
            row = {"family": name, "budget": budget, "images": len(images), "batches": len(batches),
                   "distinct_grids": len(encoder._grid_parts), "derived_ms_per_image": round(derived, 4),
                   "kept_ms_per_image": round(kept, 4), "warm_ms_per_image": round(warm, 4),
                   "ratio_first_pass": round(derived / kept, 2), "ratio_warm": round(derived / warm, 2)}
            rows.append(row)
            print(f"{name:10} budget {budget:>7}: {len(images)} images in {len(batches)} forwards, "
                  f"{row['distinct_grids']} grids; derived {derived:.3f} ms/image; kept parts {kept:.3f} on the "
                  f"first pass ({row['ratio_first_pass']}x), {warm:.3f} warm ({row['ratio_warm']}x)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
