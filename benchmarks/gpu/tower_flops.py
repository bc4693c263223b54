"""Floating-point operations of one vision-tower forward, counted from the checkpoint's vision config and the
images' grids, so a measured time per image becomes achieved TFLOPS.

Only matrix products count (patch embedding, q/k/v and output projections, MLPs, attention's two products, the
patch mergers), 2 FLOPs per multiply-add: the convention of torch.utils.flop_counter, against which
tests/test_gpu_bench_parts.py checks this count on tiny towers of each family on the CPU. Norms, rotary
embeddings and activations are left out (under 1% of the total at any budget).

Families: qwen2_vl (full attention, two-matrix MLP), qwen2_5_vl (window attention but in
``fullatt_block_indexes``, gated MLP), qwen3_vl / qwen3_vl_moe (full attention, two-matrix MLP, one extra patch
merger per DeepStack layer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

H200_DENSE_BF16_TFLOPS = 989.4  # NVIDIA's H200 SXM figure for dense BF16 tensor-core work (no sparsity)


def _window_lengths(grid: tuple[int, int, int], vision: Mapping[str, Any]) -> list[int]:
    """Patches in each attention window of one image, by transformers' own window split."""
    import torch
    from transformers.vision_utils import get_vision_window_index

    _, cu_windows = get_vision_window_index(torch.tensor([grid]), spatial_merge_size=vision["spatial_merge_size"],
                                            window_size=vision["window_size"], patch_size=vision["patch_size"])
    bounds = cu_windows.tolist()
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _dims(vision: Mapping[str, Any], model_type: str) -> tuple[int, int, int, bool]:
    """(hidden width, MLP width, output width, gated MLP?) of the tower's blocks."""
    if model_type == "qwen2_vl":
        hidden = vision["embed_dim"]
        return hidden, int(hidden * vision["mlp_ratio"]), vision["hidden_size"], False
    gated = model_type == "qwen2_5_vl"
    return vision["hidden_size"], vision["intermediate_size"], vision["out_hidden_size"], gated


def tower_flops(config: Mapping[str, Any], grids: Iterable[tuple[int, int, int]]) -> int:
    """FLOPs of one forward over images with these (frames, rows, columns) patch grids; ``config`` is the
    checkpoint's parsed config.json."""
    model_type = config["model_type"]
    vision = config["vision_config"]
    hidden, mlp, out, gated = _dims(vision, model_type)
    merge = vision["spatial_merge_size"] ** 2
    patch_in = vision.get("in_channels", vision.get("in_chans", 3)) * vision["temporal_patch_size"] \
        * vision["patch_size"] ** 2
    full_layers = set(range(vision["depth"]))
    if model_type == "qwen2_5_vl":
        full_layers = set(vision["fullatt_block_indexes"])
    mergers = 1 + len(vision.get("deepstack_visual_indexes") or [])
    total = 0
    for grid in grids:
        frames, rows, columns = (int(x) for x in grid)
        patches = frames * rows * columns
        full = frames * (rows * columns) ** 2  # sum of L^2 over the frames, each frame its own sequence
        windowed = sum(length * length for length in _window_lengths((frames, rows, columns), vision)) \
            if len(full_layers) < vision["depth"] else 0
        total += 2 * patches * patch_in * hidden
        for layer in range(vision["depth"]):
            total += 2 * patches * hidden * (3 * hidden + hidden)  # q, k, v and the output projection
            total += 2 * patches * hidden * mlp * (3 if gated else 2)
            total += 4 * hidden * (full if layer in full_layers else windowed)  # Q K^T and P V
        tokens = patches // merge
        total += mergers * 2 * tokens * (merge * hidden) * (merge * hidden + out)
    return total


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12 if seconds > 0 else 0.0
