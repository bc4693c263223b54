"""The image format from the leading bytes (the magic number), never from the file name."""

from __future__ import annotations

from functools import lru_cache

from consumers.decode.errors import NotAnImage, UnsupportedFormat
from vlmstream.images.pdf import is_pdf

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
    (b"\xff\x0a", "jpegxl"),
    (b"\x00\x00\x00\x0cJXL ", "jpegxl"),
)


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
    if is_pdf(data):
        return "pdf"
    if head.lstrip().startswith((b"<svg", b"<?xml")):
        raise UnsupportedFormat("SVG (vector) is not supported")
    raise NotAnImage(f"no known image signature (first bytes {head[:8]!r}, {len(data)} bytes)")


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
