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


def shrink_antialiased(image: np.ndarray, height: int, width: int, reducing_gap: float,
                       least_gap: float) -> np.ndarray:
    """Pillow's ``Image.resize((width, height), BICUBIC, reducing_gap=reducing_gap)`` on an H x W x 3 uint8 image,
    nearly (the antialiased bicubic transformers' resize calls), at a fraction of its cost on a large image: a box
    reduce by whole factors that leaves at least ``reducing_gap`` times the target on each axis (where none does, by 2
    if that leaves at least ``least_gap`` times), then Pillow's kernel (a = -0.5, stretched by the scale left) as a
    separable filter on the reduced image's own grid, read at each output pixel's centre by bilinear interpolation.
    Pillow weighs the source at each output centre's own offsets; the filtered image is smooth at that scale, so
    interpolating it is close (the closer the more the kernel is stretched) and costs a cv2 filter pass instead of
    Pillow's resample (half of it on a 200 dpi letter page at 0.2 MP, a third on an 8 MP page). The reduce runs on
    cv2's integer area path and reads ``image`` in place, so a shared buffer needs no copy first."""
    src_h, src_w = image.shape[:2]

    def factor(ratio: float) -> int:
        whole = int(ratio / reducing_gap)
        return whole if whole > 1 else (2 if ratio / 2 >= least_gap else 1)

    kx, ky = factor(src_w / width), factor(src_h / height)
    if kx > 1 or ky > 1:
        image = box_reduce(image, kx, ky)
    # The scale left, from the source's own extent (the reduced image's last box may be cut short), as Pillow maps it.
    sx, sy = src_w / kx / width, src_h / ky / height
    filtered = cv2.sepFilter2D(image, -1, _bicubic_taps(sx), _bicubic_taps(sy), borderType=cv2.BORDER_REFLECT)
    # Output pixel x's centre at source (x + 0.5) * sx - 0.5, the centre convention of Pillow and cv2.resize.
    to_source = np.float32([[sx, 0, 0.5 * sx - 0.5], [0, sy, 0.5 * sy - 0.5]])
    return cv2.warpAffine(filtered, to_source, (width, height), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                          borderMode=cv2.BORDER_REPLICATE)


def _bicubic_taps(scale: float) -> np.ndarray:
    """Pillow's bicubic kernel (a = -0.5) stretched by ``scale`` (at least 1: no stretch when enlarging), at whole
    offsets where it is not zero, summing to 1."""
    scale = max(scale, 1.0)
    radius = int(np.ceil(2 * scale)) - 1  # the kernel is zero from 2 * scale on
    x = np.abs(np.arange(-radius, radius + 1) / scale)
    a = -0.5
    taps = np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))
    return (taps / taps.sum()).astype(np.float32)


def box_reduce(image: np.ndarray, kx: int, ky: int) -> np.ndarray:
    """Pillow's ``Image.reduce((kx, ky))``: each pixel the rounded mean of a kx x ky box, the last row and column of
    boxes cut short by the image's edge."""
    src_h, src_w, channels = image.shape
    h, w = src_h - src_h % ky, src_w - src_w % kx
    whole = cv2.resize(image[:h, :w], (w // kx, h // ky), interpolation=cv2.INTER_AREA)
    if (h, w) == (src_h, src_w):
        return whole
    out = np.empty((-(-src_h // ky), -(-src_w // kx), channels), np.uint8)
    out[:h // ky, :w // kx] = whole

    def means(block: np.ndarray) -> np.ndarray:  # rows x ky x columns x kx x channels -> rows x columns x channels
        count = block.shape[1] * block.shape[3]
        return ((block.sum(axis=(1, 3), dtype=np.uint32) * 2 + count) // (2 * count)).astype(np.uint8)

    if w < src_w:
        out[:h // ky, -1:] = means(image[:h, w:].reshape(h // ky, ky, 1, src_w - w, channels))
    if h < src_h:
        out[-1:, :w // kx] = means(image[h:, :w].reshape(1, src_h - h, w // kx, kx, channels))
    if h < src_h and w < src_w:
        out[-1:, -1:] = means(image[h:, w:].reshape(1, src_h - h, 1, src_w - w, channels))
    return out


def apply_orientation(image: np.ndarray, orientation: int) -> np.ndarray:
    """Turn an image stored with EXIF ``orientation`` upright (1 and unknown values: unchanged)."""
    for op, arg in _ORIENT_OPS.get(orientation, ()):
        image = op(image) if arg is None else op(image, arg)
    return image


def swaps_axes(orientation: int) -> bool:
    return orientation in (5, 6, 7, 8)
