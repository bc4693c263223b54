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

from consumers.decode.resize import smart_resize, swaps_axes
from consumers.decode.types import ImageError


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
    """Decodes bytes for one (factor, min_pixels, max_pixels) budget. Reusable; not shared across threads while
    libjpeg-turbo warnings are collected (``warnings.catch_warnings`` is process-global)."""

    def __init__(
        self,
        *,
        factor: int = 28,
        min_pixels: int = 56 * 56,
        max_pixels: int = 28 * 28 * 16384,
        max_source_pixels: int = 200_000_000,
        use_turbojpeg: bool = True,
    ):
        self.factor = factor
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.max_source_pixels = max_source_pixels
        configure_pillow(max_source_pixels)
        self._turbo = _load_turbojpeg() if use_turbojpeg else None

    @property
    def uses_turbojpeg(self) -> bool:
        return self._turbo is not None

    def decode(self, data: bytes) -> Decoded:
        fmt = sniff_format(data)
        if fmt == "jpeg" and self._turbo is not None:
            return self._decode_jpeg_turbo(data)
        return self._decode_pillow(data, fmt)

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
        target_h, target_w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return width, height, target_w, target_h

    # -- JPEG through libjpeg-turbo ---------------------------------------------------------------------

    def _decode_jpeg_turbo(self, data: bytes) -> Decoded:
        from turbojpeg import TJCS_CMYK, TJCS_YCCK, TJPF_RGB

        turbo = self._turbo
        try:
            stored_w, stored_h, _subsample, colorspace = turbo.decode_header(data)
        except OSError as exc:
            raise _jpeg_failure(data, exc) from exc
        orientation = jpeg_exif_orientation(data)
        width, height, target_w, target_h = self._check_and_target(stored_w, stored_h, orientation)
        if colorspace in (TJCS_CMYK, TJCS_YCCK):
            # libjpeg-turbo would hand back raw CMYK; Pillow knows Adobe's inverted-CMYK convention.
            return self._decode_pillow(data, "jpeg")
        need_h, need_w = (target_w, target_h) if swaps_axes(orientation) else (target_h, target_w)
        scaling = pick_dct_scale(stored_w, stored_h, need_w, need_h, turbo.scaling_factors)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                pixels = turbo.decode(data, pixel_format=TJPF_RGB, scaling_factor=scaling)
            except OSError as exc:
                raise _jpeg_failure(data, exc) from exc
        for warning in caught:
            message = str(warning.message)
            if "Premature end" in message:
                # libjpeg fills the missing rows with grey and calls it a warning; a half-grey page is a failure.
                raise TruncatedImage(f"JPEG data ends early: {message}")
        return Decoded(
            pixels, orientation, width, height, target_w, target_h, "jpeg", scaling[0] / scaling[1]
        )

    # -- everything else through Pillow -----------------------------------------------------------------

    def _decode_pillow(self, data: bytes, fmt: str) -> Decoded:
        try:
            image = Image.open(BytesIO(data))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise TooManyPixels(str(exc)) from exc
        except UnidentifiedImageError as exc:
            raise CorruptImage(f"{fmt} signature but Pillow cannot read it: {exc}") from exc
        except (OSError, SyntaxError, ValueError, EOFError, struct.error) as exc:
            raise _pillow_failure(fmt, exc, data) from exc
        try:
            with image:
                orientation = _pillow_orientation(image)
                stored_w, stored_h = image.size
                width, height, target_w, target_h = self._check_and_target(stored_w, stored_h, orientation)
                scale = 1.0
                pixels = None
                if fmt in ("png", "webp") and not getattr(image, "is_animated", False):
                    pixels = _decode_cv2(data, stored_w, stored_h)
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
        return Decoded(pixels, orientation, width, height, target_w, target_h, fmt, scale)


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


