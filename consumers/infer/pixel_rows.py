"""Decoded pixels as vLLM ``image_embeds`` rows, for our tower in vLLM's engine process (embeds mode).

vLLM takes a Qwen image either as pixels, which its processor normalises and patchifies on the CPU into float32
(4,704 bytes per 14-px patch), or as ``image_embeds``: one row per merged visual token, passed through untouched and
split per image by the grid (``image_grid_thw``), with no check of the rows' width or dtype before the model's
``_process_image_input``. An exact-size H x W x 3 uint8 image holds exactly ``merge_size**2 * patch_size**2 * 3``
bytes per merged token (2,352 for Qwen2/2.5-VL, 3,072 for Qwen3-VL), so its bytes, viewed as that many rows, travel
to the engine as image_embeds without a copy: an eighth of the float32 pixels, with no processor work on the CPU.
The engine side (``engine_tower``) views the rows as the image again and patchifies it on the GPU.

With embeddings published, each image whose embedding is wanted carries ``TAG_BYTES`` more columns in its rows, the
first row's holding a number the consumer chose (the others zero): the engine keeps the image's embedding under it,
and the consumer asks for it by it (``engine_tower.EmbeddingTap``); a tag is the whole request, untagged rows keep
nothing. vLLM splits the rows per image by their count alone, so the wider rows reach the model as they left. Tagged
rows are a copy of the image, untagged ones its own memory.
"""

from __future__ import annotations

import numpy as np
import torch

from vlmstream.models.family import ModelFamily


def row_width(family: ModelFamily) -> int:
    """Bytes of one merged visual token's pixels: its merge_size x merge_size patches, RGB."""
    return family.merge_size ** 2 * family.patch_size ** 2 * 3


TAG_BYTES = 8  # one little-endian unsigned 64-bit number per image


def pack(image: np.ndarray, grid_thw: tuple[int, int, int], family: ModelFamily,
         tag: int | None = None) -> torch.Tensor:
    """One exact-size H x W x 3 uint8 image (its grid ``grid_thw``) -> its bytes as (visual tokens, row_width) uint8
    rows, sharing the image's memory; with ``tag``, (visual tokens, row_width + TAG_BYTES) rows, a copy, the tag in
    the first row's last columns."""
    _, grid_h, grid_w = grid_thw
    height, width = grid_h * family.patch_size, grid_w * family.patch_size
    if image.dtype != np.uint8 or image.shape != (height, width, 3):
        raise ValueError(f"expected a {height} x {width} x 3 uint8 image for grid {tuple(grid_thw)}, got {image.dtype} "
                         f"{image.shape}")
    width = row_width(family)
    rows = np.ascontiguousarray(image).reshape(-1, width)
    if tag is None:
        return torch.from_numpy(rows)
    # The copy in numpy, on this thread: torch's copy of an image this size wakes its pool of CPU threads (one per
    # core), which then spin waiting for more work. At 0.2 MP the consumer used about six of the H200 host's cores
    # that way; in pixels mode, which packs nothing, under one.
    tagged = np.zeros((rows.shape[0], width + TAG_BYTES), dtype=np.uint8)
    tagged[:, :width] = rows
    tagged[0, width:] = np.array([tag], dtype="<u8").view(np.uint8)
    return torch.from_numpy(tagged)


def _tokens(grid_thw: torch.Tensor, family: ModelFamily) -> list[int]:
    """Rows per image: its merged visual tokens."""
    return [t * h * w // family.merge_size ** 2 for t, h, w in grid_thw.tolist()]


def unpack(rows: torch.Tensor, grid_thw: torch.Tensor, family: ModelFamily) -> list[torch.Tensor]:
    """The rows of one or more images, concatenated as vLLM batches them, with their (n, 3) grids -> each image as
    H x W x 3 uint8, on the rows' device (views of untagged rows; tagged ones are copied without their tags)."""
    grids = grid_thw.tolist()
    tokens = _tokens(grid_thw, family)
    width = row_width(family)
    if rows.dtype != torch.uint8 or rows.shape[0] != sum(tokens) or rows.shape[1] not in (width, width + TAG_BYTES):
        raise ValueError(f"pixel rows of {rows.dtype} {tuple(rows.shape)} do not fit grids {grids}: expected uint8 "
                         f"({sum(tokens)}, {width}) or, tagged, ({sum(tokens)}, {width + TAG_BYTES})")
    return [part[:, :width].reshape(h * family.patch_size, w * family.patch_size, 3)
            for part, (_, h, w) in zip(rows.split(tokens), grids)]


def tags(rows: torch.Tensor, grid_thw: torch.Tensor, family: ModelFamily) -> torch.Tensor | None:
    """Each image's tag as (n, TAG_BYTES) uint8 on the rows' device (read on the host with ``tag_values``), or None
    for untagged rows."""
    if rows.shape[1] != row_width(family) + TAG_BYTES:
        return None
    firsts = np.cumsum([0] + _tokens(grid_thw, family)[:-1]).tolist()
    # Slices at Python offsets: an index tensor would be copied to the GPU, and a plain copy there waits for it.
    return torch.stack([rows[first, row_width(family):] for first in firsts])


def tag_values(tag_bytes: torch.Tensor) -> list[int]:
    """(n, TAG_BYTES) uint8 on the host -> the n numbers."""
    return np.ascontiguousarray(tag_bytes.numpy()).view("<u8").ravel().tolist()


def are_pixel_rows(image_input: dict) -> bool:
    """Whether a vLLM Qwen model's image input carries pixel rows (uint8 image_embeds) rather than embeddings."""
    return image_input["type"] == "image_embeds" and image_input["image_embeds"].dtype == torch.uint8
