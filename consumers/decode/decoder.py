"""Bytes -> upright-aware RGB pixels, decoded no larger than the model needs.

The format comes from the magic number (``sniff``), never from the file name. JPEGs go through libjpeg-turbo with
DCT-domain scaling (the decoder itself produces a 1/2, 1/4 or 1/8 size image, which is both the fastest path and an
antialiased reduction); PNG and WebP through OpenCV; a PDF page drawn by PDFium at its ``pdf_dpi`` size but at most
3x the target on each axis (``vlmstream.images.pdf``), then shrunk; everything else through Pillow (JPEG 2000 with
its own reduction: whole wavelet resolution levels skipped, ``jpeg2000``). Sizes are checked from the header before any
pixel is decoded, so a decompression bomb costs a few hundred bytes of parsing (``headers``). Pillow's modes become
8-bit RGB in ``pixels``; the failures are the classes in ``errors``.

The result stays in the file's stored orientation: rotating the small resized image is cheaper than rotating the
decoded one, so the stage applies ``orientation`` after the resize (see ``resize.apply_orientation``).
"""

from __future__ import annotations

import re
import struct
import warnings
from dataclasses import dataclass
from functools import lru_cache
from io import BytesIO

import cv2
import numpy as np
from PIL import Image, ImageFile, UnidentifiedImageError

from consumers.decode.errors import CorruptImage, PageOutOfRange, TooManyPixels, TruncatedImage, UnsupportedFormat
from consumers.decode.headers import (EXIF_ORIENTATION_TAG, check_jpeg_is_decodable, jpeg_exif_orientation, png_chunk,
                                      tiff_orientation)
from consumers.decode.jpeg2000 import jpeg2000_decomposition_levels, jpeg2000_is_cut_short, jpeg2000_levels_to_drop
from consumers.decode.pixels import composite_on_white, eight_bit, to_rgb
from consumers.decode.resize import resize_exact, shrink_antialiased, shrink_filtered, swaps_axes
from consumers.decode.sniff import sniff_format
from vlmstream.images import pages as page_files
from vlmstream.images import pdf
from vlmstream.images.errors import ImageError
from vlmstream.images.turbojpeg import turbojpeg_handle
from vlmstream.models.family import ModelFamily
from vlmstream.models.qwen2_vl import QWEN2_VL

TIFF_TILE_WIDTH_TAG, TIFF_TILE_LENGTH_TAG = 322, 323
# A TIFF tile is what libtiff allocates and inflates, whatever the image size: one covers at most the image plus
# padding to the tile grid. Tiles up to this area are allowed for any image (encoders use 256x256 for tiny ones).
_TILE_PIXELS_ANY_IMAGE = 1 << 20
_TILE_OVER_IMAGE_AREA = 4
# A PDF page is drawn at decode.pdf_dpi, the raster the processor's route starts from, so that glyphs are hinted to
# the same pixel grid as there, but at most this many times the model's size on each axis (a page larger than A3 at
# 0.2 MP), then resized. Drawn at another size the same glyphs land on other pixels whatever the resize: mean |diff|
# of normalised values from PDFium's own 200 dpi raster through Qwen2VLImageProcessor at 0.2 MP 0.10 (p99 1.2) drawn
# at the model's size, 0.033 (p99 0.39) at 3x, 0.008 (p99 0.08) at 200 dpi, each shrunk by Pillow's own resample
# (the stage's shrink below on the 200 dpi raster, Pillow's resample itself: the same 0.008, p99 0.075;
# benchmarks/bench_pdf_render.py).
PDF_OVERSAMPLE = 6.0
# Shrinking a drawn page by more than this: Pillow's antialiased bicubic, the kernel transformers' resize calls (on
# text the area filter stays 0.06 from it at 3x), Pillow's resample itself as banded matrix products after a box
# reduce (resize.shrink_antialiased, within a level of Pillow's: 5 ms on a 200 dpi letter page at 0.2 MP against
# 8.4 for Pillow's resample after the same reduce). A scanned page's JPEG decoded whole: the same kernel as one cv2
# filter pass after the same reduce (resize.shrink_filtered, nearly Pillow's on a scan's soft edges, and 1.5-3x
# cheaper than the products on a whole scan shrunk by less than 3x; Pillow's own resample costs more than the
# baseline's third there). By less, the stage's resize_exact as for any image (0.016 from the kernel at 2x, at half
# the cost).
PDF_PILLOW_SHRINK = 2.0
# The box reduce is by whole factors that leave at least PDF_REDUCING_GAP times the target on each axis, or, where
# none does, by 2 if that leaves PDF_LEAST_GAP times (a 300 dpi letter scan at 1 MP: the filter at full size costs
# more than the decode; benchmarks/bench_pdf_render.py).
PDF_REDUCING_GAP = 2.0
PDF_LEAST_GAP = 1.4


