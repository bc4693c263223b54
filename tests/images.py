"""Images made on the fly for tests: a small corpus when no real folder is available, and edge cases."""

from __future__ import annotations

import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

from consumers.decode.sniff import pillow_reads_avif, pillow_reads_heif


def _photo_like(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([(x / width) * 255, (y / height) * 255, ((x + y) / (width + height)) * 255], axis=-1)
    noise = rng.normal(0, 12, size=base.shape)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


@lru_cache(maxsize=1)
def generated_corpus() -> Path:
    """A few JPEG, PNG and WebP files of different sizes and aspect ratios."""
    root = Path(tempfile.mkdtemp(prefix="vlmstream-corpus-"))
    sizes = [(640, 480), (1024, 768), (480, 800), (2000, 1200), (300, 300), (1600, 900)]
    for i, (w, h) in enumerate(sizes):
        img = _photo_like(w, h, i)
        fmt = ("JPEG", "PNG", "WEBP")[i % 3]
        img.save(root / f"img{i}.{fmt.lower().replace('jpeg', 'jpg')}", format=fmt, quality=90)
    return root


# ---- edge cases: every supported format and mode, EXIF orientation, and bad inputs --------------------------

MARKER = (255, 0, 0)  # red block in the stored image's top-left corner, to see where orientation moves it


def marked_image(width: int = 280, height: int = 140, *, mode: str = "RGB") -> Image.Image:
    """A mid-grey image with a red block in the top-left corner and a blue one in the bottom-right."""
    arr = np.full((height, width, 3), 128, np.uint8)
    block = max(8, min(width, height) // 5)
    arr[:block, :block] = MARKER
    arr[-block:, -block:] = (0, 0, 255)
    image = Image.fromarray(arr, "RGB")
    return image if mode == "RGB" else image.convert(mode)


def _save(image: Image.Image, fmt: str, **params) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def jpeg_with_orientation(orientation: int, width: int = 280, height: int = 140) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _save(marked_image(width, height), "JPEG", quality=95, exif=exif.tobytes())


def png_with_orientation(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _save(marked_image(), "PNG", exif=exif.tobytes())


def rgba_half_transparent() -> bytes:
    """Left half opaque red, right half fully transparent (black underneath): must come out white on the right."""
    arr = np.zeros((100, 200, 4), np.uint8)
    arr[:, :100] = (255, 0, 0, 255)
    return _save(Image.fromarray(arr, "RGBA"), "PNG")


def png_16bit_gray(value: int = 40000) -> bytes:
    import cv2

    ok, data = cv2.imencode(".png", np.full((64, 96), value, np.uint16))
    assert ok
    return data.tobytes()


def png_16bit_rgb() -> bytes:
    import cv2

    bgr = np.zeros((64, 96, 3), np.uint16)
    bgr[..., 2] = 65535  # red, full scale
    bgr[..., 1] = 32896  # green, half scale (128 * 257)
    ok, data = cv2.imencode(".png", bgr)
    assert ok
    return data.tobytes()


@lru_cache(maxsize=1)
def supported_formats() -> dict[str, bytes]:
    """One file per supported format and pixel mode, each at most a few kB."""
    photo = _photo_like(200, 120, 7)
    palette_rgba = marked_image(120, 80).convert("RGBA")
    palette_rgba.putpixel((0, 0), (0, 0, 0, 0))
    return {
        "jpeg_baseline": _save(photo, "JPEG", quality=90),
        "jpeg_progressive": _save(photo, "JPEG", quality=90, progressive=True),
        "jpeg_gray": _save(photo.convert("L"), "JPEG", quality=90),
        "jpeg_cmyk": _save(photo.convert("CMYK"), "JPEG", quality=90),
        "png_rgb": _save(photo, "PNG"),
        "png_rgba": rgba_half_transparent(),
        "png_palette": _save(marked_image(120, 80).convert("P", palette=Image.Palette.ADAPTIVE), "PNG"),
        "png_palette_transparent": _save(palette_rgba.convert("P"), "PNG", transparency=0),
        "png_gray16": png_16bit_gray(),
        "png_rgb16": png_16bit_rgb(),
        "png_la": _save(photo.convert("LA"), "PNG"),
        "png_gray": _save(photo.convert("L"), "PNG"),
        "png_bilevel": _save(photo.convert("1"), "PNG"),
        "webp": _save(photo, "WEBP", quality=90),
        "webp_lossless_rgba": _save(photo.convert("RGBA"), "WEBP", lossless=True),
        "gif": _save(marked_image(120, 80).convert("P"), "GIF"),
        "tiff": _save(photo, "TIFF"),
        "tiff_cmyk": _save(photo.convert("CMYK"), "TIFF"),
        "tiff_float": _save(Image.fromarray(np.linspace(0, 1, 96 * 64, dtype=np.float32).reshape(64, 96), "F"),
                            "TIFF"),
        "bmp": _save(photo, "BMP"),
        "jpeg2000": _save(photo, "JPEG2000"),
        "jpeg2000_codestream": _save(photo, "JPEG2000", no_jp2=True),
        "netpbm_ppm": _save(photo, "PPM"),
        "netpbm_pgm": _save(photo.convert("L"), "PPM"),
        "netpbm_pbm": _save(photo.convert("1"), "PPM"),
        "qoi": _save(photo, "QOI"),
        **({"avif": _save(photo, "AVIF", quality=90)} if pillow_reads_avif() else {}),  # Pillow with libavif
        **({"heif": _save(photo, "HEIF", quality=90)} if pillow_reads_heif() else {}),  # with pillow-heif
    }


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    import struct
    import zlib

    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid-looking PNG header claiming width x height RGB pixels, with almost no data behind it."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr)
            + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 1024)) + _png_chunk(b"IEND", b""))


