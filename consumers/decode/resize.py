"""The exact-size resize to the model family's target size (``ModelFamily.target_size``, vlmstream/models/), and
EXIF orientation applied to the result."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

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
    """Pillow's ``Image.resize((width, height), BICUBIC, reducing_gap=reducing_gap)`` on an H x W x 3 uint8 image
    (the antialiased bicubic transformers' resize calls), within one level, at a fraction of its cost on a large
    image: a box reduce by whole factors that leaves at least ``reducing_gap`` times the target on each axis (where
    none does, by 2 if that leaves at least ``least_gap`` times), then Pillow's resample itself, its coefficients
    (``_resample_weights``) applied as banded matrix products, horizontal pass first, rounded to uint8 between the
    passes as Pillow does. The reduce runs on cv2's integer area path and reads ``image`` in place, so a shared buffer
    needs no copy first."""
    src_h, src_w = image.shape[:2]
    image, kx, ky = _box_reduced(image, height, width, reducing_gap, least_gap)
    h, w = image.shape[:2]
    # Both passes weigh rows of values: the horizontal one the image's columns, as rows of its transpose, the
    # vertical one that pass's output columns, each chunk of them transposed as it is needed (the first transpose
    # reads the whole image in order, cheaper than in strips; the second is on an image a scale smaller). The scale
    # left is taken from the source's own extent (the reduced image's last box may be cut short), as Pillow maps it.
    columns = cv2.transpose(image).reshape(w, h * 3)
    across = _resample_rows(lambda low, high: columns[low:high], h * 3,
                            _resample_weights(w, src_w / kx, width)).reshape(width, h, 3)
    out = _resample_rows(lambda low, high: cv2.transpose(across[:, low:high]).reshape(high - low, width * 3),
                         width * 3, _resample_weights(h, src_h / ky, height))
    return out.reshape(height, width, 3)


# Output rows per band of the resample's coefficient matrix: each band is one dense product over the source rows
# that any of its outputs reads. More rows per band multiply more zeros (a band of n rows at scale s reads about
# (n + 4) * s source rows where each output needs 4 * s), fewer cost more calls.
_BAND_ROWS = 4
# OpenBLAS runs a product of m x k by k x n on one thread up to this m * n * k (its default multithreading
# threshold); the decode stage runs one process per core, so every product stays within it.
_ONE_THREAD_PRODUCT = 4 * 65536
# Source rows converted to float32 at a time, so that the products read them from cache.
_CHUNK_ROWS = 48


def _resample_rows(read: Callable[[int, int], np.ndarray], values: int, bands: tuple) -> np.ndarray:
    """Source rows of ``values`` uint8 each (``read(low, high)``: rows low..high) weighed by a coefficient matrix
    given as ``bands``, rounded to uint8 with saturation (ties to even, where Pillow rounds them up: one level at
    most, and float32 sums are that inexact anyway). The bands run in chunks of about ``_CHUNK_ROWS`` source rows,
    read and converted to float32 at once, so that the products find them in cache."""
    out = np.empty((bands[-1][1], values), np.uint8)
    spans = [(first, last, start, start + weights.shape[1], weights) for first, last, start, weights in bands]
    # One buffer each for a chunk's source rows (as float32) and its weighed rows, reused from chunk to chunk.
    source = np.empty((max(_CHUNK_ROWS, max(end - start for _, _, start, end, _ in spans)), values), np.float32)
    weighed = np.empty((source.shape[0], values), np.float32)
    chunk = 0
    while chunk < len(spans):
        # Bands chunk..end read source rows low..high (the bands' starts and ends never decrease).
        low, end = spans[chunk][2], chunk + 1
        while (end < len(spans) and spans[end][3] - low <= _CHUNK_ROWS
               and spans[end][1] - spans[chunk][0] <= len(weighed)):
            end += 1
        high, first_row, last_row = spans[end - 1][3], spans[chunk][0], spans[end - 1][1]
        np.copyto(source[:high - low], read(low, high))
        for first, last, start, stop, weights in spans[chunk:end]:
            step = max(1, _ONE_THREAD_PRODUCT // weights.size)
            for column in range(0, values, step):
                np.matmul(weights, source[start - low:stop - low, column:column + step],
                          out=weighed[first - first_row:last - first_row, column:column + step])
        cv2.add(weighed[:last_row - first_row], 0.0, dst=out[first_row:last_row], dtype=cv2.CV_8U)
        chunk = end
    return out


@lru_cache(maxsize=64)
def _resample_weights(in_size: int, extent: float, out_size: int) -> tuple:
    """Pillow's coefficients (``precompute_coeffs`` and ``normalize_coeffs_8bpc`` in libImaging/Resample.c) for
    ``in_size`` source pixels of which the first ``extent`` map onto ``out_size``: the bicubic kernel (a = -0.5)
    stretched by the scale (at least 1), centred on each output pixel's centre ((i + 0.5) * scale), over the source
    pixels within its support rounded, cut at the edges, then normalised to sum 1 and rounded to Pillow's 22-bit
    fixed point. As bands of ``_BAND_ROWS`` output rows: (first row, end row, first source row, weights)."""
    scale = float(np.float32(extent)) / out_size  # Pillow takes the extent as a C float
    stretch = max(scale, 1.0)
    support = 2.0 * stretch
    taps = int(np.ceil(support)) * 2 + 1
    centre = (np.arange(out_size) + 0.5) * scale
    lo = np.maximum((centre - support + 0.5).astype(np.int64), 0)  # C's (int) cast: toward zero
    hi = np.minimum((centre + support + 0.5).astype(np.int64), in_size)
    index = lo[:, None] + np.arange(taps)
    x = np.abs((index - centre[:, None] + 0.5) / stretch)
    a = -0.5
    weights = np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                       np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))
    weights[index >= hi[:, None]] = 0.0
    total = weights.sum(axis=1, keepdims=True)
    weights /= np.where(total == 0, 1.0, total)
    one = float(1 << 22)
    weights = np.trunc(weights * one + np.where(weights < 0, -0.5, 0.5)) / one
    bands = []
    for first in range(0, out_size, _BAND_ROWS):
        last = min(first + _BAND_ROWS, out_size)
        start, end = int(lo[first:last].min()), int(hi[first:last].max())
        band = np.zeros((last - first, end - start), np.float32)
        for row in range(first, last):
            band[row - first, lo[row] - start: hi[row] - start] = weights[row, :hi[row] - lo[row]]
        bands.append((first, last, start, band))
    return tuple(bands)


def shrink_filtered(image: np.ndarray, height: int, width: int, reducing_gap: float,
                    least_gap: float) -> np.ndarray:
    """``shrink_antialiased``'s result nearly, cheaper where the image left after the same box reduce is large (a
    scan's whole JPEG shrunk by less than 3x: 8-19 ms against 15-57 ms on 300 dpi letter and 200 dpi A4 scans at
    1 MP and 12.8 MP, where the weights' products cost more than the filter's SIMD): Pillow's kernel
    (a = -0.5, stretched by the scale left) as a separable cv2 filter on the reduced image's own grid, read at each
    output pixel's centre by bilinear interpolation. Pillow weighs the source at each output centre's own offsets;
    reading the filtered image between its pixels blurs it once more, which on a scan's soft edges and paper noise is
    close (within 2.5 levels mean of Pillow on a page with a dark block) and on thin strokes is not (1.2-3.4 levels
    mean on text, max 44)."""
    src_h, src_w = image.shape[:2]
    image, kx, ky = _box_reduced(image, height, width, reducing_gap, least_gap)
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


def _box_reduced(image: np.ndarray, height: int, width: int, reducing_gap: float,
                 least_gap: float) -> tuple[np.ndarray, int, int]:
    """``image`` box-reduced by whole factors (kx, ky) that leave at least ``reducing_gap`` times the target on each
    axis (Pillow's ``reducing_gap``) or, where none does, by 2 if that leaves at least ``least_gap`` times; with the
    factors. The reduce runs on cv2's integer area path and reads ``image`` in place."""
    src_h, src_w = image.shape[:2]

    def factor(ratio: float) -> int:
        whole = int(ratio / reducing_gap)
        return whole if whole > 1 else (2 if ratio / 2 >= least_gap else 1)

    kx, ky = factor(src_w / width), factor(src_h / height)
    return (box_reduce(image, kx, ky) if kx > 1 or ky > 1 else image), kx, ky


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
