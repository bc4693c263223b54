"""Decoded pixels as vLLM ``image_embeds`` rows, for our tower in vLLM's engine process (``infer.engine_tower`` in
embeds mode).

vLLM takes a Qwen image either as pixels, which its processor normalises and patchifies on the CPU into float32
(4,704 bytes per 14-px patch), or as ``image_embeds``: one row per merged visual token, passed through untouched and
split per image by the grid (``image_grid_thw``), with no check of the rows' width or dtype before the model's
``_process_image_input``. An exact-size H x W x 3 uint8 image holds exactly ``merge_size**2 * patch_size**2 * 3``
bytes per merged token (2,352 for Qwen2/2.5-VL, 3,072 for Qwen3-VL), so its bytes, viewed as that many rows, travel
to the engine as image_embeds without a copy: an eighth of the float32 pixels, with no processor work on the CPU.
The engine side (``engine_tower``) views the rows as the image again and patchifies it on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from vlmstream.models.family import ModelFamily


def row_width(family: ModelFamily) -> int:
    """Bytes of one merged visual token's pixels: its merge_size x merge_size patches, RGB."""
    return family.merge_size ** 2 * family.patch_size ** 2 * 3


def pack(image: np.ndarray, grid_thw: tuple[int, int, int], family: ModelFamily) -> torch.Tensor:
    """One exact-size H x W x 3 uint8 image (its grid ``grid_thw``) -> its bytes as (visual tokens, row_width) uint8
    rows, sharing the image's memory."""
    _, grid_h, grid_w = grid_thw
    height, width = grid_h * family.patch_size, grid_w * family.patch_size
    if image.dtype != np.uint8 or image.shape != (height, width, 3):
        raise ValueError(f"expected a {height} x {width} x 3 uint8 image for grid {tuple(grid_thw)}, got {image.dtype} "
                         f"{image.shape}")
    return torch.from_numpy(np.ascontiguousarray(image)).view(-1, row_width(family))


def unpack(rows: torch.Tensor, grid_thw: torch.Tensor, family: ModelFamily) -> list[torch.Tensor]:
    """The rows of one or more images, concatenated as vLLM batches them, with their (n, 3) grids -> each image as
    H x W x 3 uint8, on the rows' device (views, no copy)."""
    grids = grid_thw.tolist()
    tokens = [t * h * w // family.merge_size ** 2 for t, h, w in grids]
    if rows.dtype != torch.uint8 or rows.shape != (sum(tokens), row_width(family)):
        raise ValueError(f"pixel rows of {rows.dtype} {tuple(rows.shape)} do not fit grids {grids}: expected uint8 "
                         f"({sum(tokens)}, {row_width(family)})")
    return [part.reshape(h * family.patch_size, w * family.patch_size, 3)
            for part, (_, h, w) in zip(rows.split(tokens), grids)]


def are_pixel_rows(image_input: dict) -> bool:
    """Whether a vLLM Qwen model's image input carries pixel rows (uint8 image_embeds) rather than embeddings."""
    return image_input["type"] == "image_embeds" and image_input["image_embeds"].dtype == torch.uint8
