"""The exact-size resize to the model family's target size (``ModelFamily.target_size``, vlmstream/models/), and
EXIF orientation applied to the result."""

from __future__ import annotations

import cv2
import numpy as np

# A scale this close to 1 gains nothing from an area filter (each output pixel covers ~1 source pixel), and
# INTER_AREA's non-integer path at full resolution costs more than the JPEG decode; bilinear is then as good.
NEAR_IDENTITY_SCALE = 0.85

# Orientation (EXIF 0x0112) -> cv2 operations to show the image upright. 5..8 swap width and height.
_ORIENT_OPS = {
    2: ((cv2.flip, 1),),
    3: ((cv2.rotate, cv2.ROTATE_180),),
    4: ((cv2.flip, 0),),
    5: ((cv2.transpose, None),),
    6: ((cv2.rotate, cv2.ROTATE_90_CLOCKWISE),),
    7: ((cv2.rotate, cv2.ROTATE_90_COUNTERCLOCKWISE), (cv2.flip, 1)),
    8: ((cv2.rotate, cv2.ROTATE_90_COUNTERCLOCKWISE),),
}


def resize_exact(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize an H x W x 3 uint8 image to exactly ``height`` x ``width``.

    Shrinking by more than ``NEAR_IDENTITY_SCALE``: area filter (antialiased, close to torchvision's antialiased
    bicubic). Enlarging on either axis: bicubic, torchvision's kernel. In between (the usual case at the 12.8 MP
    default, e.g. 2560x1600 -> 2548x1596): bilinear, 2-4x cheaper than the area filter's non-integer path at full
    resolution and as close to the processor's output (measured: mean abs diff < 0.004 of normalised values)."""
    src_h, src_w = image.shape[:2]
    if (src_h, src_w) == (height, width):
        return image
    if height > src_h or width > src_w:
        interpolation = cv2.INTER_CUBIC
    elif min(height / src_h, width / src_w) >= NEAR_IDENTITY_SCALE:
        interpolation = cv2.INTER_LINEAR
    else:
        interpolation = cv2.INTER_AREA
    return cv2.resize(image, (width, height), interpolation=interpolation)


def apply_orientation(image: np.ndarray, orientation: int) -> np.ndarray:
    """Turn an image stored with EXIF ``orientation`` upright (1 and unknown values: unchanged)."""
    for op, arg in _ORIENT_OPS.get(orientation, ()):
        image = op(image) if arg is None else op(image, arg)
    return image


def swaps_axes(orientation: int) -> bool:
    return orientation in (5, 6, 7, 8)
