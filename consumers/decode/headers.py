"""Byte-level header parsers: JPEG marker segments (EXIF orientation, frames a decoder cannot or should not take),
the orientation tag of a TIFF-structured block, PNG chunks. Nothing here decodes a pixel."""

from __future__ import annotations

import struct

from consumers.decode.errors import CorruptImage, UnsupportedFormat

EXIF_ORIENTATION_TAG = 0x0112

# Each progressive scan makes libjpeg walk every block of the image again, and it only warns about a repeated one:
# a few hundred kB of duplicated scans cost minutes. 500 is libjpeg-turbo's recommended limit for untrusted input;
# real progressive files have about ten (an EXIF thumbnail adds a few).
MAX_JPEG_SCANS = 500
# SOF markers of the lossless and hierarchical processes, which libjpeg-turbo's 8-bit decoder does not implement.
_UNSUPPORTED_JPEG_FRAMES = {0xC3: "lossless", 0xC5: "hierarchical", 0xC6: "hierarchical", 0xC7: "lossless",
                            0xCB: "lossless", 0xCD: "hierarchical", 0xCE: "hierarchical", 0xCF: "lossless"}
_JPEG_FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOFn; C4/C8/CC are DHT, JPG, DAC
_PROGRESSIVE_JPEG_FRAMES = frozenset({0xC2, 0xCA})  # Huffman and arithmetic progressive


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
