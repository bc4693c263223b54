"""Decoded pixels of any mode -> H x W x 3 uint8 RGB: alpha composited on white, 16-bit and float brought to 8 bits,
a row block at a time so the temporaries stay a few MB at any image size."""

from __future__ import annotations

import cv2
import numpy as np
from PIL import Image

# Per-pixel arithmetic runs over this many pixels at a time, so its temporaries stay a few MB at any image size.
_BLOCK_PIXELS = 1 << 18


def to_rgb(image: Image.Image) -> np.ndarray:
    """Any Pillow mode -> H x W x 3 uint8 RGB; alpha composited on white, 16-bit and float scaled to 8 bits."""
    mode = image.mode
    if mode in ("RGB", "L") and "transparency" in image.info:
        image = image.convert("RGBA")  # a tRNS colour key: those pixels are transparent, so white
        mode = image.mode
    if mode == "RGB":
        return np.asarray(image)
    if mode == "L":
        return cv2.cvtColor(np.asarray(image), cv2.COLOR_GRAY2RGB)
    if mode in ("P", "PA") or mode == "1":
        has_alpha = mode == "PA" or "transparency" in image.info
        image = image.convert("RGBA" if has_alpha else "RGB")
        mode = image.mode
        if mode == "RGB":
            return np.asarray(image)
    if mode in ("RGBA", "LA", "La", "RGBa"):
        if mode in ("La", "RGBa"):  # premultiplied: Pillow un-premultiplies on convert
            image = image.convert("RGBA")
        rgba = np.asarray(image.convert("RGBA") if image.mode != "RGBA" else image)
        return composite_on_white(rgba)
    if mode.startswith("I;16") or mode == "I":
        stored = np.asarray(image)
        divisor = 257.0 if mode.startswith("I;16") or stored.max(initial=0) > 255 else 1.0  # 16-bit range onto 0..255
        key = image.info.get("transparency")
        gray = np.empty(stored.shape, np.uint8)
        for rows in _row_blocks(*stored.shape):
            gray[rows] = np.clip(np.rint(stored[rows].astype(np.float32) / divisor), 0, 255)
            if isinstance(key, int):
                gray[rows][stored[rows] == key] = 255  # tRNS colour key: transparent, so white
        return cv2.cvtColor(gray, cv2.COLOR_GRAY2RGB)
    if mode == "F":
        # NaN and infinities (no-data pixels in scientific TIFFs, or damage) become black, not arbitrary bytes.
        stored = np.asarray(image)
        peak = max((float(np.nan_to_num(stored[rows], nan=0.0, posinf=0.0, neginf=0.0).max(initial=0))
                    for rows in _row_blocks(*stored.shape)), default=0.0)
        scale = 255.0 if peak <= 1.0 else 1.0  # float images are conventionally 0..1
        gray = np.empty(stored.shape, np.uint8)
        for rows in _row_blocks(*stored.shape):
            values = np.nan_to_num(stored[rows].astype(np.float32), copy=False, nan=0.0, posinf=0.0, neginf=0.0)
            values *= scale
            gray[rows] = np.clip(np.rint(values, out=values), 0, 255, out=values)
        return cv2.cvtColor(gray, cv2.COLOR_GRAY2RGB)
    # CMYK, YCbCr, LAB, HSV, RGBX, I;16 variants Pillow can convert itself.
    return np.asarray(image.convert("RGB"))


def composite_on_white(array: np.ndarray, *, bgr: bool = False) -> np.ndarray:
    """RGBA (or RGB), 8 or 16 bits -> 8-bit RGB over a white background (what transformers' convert_rgb does);
    ``bgr``: the channels are in OpenCV's order. Done a row block at a time, 16 bits brought to 8 first, so the
    only full-size allocation is the output."""
    height, width = array.shape[:2]
    out = np.empty((height, width, 3), np.uint8)
    # Channel moves go through cvtColor: a reversed-stride numpy copy made RGBA PNGs 10-29% slower to decode.
    to_rgb_order = cv2.COLOR_BGR2RGB if bgr else None
    for rows in _row_blocks(height, width):
        block = eight_bit(array[rows])
        if block.shape[2] == 4:
            if block[..., 3].min() == 255:  # many RGBA files are fully opaque: skip the arithmetic
                cv2.cvtColor(block, cv2.COLOR_BGRA2RGB if bgr else cv2.COLOR_RGBA2RGB, dst=out[rows])
                continue
            alpha = block[..., 3:4].astype(np.uint16)
            rgb = block[..., :3] * alpha
            rgb += 255 * (255 - alpha) + 127
            rgb //= 255
            block = rgb.astype(np.uint8)
        if to_rgb_order is not None:
            cv2.cvtColor(block, to_rgb_order, dst=out[rows])  # out's rows are contiguous: written in place
        else:
            out[rows] = block
    return out


def eight_bit(array: np.ndarray) -> np.ndarray:
    """uint16 -> uint8 with the full 16-bit range onto 0..255 (uint8 unchanged), a row block at a time: a full-size
    uint32 temporary would be twice the 16-bit image."""
    if array.dtype == np.uint8:
        return array
    out = np.empty(array.shape, np.uint8)
    for rows in _row_blocks(array.shape[0], array.shape[1]):
        wide = array[rows].astype(np.uint32)
        wide += 128
        wide //= 257
        out[rows] = wide
    return out


def _row_blocks(height: int, width: int):
    step = max(1, _BLOCK_PIXELS // max(1, width))
    for top in range(0, height, step):
        yield slice(top, min(top + step, height))
