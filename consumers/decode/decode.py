"""Bytes -> upright-aware RGB pixels, decoded no larger than the model needs.

The format comes from the magic number, never from the file name. JPEGs go through libjpeg-turbo with DCT-domain
scaling (the decoder itself produces a 1/2, 1/4 or 1/8 size image, which is both the fastest path and an
antialiased reduction); everything else through Pillow (JPEG 2000 with its own reduction: whole wavelet
resolution levels skipped). Sizes are checked from the header before any pixel is
decoded, so a decompression bomb costs a few hundred bytes of parsing.

The result stays in the file's stored orientation: rotating the small resized image is cheaper than rotating the
decoded one, so the stage applies ``orientation`` after the resize (see ``resize.apply_orientation``).
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
from functools import lru_cache
from io import BytesIO

import cv2
import numpy as np
from PIL import Image, ImageFile, UnidentifiedImageError

from consumers.decode.resize import swaps_axes
from vlmstream.images.errors import ImageError
from vlmstream.images import pages as page_files
from vlmstream.images.turbojpeg import turbojpeg_handle
from vlmstream.models.family import ModelFamily
from vlmstream.models.qwen2_vl import QWEN2_VL


class NotAnImage(ImageError):
    error_kind = "decode_not_an_image"


class UnsupportedFormat(ImageError):
    error_kind = "decode_unsupported"


class TruncatedImage(ImageError):
    error_kind = "decode_truncated"


class CorruptImage(ImageError):
    error_kind = "decode_corrupt"


class TooManyPixels(ImageError):
    error_kind = "decode_too_many_pixels"


class PageOutOfRange(ImageError):
    error_kind = "decode_page_out_of_range"


# `scan.tif#page=3`: one page (frame) of a multi-page file, counted from 1, as in PDF open parameters. Any URI may
# carry it; it never reaches a server or the file system.
_MAGIC = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"II+\x00", "tiff"),  # BigTIFF
    (b"MM\x00+", "tiff"),
    (b"BM", "bmp"),
    # Archives and digitised collections store page images as JPEG 2000 (JP2 boxes or a bare codestream).
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "jpeg2000"),
    (b"\xff\x4f\xff\x51", "jpeg2000"),
    (b"qoif", "qoi"),
)
# Netpbm (PBM/PGM/PPM, ASCII or binary: scanners and OCR tools write them): "P1".."P6" then whitespace.
_NETPBM_KINDS = b"123456"
# ISO media brands (the bytes after "ftyp") that Pillow decodes when it was built with libavif.
_AVIF_BRANDS = (b"avif", b"avis")
# HEIF brands (HEIC: phone cameras' default), decoded when the optional pillow-heif is installed (extra `heif`).
_HEIF_BRANDS = (b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1")
# Recognised so the failure says "unsupported" rather than "not an image".
_KNOWN_UNSUPPORTED = (
    (b"%PDF", "pdf"),
    (b"\xff\x0a", "jpegxl"),
    (b"\x00\x00\x00\x0cJXL ", "jpegxl"),
)

EXIF_ORIENTATION_TAG = 0x0112
TIFF_TILE_WIDTH_TAG, TIFF_TILE_LENGTH_TAG = 322, 323

# Each progressive scan makes libjpeg walk every block of the image again, and it only warns about a repeated one:
# a few hundred kB of duplicated scans cost minutes. 500 is libjpeg-turbo's recommended limit for untrusted input;
# real progressive files have about ten (an EXIF thumbnail adds a few).
MAX_JPEG_SCANS = 500
# SOF markers of the lossless and hierarchical processes, which libjpeg-turbo's 8-bit decoder does not implement.
_UNSUPPORTED_JPEG_FRAMES = {0xC3: "lossless", 0xC5: "hierarchical", 0xC6: "hierarchical", 0xC7: "lossless",
                            0xCB: "lossless", 0xCD: "hierarchical", 0xCE: "hierarchical", 0xCF: "lossless"}
_JPEG_FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOFn; C4/C8/CC are DHT, JPG, DAC
_PROGRESSIVE_JPEG_FRAMES = frozenset({0xC2, 0xCA})  # Huffman and arithmetic progressive
# A TIFF tile is what libtiff allocates and inflates, whatever the image size: one covers at most the image plus
# padding to the tile grid. Tiles up to this area are allowed for any image (encoders use 256x256 for tiny ones).
_TILE_PIXELS_ANY_IMAGE = 1 << 20
_TILE_OVER_IMAGE_AREA = 4
# Per-pixel arithmetic runs over this many pixels at a time, so its temporaries stay a few MB at any image size.
_BLOCK_PIXELS = 1 << 18


def sniff_format(data: bytes) -> str:
    """The image format named by the leading bytes; raises NotAnImage / UnsupportedFormat."""
    head = bytes(data[:32])
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:1] == b"P" and head[1:2] and head[1] in _NETPBM_KINDS and head[2:3].isspace():
        return "netpbm"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in _AVIF_BRANDS and pillow_reads_avif():
            return "avif"
        if brand in _HEIF_BRANDS and pillow_reads_heif():
            return "heif"
        hint = (" by this Pillow build" if brand in _AVIF_BRANDS else
                " without pillow-heif (pip install 'vlmstream[heif]')" if brand in _HEIF_BRANDS else "")
        raise UnsupportedFormat(f"ISO media image ({brand.decode('latin-1')!r}: HEIF/AVIF) is not supported{hint}")
    for magic, name in _KNOWN_UNSUPPORTED:
        if head.startswith(magic):
            raise UnsupportedFormat(f"{name} is not supported")
    if head.lstrip().startswith((b"<svg", b"<?xml")):
        raise UnsupportedFormat("SVG (vector) is not supported")
    raise NotAnImage(f"no known image signature (first bytes {head[:8]!r}, {len(data)} bytes)")


@dataclass(frozen=True)
class Decoded:
    """Pixels in the file's stored orientation, possibly already reduced by the decoder.

    ``width``/``height`` are the upright full-size dimensions; ``target_width``/``target_height`` the upright
    smart_resize size computed from them."""

    pixels: np.ndarray
    orientation: int
    width: int
    height: int
    target_width: int
    target_height: int
    source_format: str
    scale: float = 1.0
    # Pages in a multi-page TIFF decoded without a page selector (only its first is decoded); 1 otherwise.
    pages: int = 1

    @property
    def stored_target(self) -> tuple[int, int]:
        """(height, width) the stored-orientation pixels must be resized to before ``orientation`` is applied."""
        if swaps_axes(self.orientation):
            return self.target_width, self.target_height
        return self.target_height, self.target_width


def configure_pillow(max_source_pixels: int) -> None:
    """Process-wide Pillow policy: its decompression-bomb threshold is ours, its bomb warning is an error, and
    truncated files never load silently."""
    Image.MAX_IMAGE_PIXELS = max_source_pixels
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    warnings.filterwarnings("error", category=Image.DecompressionBombWarning)


class Decoder:
    """Decodes bytes for one model family and pixel budget (the family's own limits unless ``min_pixels`` /
    ``max_pixels`` are given). Reusable; not shared across threads while libjpeg-turbo warnings are collected
    (``warnings.catch_warnings`` is process-global)."""

    def __init__(
        self,
        *,
        family: ModelFamily = QWEN2_VL,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        max_source_pixels: int = 200_000_000,
        use_turbojpeg: bool = True,
    ):
        self.family = family.with_pixel_limits(
            family.min_pixels if min_pixels is None else min_pixels,
            family.max_pixels if max_pixels is None else max_pixels)
        self.max_source_pixels = max_source_pixels
        configure_pillow(max_source_pixels)
        self._turbo = turbojpeg_handle() if use_turbojpeg else None

    @property
    def uses_turbojpeg(self) -> bool:
        return self._turbo is not None

    def decode(self, data: bytes, page: int | None = None) -> Decoded:
        """``page``: which page (frame) of a multi-page file, from 1; None = the first."""
        fmt = sniff_format(data)
        if fmt == "jpeg":
            check_jpeg_is_decodable(data)
        if fmt == "jpeg" and self._turbo is not None and (page or 1) == 1:
            return self._decode_jpeg_turbo(data)
        return self._decode_pillow(data, fmt, page)

    # -- shared helpers ---------------------------------------------------------------------------------

    def _check_and_target(self, stored_w: int, stored_h: int, orientation: int) -> tuple[int, int, int, int]:
        if stored_w <= 0 or stored_h <= 0:
            raise CorruptImage(f"header declares an empty image ({stored_w}x{stored_h})")
        if stored_w * stored_h > self.max_source_pixels:
            raise TooManyPixels(
                f"{stored_w}x{stored_h} = {stored_w * stored_h} pixels exceeds max_source_pixels "
                f"{self.max_source_pixels}"
            )
        width, height = (stored_h, stored_w) if swaps_axes(orientation) else (stored_w, stored_h)
        target_h, target_w = self.family.target_size(height, width)
        return width, height, target_w, target_h

    # -- JPEG through libjpeg-turbo ---------------------------------------------------------------------

    def _decode_jpeg_turbo(self, data: bytes) -> Decoded:
        from turbojpeg import TJCS_CMYK, TJCS_YCCK, TJPF_CMYK, TJPF_RGB

        turbo = self._turbo
        try:
            stored_w, stored_h, _subsample, colorspace = turbo.decode_header(data)
        except OSError as exc:
            raise _jpeg_failure(data, exc) from exc
        orientation = jpeg_exif_orientation(data)
        width, height, target_w, target_h = self._check_and_target(stored_w, stored_h, orientation)
        need_h, need_w = (target_w, target_h) if swaps_axes(orientation) else (target_h, target_w)
        scaling = pick_dct_scale(stored_w, stored_h, need_w, need_h, turbo.scaling_factors)
        if colorspace in (TJCS_CMYK, TJCS_YCCK):
            # libjpeg-turbo would hand back raw CMYK; Pillow knows Adobe's inverted-CMYK convention. But Pillow
            # hides libjpeg's warnings, so a cut file would come out half grey: libjpeg-turbo reads it first
            # (at the reduced size; CMYK JPEGs are rare) to hear them.
            self._turbo_decode(data, TJPF_CMYK, scaling)
            return self._decode_pillow(data, "jpeg")
        pixels = self._turbo_decode(data, TJPF_RGB, scaling)
        return Decoded(
            pixels, orientation, width, height, target_w, target_h, "jpeg", scaling[0] / scaling[1]
        )

    def _turbo_decode(self, data: bytes, pixel_format: int, scaling: tuple[int, int]) -> np.ndarray:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                pixels = self._turbo.decode(data, pixel_format=pixel_format, scaling_factor=scaling)
            except OSError as exc:
                raise _jpeg_failure(data, exc) from exc
        for warning in caught:
            message = str(warning.message)
            if "premature end" in message.lower():  # "Premature end of JPEG file", "... of data segment"
                # libjpeg fills the missing rows with grey and calls it a warning; a half-grey page is a failure.
                raise TruncatedImage(f"JPEG data ends early: {message}")
        return pixels

    # -- everything else through Pillow -----------------------------------------------------------------

    def _decode_pillow(self, data: bytes, fmt: str, page: int | None = None) -> Decoded:
        try:
            image = Image.open(BytesIO(data))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise TooManyPixels(str(exc)) from exc
        except UnidentifiedImageError as exc:
            raise CorruptImage(f"{fmt} signature but Pillow cannot read it: {exc}") from exc
        except (OSError, SyntaxError, ValueError, EOFError, struct.error) as exc:
            raise _pillow_failure(fmt, exc, data) from exc
        except RuntimeError as exc:
            if fmt not in _RUNTIME_ERROR_FORMATS:
                raise
            raise _pillow_failure(fmt, exc, data) from exc
        pages = 1
        try:
            with image:
                if (page or 1) > 1:
                    if page > page_files.MAX_PAGES:
                        raise PageOutOfRange(f"page {page} asked for; pages past {page_files.MAX_PAGES} are not read")
                    try:
                        image.seek(page - 1)
                    except EOFError:
                        raise PageOutOfRange(f"page {page} asked for; the file has {page_files.count_pages(image)}") from None
                elif page is None and image.format == "TIFF":
                    pages = page_files.count_pages(image)  # a walk over the page directories, no pixels
                orientation = _pillow_orientation(image, data)
                stored_w, stored_h = image.size
                width, height, target_w, target_h = self._check_and_target(stored_w, stored_h, orientation)
                if image.format == "TIFF":
                    self._check_tiff_tiles(image, stored_w, stored_h)
                scale = 1.0
                pixels = None
                if fmt in ("png", "webp") and not getattr(image, "is_animated", False):
                    pixels = _decode_cv2(data, stored_w, stored_h, colour_key="transparency" in image.info)
                if pixels is None:
                    need_h, need_w = (target_w, target_h) if swaps_axes(orientation) else (target_h, target_w)
                    if image.format == "JPEG":
                        image.draft(image.mode, (need_w, need_h))  # DCT-domain 1/2..1/8 reduction
                        scale = image.size[0] / stored_w
                    elif image.format == "JPEG2000":
                        # Wavelet resolution levels: each one dropped halves the size and skips its decoding.
                        levels = min(jpeg2000_levels_to_drop(stored_w, stored_h, need_w, need_h),
                                     jpeg2000_decomposition_levels(data))
                        if levels:
                            image.reduce = levels
                            try:
                                image.load()
                            except (OSError, ValueError):
                                # A component with fewer levels (COC): the failed load leaves this image
                                # unusable, so the whole picture again, at full size.
                                image = Image.open(BytesIO(data))
                            scale = image.size[0] / stored_w
                    image.load()
                    pixels = to_rgb(image)
        except ImageError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise TooManyPixels(str(exc)) from exc
        except (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError) as exc:
            raise _pillow_failure(fmt, exc, data) from exc
        except RuntimeError as exc:
            if fmt not in _RUNTIME_ERROR_FORMATS:
                raise
            raise _pillow_failure(fmt, exc, data) from exc
        return Decoded(pixels, orientation, width, height, target_w, target_h, fmt, scale, pages)

    def _check_tiff_tiles(self, image: Image.Image, stored_w: int, stored_h: int) -> None:
        tile_w = image.tag_v2.get(TIFF_TILE_WIDTH_TAG)
        tile_h = image.tag_v2.get(TIFF_TILE_LENGTH_TAG)
        if not isinstance(tile_w, int) or not isinstance(tile_h, int):
            return
        tile = tile_w * tile_h
        if tile > self.max_source_pixels:
            raise TooManyPixels(f"TIFF tile {tile_w}x{tile_h} = {tile} pixels exceeds max_source_pixels "
                                f"{self.max_source_pixels}")
        if tile > max(_TILE_OVER_IMAGE_AREA * stored_w * stored_h, _TILE_PIXELS_ANY_IMAGE):
            raise CorruptImage(f"TIFF tile {tile_w}x{tile_h} is far larger than its {stored_w}x{stored_h} image")


def jpeg2000_decomposition_levels(data: bytes) -> int:
    """The wavelet decomposition levels in a JPEG 2000 file's main header (its COD segment), 0 if not found: the
    most resolution levels a decoder may skip. Walks the header's segments from the codestream's start (SOC)."""
    at = data.find(b"\xff\x4f\xff\x51", 0, 4 << 20)  # SOC + SIZ; a JP2's boxes before it may hold an ICC profile
    if at < 0:
        return 0
    at += 2
    while at + 4 <= len(data):
        marker, length = struct.unpack(">HH", data[at:at + 4])
        if marker == 0xFF52:  # COD: length (2), Scod (1), progression (1), layers (2), colour transform (1), levels
            return data[at + 9] if at + 9 < len(data) else 0
        if marker == 0xFF90 or length < 2:  # the first tile begins: no COD in the main header
            return 0
        at += 2 + length
    return 0


def _decode_cv2(data: bytes, width: int, height: int, *, colour_key: bool = False) -> np.ndarray | None:
    """PNG and WebP through OpenCV (libpng/libwebp directly: 1.2-2.5x faster than Pillow on the corpus), after
    Pillow has read the header and the size has been checked. None when OpenCV cannot decode it exactly; Pillow
    then decodes it and names the failure (truncated, corrupt). ``colour_key``: the file has a tRNS colour key."""
    try:
        array = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    except cv2.error:
        return None
    if array is None or array.shape[:2] != (height, width) or array.dtype not in (np.uint8, np.uint16):
        return None
    if array.ndim == 2:
        if colour_key:
            return None  # OpenCV drops a grey PNG's tRNS key (an RGB one it expands to alpha); Pillow keeps it
        return cv2.cvtColor(eight_bit(array), cv2.COLOR_GRAY2RGB)
    if array.shape[2] == 3 and array.dtype == np.uint8:
        return cv2.cvtColor(array, cv2.COLOR_BGR2RGB)
    if array.shape[2] in (3, 4):
        return composite_on_white(array, bgr=True)
    return None


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


def jpeg2000_levels_to_drop(width: int, height: int, need_w: int, need_h: int, most: int = 5) -> int:
    """How many JPEG 2000 resolution levels can be skipped with the image still at least need_w x need_h (each
    level halves both sides, rounding up). A file with fewer levels than asked for is decoded at its smallest."""
    levels = 0
    while (levels < most and -(-width // (2 << levels)) >= need_w and -(-height // (2 << levels)) >= need_h):
        levels += 1
    return levels


@lru_cache(maxsize=1)
def pillow_reads_avif() -> bool:
    from PIL import features

    return bool(features.check("avif"))


@lru_cache(maxsize=1)
def pillow_reads_heif() -> bool:
    """True once pillow-heif's opener is registered with Pillow; False when it is not installed."""
    try:
        import pillow_heif
    except ImportError:
        return False
    pillow_heif.register_heif_opener()
    return True