def jpeg_bomb(width: int = 60_000, height: int = 60_000) -> bytes:
    """A small real JPEG whose frame header (SOF0) is rewritten to claim width x height."""
    import struct

    data = bytearray(_save(_photo_like(64, 64, 1), "JPEG", quality=80))
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, height, width)
    return bytes(data)


def jp2_with_box_before_codestream(jp2: bytes, size: int) -> bytes:
    """The JP2 with an XML box of `size` bytes after its file-type box, as a large ICC profile or metadata puts
    kilobytes between the file's start and its codestream."""
    import struct

    after_ftyp = 12 + struct.unpack(">I", jp2[12:16])[0]  # the 12-byte signature box, then ftyp
    box = struct.pack(">I", size + 8) + b"xml " + b"<x/>".ljust(size, b" ")
    return jp2[:after_ftyp] + box + jp2[after_ftyp:]


def jpeg2000_bomb(width: int = 60_000, height: int = 60_000) -> bytes:
    """A small real JPEG 2000 codestream whose SIZ segment is rewritten to claim width x height."""
    import struct

    data = bytearray(_save(_photo_like(64, 64, 2), "JPEG2000", no_jp2=True))
    siz = data.index(b"\xff\x51")
    # SIZ: marker, length, capabilities (2), then the reference grid's width and height.
    struct.pack_into(">II", data, siz + 6, width, height)
    return bytes(data)


@lru_cache(maxsize=1)
def bad_inputs() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, the error_kind the decode stage must report)."""
    jpeg = _save(_photo_like(320, 240, 3), "JPEG", quality=90)
    png = _save(_photo_like(320, 240, 4), "PNG")
    jp2 = _save(_photo_like(320, 240, 5), "JPEG2000")
    rng = np.random.default_rng(0)
    return {
        "text_named_jpg": (b"Just some text, not a picture.\n" * 4, "decode_not_an_image"),
        "empty": (b"", "decode_not_an_image"),
        "jpeg_header_then_garbage": (jpeg[:2] + b"\xff\xe0" + rng.bytes(2000), "decode_corrupt"),
        "png_signature_then_garbage": (png[:8] + rng.bytes(2000), "decode_corrupt"),
        "truncated_jpeg": (jpeg[: len(jpeg) // 2], "decode_truncated"),
        "truncated_png": (png[: len(png) // 2], "decode_truncated"),
        "png_bomb_100k": (png_bomb(), "decode_too_many_pixels"),
        "jpeg_bomb_60k": (jpeg_bomb(), "decode_too_many_pixels"),
        "pdf_header_only": (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n", "decode_corrupt"),
        "svg": (b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', "decode_unsupported"),
        "extreme_aspect": (_save(Image.new("RGB", (4020, 20), "white"), "PNG"), "decode_bad_aspect"),
        "heic_brand_only": (b"\x00\x00\x00\x18ftypheic" + bytes(64),
                            "decode_corrupt" if pillow_reads_heif() else "decode_unsupported"),
        "iso_media_video": (b"\x00\x00\x00\x18ftypisom" + bytes(64), "decode_unsupported"),
        "truncated_jpeg2000": (jp2[: len(jp2) // 2], "decode_truncated"),
        "jpeg2000_bomb": (jpeg2000_bomb(), "decode_too_many_pixels"),
    }


def damaged(data, original: bytes) -> bytes:
    """A hypothesis-drawn damage of ``original``: cut short, or up to 8 bytes flipped, or up to 8 runs spliced in
    (``data`` is a ``st.data()`` draw)."""
    from hypothesis import strategies as st

    damaged = bytearray(original)
    how = data.draw(st.sampled_from(["flip", "cut", "splice"]))
    if how == "cut":
        return bytes(damaged[: data.draw(st.integers(0, len(damaged) - 1))])
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(damaged) - 1))
        if how == "flip":
            damaged[at] ^= data.draw(st.integers(1, 255))
        else:
            damaged[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    return bytes(damaged)
