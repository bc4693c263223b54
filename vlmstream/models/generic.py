"""The generic path: any image-text model whose checkpoint no family module describes (Gemma 3, InternVL3,
LLaVA-OneVision, Idefics3/SmolVLM, ...). The model's own processor does its model-specific resize, normalisation and
patching in the engine; decode fetches, decodes, orients and converts as for every family, and caps the RGB it ships
at what that processor keeps, read from the checkpoint's preprocessor_config.json (``processor_cap``), so the image
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


def processor_extent(processor: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """(largest height, largest width, largest longer side) the processor resizes an image to, from its
    preprocessor config; None where it sets no bound. Tiling processors bound the whole grid of tiles:
    ``image_grid_pinpoints`` (LLaVA-NeXT/OneVision), ``max_patches`` with ``crop_to_patches`` (InternVL's), pan and
    scan crops (Gemma 3), and Idefics3/SmolVLM's ``longest_edge`` before it splits."""
    size = processor.get("size") or {}
    if isinstance(size, int):
        size = {"height": size, "width": size}
    pinpoints = processor.get("image_grid_pinpoints")
    if pinpoints:
        return max(p[0] for p in pinpoints), max(p[1] for p in pinpoints), None
    if "height" in size and "width" in size:
        height, width = int(size["height"]), int(size["width"])
        tiles = 1
        if processor.get("crop_to_patches"):
            tiles = int(processor.get("max_patches") or 12)
        if processor.get("do_pan_and_scan"):
            tiles = int(processor.get("pan_and_scan_max_num_crops") or 4)
        return height * tiles, width * tiles, None
    if "longest_edge" in size:
        return None, None, int(size["longest_edge"])
    return None, None, None


def processor_cap(processor: dict[str, Any]):
    """The generic size rule: ``(height, width, factor, min_pixels, max_pixels) -> (height, width)``, never larger
    than the source or than the processor's extent on either axis, the longer side within its longest edge, and the
    area within ``max_pixels`` (the user's budget; aspect kept, the longer side first)."""
    max_h, max_w, longest = processor_extent(processor)

    def rule(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        # A fixed-size resize distorts anyway: each axis is capped on its own, a first step of that same resize.
        # (An empty image never gets here: the decoder refuses its header.)
        h = min(height, max_h) if max_h else height
        w = min(width, max_w) if max_w else width
        if longest and max(h, w) > longest:
            scale = longest / max(h, w)
            h, w = max(1, int(h * scale)), max(1, int(w * scale))
        if h * w > max_pixels:
            scale = math.sqrt(max_pixels / (h * w))
            h, w = max(1, int(h * scale)), max(1, int(w * scale))
        return h, w

    return rule


def generic_family(config: dict[str, Any], processor: dict[str, Any]) -> ModelFamily:
    """The generic family of a checkpoint: its ``config.json`` and ``preprocessor_config.json`` (parsed)."""
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
