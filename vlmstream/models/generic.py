"""The generic path: any image-text model whose checkpoint no family module describes (Gemma 3, InternVL3,
LLaVA-OneVision, Idefics3/SmolVLM, ...). The model's own processor does its model-specific resize, normalisation and
patching in the engine; decode fetches, decodes, orients and converts as for every family, and caps the RGB it ships
at what that processor keeps, read from the checkpoint's image processor settings (``processor_cap``), so the image
on the topic is never larger than the processor's own resize would make it, and never enlarged.

Nothing here is exact to the patch: ``grid_thw`` of a generic image is an estimate in ``ESTIMATE_PATCH`` px patches
(2 x 2 merged), which only the inference runner's in-flight token bound reads; the engine counts the model's real
image tokens. The generic path runs in ``pixels`` mode only: there is no tower of ours to hand ``image_embeds`` from.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from vlmstream.models.family import ModelFamily

ESTIMATE_PATCH = 14
# A processor that names no budget: the decode budget alone bounds the image.
UNBOUNDED = 1 << 40


def _size(processor: dict[str, Any]) -> dict[str, int]:
    size = processor.get("size") or {}
    if isinstance(size, int):
        return {"height": size, "width": size}
    return {key: int(value) for key, value in size.items() if isinstance(value, (int, float))}


def select_best_resolution(height: int, width: int, resolutions: list) -> tuple[int, int]:
    """The (height, width) of ``resolutions`` LLaVA-NeXT/OneVision's processor tiles an image of this size into:
    the most of the image's pixels kept, then the least padding (transformers' ``select_best_resolution``)."""
    best, best_effective, best_wasted = (0, 0), 0, float("inf")
    for res_h, res_w in resolutions:
        scale = min(res_w / width, res_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = res_h * res_w - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (int(res_h), int(res_w)), effective, wasted
    return best


def tiled_canvas(height: int, width: int, min_tiles: int, max_tiles: int, tile_area: int) -> tuple[int, int]:
    """(columns, rows) of the tile grid InternVL's processor (``crop_to_patches``) resizes an image of this size to:
    the grid's aspect ratio nearest the image's; on a tie, more tiles while the image's area is over half theirs
    (transformers' ``get_optimal_tiled_canvas``, vLLM's ``find_closest_aspect_ratio``)."""
    grids = sorted(((w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1)
                    if min_tiles <= w * h <= max_tiles), key=lambda grid: grid[0] * grid[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for columns, rows in grids:
        diff = abs(aspect - columns / rows)
        if diff < best_diff:
            best, best_diff = (columns, rows), diff
        elif diff == best_diff and area > 0.5 * tile_area * columns * rows:
            best = (columns, rows)
    return best


def tiling_choice(processor: dict[str, Any], height: int, width: int) -> tuple[int, int] | None:
    """What a tiling processor decides for an image of this size: LLaVA's best resolution, InternVL's grid."""
    size = _size(processor)
    if processor.get("image_grid_pinpoints"):
        return select_best_resolution(height, width, processor["image_grid_pinpoints"])
    if "height" in size and "width" in size and processor.get("crop_to_patches"):
        return tiled_canvas(height, width, int(processor.get("min_patches") or 1),
                            int(processor.get("max_patches") or 12), size["height"] * size["width"])
    return None


def kept_scale(processor: dict[str, Any], height: int, width: int) -> float | None:
    """The least uniform scale of an image at which every resize a tiling processor makes of it still keeps or
    shrinks both axes: shipped at that scale (aspect kept), the processor makes the same choices (tile grid, best
    resolution) and finds every pixel it uses. None for a processor without pinpoints or ``crop_to_patches``."""
    size = _size(processor)
    fixed = (size["height"], size["width"]) if "height" in size and "width" in size else None
    pinpoints = processor.get("image_grid_pinpoints")
    if pinpoints:  # LLaVA-NeXT/OneVision: the image fitted into its best resolution, and a base image at `size`
        best_h, best_w = tiling_choice(processor, height, width)
        needed = min(best_w / width, best_h / height)
        if fixed:
            needed = max(needed, fixed[0] / height, fixed[1] / width)
        elif "shortest_edge" in size:  # shortest edge resized to it, then a centre crop
            needed = max(needed, size["shortest_edge"] / min(height, width))
        return needed
    if fixed and processor.get("crop_to_patches"):  # InternVL: a fixed resize to the grid of tiles (and a thumbnail)
        columns, rows = tiling_choice(processor, height, width)
        return max(fixed[0] * rows / height, fixed[1] * columns / width)
    return None


def shrunk_keeping_choice(processor: dict[str, Any], height: int, width: int, scale: float) -> tuple[int, int]:
    """The image's size scaled by ``scale`` (its ``kept_scale``), rounded so that the processor still decides as for
    the whole image and still only shrinks it: two grids whose aspect ratios are equally near the image's tie, and
    a pixel of rounding would break the tie. The whole image's size where no rounding keeps the choice."""
    choice = tiling_choice(processor, height, width)

    def up(x: float) -> int:  # (448.00000000000006 is 448)
        return math.ceil(x - 1e-6)

    for round_h in (up, math.floor):
        for round_w in (up, math.floor):
            h = min(height, max(1, round_h(height * scale)))
            w = min(width, max(1, round_w(width * scale)))
            if tiling_choice(processor, h, w) == choice and kept_scale(processor, h, w) <= 1 + 1e-9:
                return h, w
    return height, width