@dataclass(frozen=True)
class Decoded:
    """Pixels in the file's stored orientation, possibly already reduced by the decoder.

    ``width``/``height`` are the upright full-size dimensions; ``target_width``/``target_height`` the upright
    model input size the family's rule (smart_resize) computes from them."""

    pixels: np.ndarray
    orientation: int
    width: int
    height: int
    target_width: int
    target_height: int
    source_format: str
    scale: float = 1.0
    # Pages in a multi-page TIFF or PDF decoded without a page selector (only its first is decoded); 1 otherwise.
    pages: int = 1
    # A PDF page's text layer, up to decode.pdf_page_text_chars; '' otherwise.
    text: str = ""

    @property
    def stored_target(self) -> tuple[int, int]:
        """(height, width) the stored-orientation pixels must be resized to before ``orientation`` is applied."""
        if swaps_axes(self.orientation):
            return self.target_width, self.target_height
        return self.target_height, self.target_width


def _bomb_size(exc: Exception) -> str:
    """The image size in Pillow's bomb refusal ("Image size (N pixels) exceeds limit of ..."), else its words."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    return f"{int(found.group(1))} pixels (Pillow's header check)" if found else f"Pillow: {exc}"


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
        pdf_dpi: float = 200.0,
        max_pdf_pages: int = 1000,
        pdf_render_time_limit_s: float = 0.0,
        pdf_page_text_chars: int = 0,
        max_pdf_bytes: int = 64 * 1024 * 1024,
    ):
        self.family = family.with_pixel_limits(
            family.min_pixels if min_pixels is None else min_pixels,
            family.max_pixels if max_pixels is None else max_pixels)
        self.max_source_pixels = max_source_pixels
        self.pdf_dpi = pdf_dpi
        self.max_pdf_pages = max_pdf_pages
        self.pdf_render_time_limit_s = pdf_render_time_limit_s
        self.pdf_page_text_chars = pdf_page_text_chars
        self.max_pdf_bytes = max_pdf_bytes
        self.pdf_renderer: pdf.PageRenderer | None = None  # its child process starts at the first PDF page
        configure_pillow(max_source_pixels)
        self._turbo = turbojpeg_handle() if use_turbojpeg else None

    def close(self) -> None:
        if self.pdf_renderer is not None:
            self.pdf_renderer.close()

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
        if fmt == "pdf":
            return self._decode_pdf(data, page)
        return self._decode_pillow(data, fmt, page)

    # -- shared helpers ---------------------------------------------------------------------------------

    def _check_and_target(self, stored_w: int, stored_h: int, orientation: int) -> tuple[int, int, int, int]:
        if stored_w <= 0 or stored_h <= 0:
            raise CorruptImage(f"header declares an empty image ({stored_w}x{stored_h})")
        if stored_w * stored_h > self.max_source_pixels:
            raise TooManyPixels(f"{stored_w}x{stored_h} = {stored_w * stored_h} pixels", self.max_source_pixels)
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

    # -- PDF pages through PDFium ----------------------------------------------------------------------

    def _decode_pdf(self, data: bytes, page: int | None) -> Decoded:
        """The page drawn at ``_pdf_draw_size`` and resized to the family's target for its displayed size at
        ``pdf_dpi`` (``_shrink_pdf_page``; a scan's JPEG by ``_scan_jpeg``).
        Without a page selector the first page, with ``pages`` saying how many there are."""
        if self.pdf_renderer is None:
            self.pdf_renderer = pdf.PageRenderer(max_pixels=min(int(PDF_OVERSAMPLE ** 2 * self.family.max_pixels),
                                                                self.max_source_pixels),
                                                 max_bytes=self.max_pdf_bytes)
        rendered = self.pdf_renderer.render(
            data, page, self._pdf_draw_size, time_limit_s=self.pdf_render_time_limit_s,
            text_chars=self.pdf_page_text_chars, page_limit=self.max_pdf_pages,
            scan=self._scan_jpeg if self._turbo is not None else None, shrink=self._shrink_pdf_page)
        width, height, target_w, target_h = self._pdf_target(rendered.width_pt, rendered.height_pt)
        pixels = rendered.pixels
        # scale: the pixels' width over the page's at pdf_dpi
        return Decoded(pixels, 1, width, height, target_w, target_h, "pdf", pixels.shape[1] / width,
                       rendered.pages if page is None else 1, rendered.text)

    def _pdf_draw_size(self, width_pt: float, height_pt: float) -> tuple[int, int]:
        """(width, height) to draw a page of that many points at: the page at ``pdf_dpi``, the processor's input,
        but at most ``PDF_OVERSAMPLE`` times the target on each axis (a target larger than the page is then reached
        as the processor reaches it, by enlarging that raster)."""
        width, height, target_w, target_h = self._pdf_target(width_pt, height_pt)
        return min(width, round(PDF_OVERSAMPLE * target_w)), min(height, round(PDF_OVERSAMPLE * target_h))

    def _shrink_pdf_page(self, pixels: np.ndarray, width_pt: float, height_pt: float) -> np.ndarray:
        """A drawn page at its target: past ``PDF_PILLOW_SHRINK`` by ``shrink_antialiased``, else by the stage's
        resize_exact (the stage's own call then has nothing to do). ``pixels`` is the renderer's shared buffer, read
        in place: the result is always a new array."""
        target_w, target_h = self._pdf_target(width_pt, height_pt)[2:]
        if pixels.shape[1] > PDF_PILLOW_SHRINK * target_w:
            return shrink_antialiased(pixels, target_h, target_w, PDF_REDUCING_GAP, PDF_LEAST_GAP)
        resized = resize_exact(pixels, target_h, target_w)
        return resized.copy() if resized is pixels else resized

    def _scan_jpeg(self, data: bytes, width_pt: float, height_pt: float) -> np.ndarray | None:
        """A scanned page's own JPEG at the page's target: decoded whole (or, past ``PDF_OVERSAMPLE`` times the
        target on each axis, at the DCT scale that leaves that much), then shrunk by ``shrink_filtered``, nearly the
        processor's kernel; None for one libjpeg-turbo would hand back as CMYK (PDFium draws those). A DCT scale
        near the target, as the stage takes a photo's JPEG, is no box filter: on a scan's sharp edges it is p99
        0.53-0.64 of normalised values from the processor on the whole JPEG, 0.42-0.46 at 0.2 MP with the processor's
        kernel after it (benchmarks/bench_pdf_render.py)."""
        from turbojpeg import TJCS_CMYK, TJCS_YCCK, TJPF_RGB

        need_w, need_h = self._pdf_target(width_pt, height_pt)[2:]

        check_jpeg_is_decodable(data)
        try:
            stored_w, stored_h, _subsample, colorspace = self._turbo.decode_header(data)
        except OSError as exc:
            raise _jpeg_failure(data, exc) from exc
        if colorspace in (TJCS_CMYK, TJCS_YCCK):
            return None
        if stored_w * stored_h > self.max_source_pixels:
            raise TooManyPixels(f"a scanned page's JPEG of {stored_w}x{stored_h} pixels", self.max_source_pixels)
        scaling = pick_dct_scale(stored_w, stored_h, round(PDF_OVERSAMPLE * need_w), round(PDF_OVERSAMPLE * need_h),
                                 self._turbo.scaling_factors)
        pixels = self._turbo_decode(data, TJPF_RGB, scaling)
        if pixels.shape[0] > need_h and pixels.shape[1] > need_w:
            return shrink_filtered(pixels, need_h, need_w, PDF_REDUCING_GAP, PDF_LEAST_GAP)
        return resize_exact(pixels, need_h, need_w)  # a scan smaller than its target: enlarged as any image

    def _pdf_target(self, width_pt: float, height_pt: float) -> tuple[int, int, int, int]:
        """(width, height, target width, target height) of a page of that many points at ``pdf_dpi``; raises past
        ``max_source_pixels`` (a page of absurd size) or the family's aspect limit."""
        to_pixels = self.pdf_dpi / pdf.POINTS_PER_INCH
        return self._check_and_target(max(1, round(width_pt * to_pixels)), max(1, round(height_pt * to_pixels)), 1)

    # -- everything else through Pillow -----------------------------------------------------------------

    def _decode_pillow(self, data: bytes, fmt: str, page: int | None = None) -> Decoded:
        try:
            image = Image.open(BytesIO(data))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise TooManyPixels(_bomb_size(exc), self.max_source_pixels) from exc
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
            raise TooManyPixels(_bomb_size(exc), self.max_source_pixels) from exc
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
            raise TooManyPixels(f"TIFF tile {tile_w}x{tile_h} = {tile} pixels", self.max_source_pixels)
        if tile > max(_TILE_OVER_IMAGE_AREA * stored_w * stored_h, _TILE_PIXELS_ANY_IMAGE):
            raise CorruptImage(f"TIFF tile {tile_w}x{tile_h} is far larger than its {stored_w}x{stored_h} image")


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


# Pillow's AVIF plugin and pillow-heif report damaged files as RuntimeError ("Decoding of color planes failed",
# libheif's "Security limit exceeded").
_RUNTIME_ERROR_FORMATS = ("avif", "heif")