def _decode_cv2(data: bytes, width: int, height: int) -> np.ndarray | None:
    """PNG and WebP through OpenCV (libpng/libwebp directly: 1.2-2.5x faster than Pillow on the corpus), after
    Pillow has read the header and the size has been checked. None when OpenCV cannot decode it exactly; Pillow
    then decodes it and names the failure (truncated, corrupt)."""
    try:
        array = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    except cv2.error:
        return None
    if array is None or array.shape[:2] != (height, width):
        return None
    if array.dtype == np.uint16:
        array = ((array.astype(np.uint32) + 128) // 257).astype(np.uint8)  # full 16-bit range onto 0..255
    elif array.dtype != np.uint8:
        return None
    if array.ndim == 2:
        return cv2.cvtColor(array, cv2.COLOR_GRAY2RGB)
    if array.shape[2] == 4:
        if array[..., 3].min() == 255:
            return cv2.cvtColor(array, cv2.COLOR_BGRA2RGB)
        return composite_on_white(cv2.cvtColor(array, cv2.COLOR_BGRA2RGBA))
    if array.shape[2] == 3:
        return cv2.cvtColor(array, cv2.COLOR_BGR2RGB)
    return None


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
        values = np.asarray(image).astype(np.float32)
        if mode.startswith("I;16") or values.max(initial=0) > 255:
            values = values / 257.0  # full 16-bit range onto 0..255
        gray = np.clip(np.rint(values), 0, 255).astype(np.uint8)
        return cv2.cvtColor(gray, cv2.COLOR_GRAY2RGB)
    if mode == "F":
        # NaN and infinities (no-data pixels in scientific TIFFs, or damage) become black, not arbitrary bytes.
        values = np.nan_to_num(np.asarray(image).astype(np.float32), nan=0.0, posinf=0.0, neginf=0.0)
        if values.max(initial=0) <= 1.0:
            values = values * 255.0  # float images are conventionally 0..1
        gray = np.clip(np.rint(values), 0, 255).astype(np.uint8)
        return cv2.cvtColor(gray, cv2.COLOR_GRAY2RGB)
    # CMYK, YCbCr, LAB, HSV, RGBX, I;16 variants Pillow can convert itself.
    return np.asarray(image.convert("RGB"))


def composite_on_white(rgba: np.ndarray) -> np.ndarray:
    """RGBA -> RGB over a white background (what transformers' convert_rgb does)."""
    if rgba[..., 3].min() == 255:  # many RGBA files are fully opaque: skip the arithmetic on every pixel
        return cv2.cvtColor(rgba, cv2.COLOR_RGBA2RGB)
    alpha = rgba[..., 3:4].astype(np.uint16)
    rgb = rgba[..., :3].astype(np.uint16)
    out = (rgb * alpha + 255 * (255 - alpha) + 127) // 255
    return out.astype(np.uint8)


def jpeg_exif_orientation(data: bytes) -> int:
    """EXIF orientation from a JPEG's APP1 segment, read without decoding anything; 1 when absent or unreadable."""
    view = memoryview(data)
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if view[pos] != 0xFF:
            return 1
        marker = view[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        if marker in (0xDA, 0xD9):  # start of scan / end of image: no more metadata
            return 1
        length = (view[pos + 2] << 8) | view[pos + 3]
        if marker == 0xE1 and bytes(view[pos + 4 : pos + 10]) == b"Exif\x00\x00":
            return tiff_orientation(bytes(view[pos + 10 : pos + 2 + length]))
        pos += 2 + length
    return 1


def tiff_orientation(tiff: bytes) -> int:
    """Orientation tag of IFD0 in a TIFF-structured EXIF block."""
    try:
        endian = {b"II": "<", b"MM": ">"}[tiff[:2]]
        (ifd,) = struct.unpack_from(endian + "I", tiff, 4)
        (count,) = struct.unpack_from(endian + "H", tiff, ifd)
        for i in range(count):
            tag, typ, _n, = struct.unpack_from(endian + "HHI", tiff, ifd + 2 + 12 * i)
            if tag == EXIF_ORIENTATION_TAG:
                (value,) = struct.unpack_from(endian + "H", tiff, ifd + 2 + 12 * i + 8)
                return value if 1 <= value <= 8 else 1
    except (KeyError, struct.error):
        pass
    return 1


def _pillow_orientation(image: Image.Image) -> int:
    try:
        if image.format in ("PNG", "WEBP"):
            # PngImageFile.getexif() decodes the whole image to look for an eXIf chunk after the pixels; read only
            # what the header pass already found (eXIf before IDAT, the usual place).
            raw = image.info.get("exif")
            if not raw:
                return 1
            raw = raw[6:] if raw.startswith(b"Exif\x00\x00") else raw
            return tiff_orientation(raw)
        value = image.getexif().get(EXIF_ORIENTATION_TAG, 1)
    except Exception:  # a broken EXIF block must not fail an otherwise good image
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _jpeg_failure(data: bytes, exc: Exception) -> ImageError:
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


_TURBO = None


def _load_turbojpeg():
    """The shared TurboJPEG handle, or None when libturbojpeg is not installed (Pillow then decodes JPEGs)."""
    global _TURBO
    if _TURBO is None:
        try:
            from turbojpeg import TurboJPEG

            _TURBO = TurboJPEG()
        except (ImportError, RuntimeError, OSError):
            _TURBO = False
    return _TURBO or None