# The image processors whose resize this module models, by transformers' class name (without "Fast" or "Pil"); a
# checkpoint of any other keeps the image's size and the budget alone bounds it. Classes keep, pad or tile in ways a
# size key does not say: Janus and DeepSeek-VL fit an image into their square keeping its aspect and pad it, Fuyu
# fits into its canvas, Cohere2Vision tiles by its own rule, and GLM-5's `longest_edge` is no edge at all; a per-axis
# or edge cap read from their `size` would distort or shrink what they see. Each class listed here is run by
# tests/test_families.py on sizes the cap cuts, the whole image against the shipped copy: the same tensors.
FIXED_RESIZE = frozenset({"Gemma3ImageProcessor", "SiglipImageProcessor", "BlipImageProcessor",
                          "IdeficsImageProcessor"})  # to size.height x size.width, the aspect ratio ignored
LONGEST_EDGE = frozenset({"Idefics2ImageProcessor", "Idefics3ImageProcessor", "SmolVLMImageProcessor",
                          "PixtralImageProcessor"})  # the longer side to size.longest_edge, the aspect kept
TILING = frozenset({"LlavaNextImageProcessor", "LlavaOnevisionImageProcessor", "GotOcr2ImageProcessor"})
MODELLED = FIXED_RESIZE | LONGEST_EDGE | TILING


def processor_class(processor: dict[str, Any]) -> str:
    """The image processor's transformers class, its fast and PIL variants under the one name."""
    name = str(processor.get("image_processor_type") or "")
    for suffix in ("Fast", "Pil"):
        name = name.removesuffix(suffix)
    return name


# Tiling schemes this module does not model (Mllama's max_image_tiles, Aria's split_image, Phi's crops, Gemma 3's
# pan and scan): where one is on, a cap could take pixels its tiles use, so the image keeps its size.
UNMODELLED_TILING = ("max_image_tiles", "split_image", "num_crops", "dynamic_hd", "do_pan_and_scan", "max_num_tiles")


def unmodelled_tiling(processor: dict[str, Any]) -> bool:
    if any(processor.get(key) for key in UNMODELLED_TILING):
        return True
    if processor.get("max_patches") and not processor.get("crop_to_patches"):
        return True  # Llama 4's tiles, Pix2Struct's patch budget
    # Idefics2 splits the whole image into crops; Idefics3/SmolVLM (with max_image_size) split after their
    # longest-edge resize, which the rule below keeps.
    return bool(processor.get("do_image_splitting") and not processor.get("max_image_size"))