def pick_dct_scale(
    width: int, height: int, need_w: int, need_h: int, factors
) -> tuple[int, int]:
    """The smallest libjpeg-turbo scaling factor (<= 1) whose output is at least need_w x need_h.

    libjpeg-turbo rounds scaled sizes up: TJSCALED(d, f) = ceil(d * num / denom)."""
    best = (1, 1)
    for num, denom in sorted(factors, key=lambda f: f[0] / f[1]):
        if num > denom:
            continue
        if -(-width * num // denom) >= need_w and -(-height * num // denom) >= need_h:
            best = (num, denom)
            break
    return best


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


def jpeg_exif_orientation(data: bytes) -> int:
    """EXIF orientation from a JPEG's APP1 segment, read without decoding anything; 1 when absent or unreadable."""
    for marker, body in _jpeg_header_segments(data):
        if marker == 0xE1 and body[:6] == b"Exif\x00\x00":
            return tiff_orientation(bytes(body[6:]))
    return 1


def check_jpeg_is_decodable(data: bytes) -> None:
    """Refuses, from the bytes alone, a JPEG libjpeg would spend minutes on or cannot decode."""
    for marker, body in _jpeg_header_segments(data):
        if marker in _JPEG_FRAME_MARKERS:
            if marker in _UNSUPPORTED_JPEG_FRAMES:
                raise UnsupportedFormat(f"{_UNSUPPORTED_JPEG_FRAMES[marker]} JPEG (SOF {marker:#x}) is not supported")
            if body[:1] and body[0] != 8:
                raise UnsupportedFormat(f"{body[0]}-bit JPEG is not supported (8-bit only)")
            if marker in _PROGRESSIVE_JPEG_FRAMES:
                # Only a progressive decode walks every block again per scan. Counting reads the whole file (about
                # 1 ms per MB on the development machine, against ~11 ms for a whole 0.2 MP decode), so a
                # sequential JPEG is spared it.
                # Entropy-coded data stuffs every 0xFF: FF DA occurs only as a start-of-scan (or inside metadata).
                scans = data.count(b"\xff\xda")
                if scans > MAX_JPEG_SCANS:
                    raise CorruptImage(f"JPEG with {scans} scans (more than {MAX_JPEG_SCANS}: a scan bomb)")
            return


def _jpeg_header_segments(data: bytes):
    """(marker, body) of each marker segment before the first scan; stops at anything that is not one."""
    view = memoryview(data)
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if view[pos] != 0xFF:
            return
        marker = view[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        if marker in (0xDA, 0xD9):  # start of scan / end of image: no more metadata
            return
        length = (view[pos + 2] << 8) | view[pos + 3]
        yield marker, view[pos + 4 : pos + 2 + length]
        pos += 2 + length


def tiff_orientation(tiff: bytes) -> int:
    """Orientation tag of IFD0 in a TIFF-structured EXIF block."""
    try:
        endian = {b"II": "<", b"MM": ">"}[tiff[:2]]
        (ifd,) = struct.unpack_from(endian + "I", tiff, 4)
        (count,) = struct.unpack_from(endian + "H", tiff, ifd)
        for i in range(count):
            tag, typ, _n, = struct.unpack_from(endian + "HHI", tiff, ifd + 2 + 12 * i)
            if tag == EXIF_ORIENTATION_TAG:
                # SHORT by the standard, but some writers use LONG: read as 2 bytes, a big-endian LONG is 0.
                (value,) = struct.unpack_from(endian + ("I" if typ == 4 else "H"), tiff, ifd + 2 + 12 * i + 8)
                return value if 1 <= value <= 8 else 1
    except (KeyError, struct.error):
        pass
    return 1


def _pillow_orientation(image: Image.Image, data: bytes = b"") -> int:
    if image.format == "TIFF" and pillow_turns_tiffs_upright():
        return 1
    try:
        if image.format in ("PNG", "WEBP"):
            # PngImageFile.getexif() decodes the whole image to look for an eXIf chunk after the pixels; the header
            # pass found one before IDAT (the usual place), and a walk over the chunks finds one after.
            raw = image.info.get("exif") or (png_chunk(data, b"eXIf") if image.format == "PNG" else None)
            if not raw:
                return 1
            raw = raw[6:] if raw.startswith(b"Exif\x00\x00") else raw
            return tiff_orientation(raw)
        value = image.getexif().get(EXIF_ORIENTATION_TAG, 1)
    except Exception:  # a broken EXIF block must not fail an otherwise good image
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def png_chunk(data: bytes, kind: bytes) -> bytes | None:
    """The body of a PNG's first chunk of ``kind``, found by jumping from chunk header to chunk header (nothing is
    decompressed); None when absent or when the chunk layout is broken."""
    pos, end = 8, len(data)
    while pos + 8 <= end:
        length = int.from_bytes(data[pos:pos + 4], "big")
        chunk = data[pos + 4:pos + 8]
        if chunk == kind:
            return data[pos + 8:pos + 8 + length] if pos + 8 + length <= end else None
        if chunk == b"IEND":
            return None
        pos += 12 + length
    return None


@lru_cache(maxsize=1)
def pillow_turns_tiffs_upright() -> bool:
    """True when Pillow applies a TIFF's Orientation tag itself (Pillow 13 does, when it opens and loads one): the
    stage must then not apply it again."""
    exif = Image.Exif()
    exif[EXIF_ORIENTATION_TAG] = 6
    buffer = BytesIO()
    Image.new("L", (2, 1)).save(buffer, "TIFF", exif=exif)
    with Image.open(buffer) as probe:
        probe.load()
        return probe.size == (1, 2)


def _jpeg_failure(data: bytes, exc: Exception) -> ImageError:
    if "Unsupported JPEG" in str(exc):  # "... data precision 12", "... process: SOF type 0xc3"
        return UnsupportedFormat(f"JPEG: {exc}")
    if not bytes(data[-16:]).rstrip(b"\x00\r\n ").endswith(b"\xff\xd9"):
        return TruncatedImage(f"JPEG without end-of-image marker: {exc}")
    return CorruptImage(f"JPEG: {exc}")


def _pillow_failure(fmt: str, exc: Exception, data: bytes = b"") -> ImageError:
    message = str(exc)
    if isinstance(exc, EOFError) or "truncated" in message.lower() or "Truncated" in message:
        return TruncatedImage(f"{fmt}: {message or type(exc).__name__}")
    if fmt == "jpeg2000" and jpeg2000_is_cut_short(data):
        # openjpeg says "broken data stream" for any failure; the codestream's own end marker tells a cut file.
        return TruncatedImage(f"{fmt}: the codestream has no end marker ({type(exc).__name__}: {message})")
    return CorruptImage(f"{fmt}: {type(exc).__name__}: {message}")


def jpeg2000_is_cut_short(data: bytes) -> bool:
    """True when a JPEG 2000 file ends before its codestream does: a bare codestream not ending in EOC (FF D9),
    or a JP2 whose contiguous-codestream box (jp2c) is declared longer than the bytes there are."""
    if data.startswith(b"\xff\x4f\xff\x51"):
        return not data.endswith(b"\xff\xd9")
    box = data.find(b"jp2c")
    if box < 4:
        return False
    (length,) = struct.unpack(">I", data[box - 4:box])
    if length == 0:  # the box runs to the end of the file
        return not data.endswith(b"\xff\xd9")
    if length == 1 and box + 12 <= len(data):  # 64-bit length after the type
        (length,) = struct.unpack(">Q", data[box + 4:box + 12])
    return box - 4 + length > len(data)


# Pillow's AVIF plugin and pillow-heif report damaged files as RuntimeError ("Decoding of color planes failed",
# libheif's "Security limit exceeded").
_RUNTIME_ERROR_FORMATS = ("avif", "heif")