def processor_cap(processor: dict[str, Any]):
    """The generic size rule: ``(height, width, factor, min_pixels, max_pixels) -> (height, width)``: never larger
    than the source or than what the processor keeps of it, and the area within ``max_pixels`` (the user's budget;
    aspect kept).

    - A tiling processor (LLaVA-NeXT/OneVision's grid pinpoints, InternVL's ``crop_to_patches``): the image scaled
      by ``kept_scale``, aspect kept, since the tiles it gets depend on the aspect ratio.
    - A plain fixed-size resize (Gemma 3, SigLIP): each axis capped on its own, a first step of that same resize,
      which ignores the aspect ratio anyway.
    - A longest edge (Idefics3/SmolVLM): scaled so the longer side fits.
    - A processor class not in ``MODELLED``, a tiling scheme it does not model (``UNMODELLED_TILING``), or no size
      it knows: the budget alone."""
    size = _size(processor)
    kind = processor_class(processor)
    fixed = (size["height"], size["width"]) if "height" in size and "width" in size and kind in FIXED_RESIZE else None
    tiles = kind in TILING and bool(processor.get("image_grid_pinpoints") or processor.get("crop_to_patches"))
    unmodelled = kind not in MODELLED or (not tiles and unmodelled_tiling(processor))
    longest = size.get("longest_edge") if kind in LONGEST_EDGE else None

    def rule(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        # (An empty image never gets here: the decoder refuses its header.)
        h, w = height, width
        if tiles:
            scale = kept_scale(processor, height, width)
            if scale is not None and scale < 1:
                h, w = shrunk_keeping_choice(processor, height, width, scale)
        elif unmodelled:
            pass
        elif fixed:
            h, w = min(height, fixed[0]), min(width, fixed[1])
        elif longest and max(h, w) > longest:
            scale = longest / max(h, w)
            h, w = max(1, int(h * scale)), max(1, int(w * scale))
        if h * w > max_pixels:
            scale = math.sqrt(max_pixels / (h * w))
            h, w = max(1, int(h * scale)), max(1, int(w * scale))
        return h, w

    return rule


def tiling_in_config(config: dict[str, Any]) -> dict[str, Any]:
    """Tiles a checkpoint sets in its ``config.json``, as the preprocessor-config keys this module reads. InternVL's
    original checkpoints (``internvl_chat``) do so (``max_dynamic_patch`` and friends), and vLLM tiles them by it
    whatever their ``preprocessor_config.json`` says, with the same grid rule as ``tiled_canvas``."""
    if "max_dynamic_patch" not in config:
        return {}
    tile = int(config.get("force_image_size") or (config.get("vision_config") or {}).get("image_size") or 448)
    dynamic = config.get("dynamic_image_size", True)
    # vLLM tiles these by InternVL's grid rule, GotOcr2's (``tiled_canvas``), whatever processor class they name.
    return {"image_processor_type": "GotOcr2ImageProcessor", "crop_to_patches": True,
            "size": {"height": tile, "width": tile},
            "min_patches": int(config.get("min_dynamic_patch") or 1) if dynamic else 1,
            "max_patches": int(config["max_dynamic_patch"]) if dynamic else 1}


def generic_family(config: dict[str, Any], processor: dict[str, Any]) -> ModelFamily:
    """The generic family of a checkpoint: its ``config.json`` and image processor settings (parsed;
    ``registry.image_processor_config``)."""
    processor = {**processor, **tiling_in_config(config)}
    return replace(GENERIC, model_types=(config.get("model_type") or "",),
                   architectures=tuple(config.get("architectures") or ()),
                   image_mean=tuple(processor.get("image_mean") or GENERIC.image_mean),
                   image_std=tuple(processor.get("image_std") or GENERIC.image_std),
                   size_rule=processor_cap(processor))


GENERIC = ModelFamily(
    name="generic",
    model_types=(),
    architectures=(),
    patch_size=ESTIMATE_PATCH,
    merge_size=2,
    temporal_patch_size=1,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    min_pixels=1,
    max_pixels=UNBOUNDED,
    processor_max_pixels=UNBOUNDED,
    size_rule=processor_cap({}),
    exact_size=False,
)
