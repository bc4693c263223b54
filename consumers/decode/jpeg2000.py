"""JPEG 2000 from its header bytes: how many wavelet resolution levels a decode may skip (each halves both sides and
skips its decoding), and whether a file ends before its codestream does."""

from __future__ import annotations

import struct


def jpeg2000_levels_to_drop(width: int, height: int, need_w: int, need_h: int, most: int = 5) -> int:
    """How many JPEG 2000 resolution levels can be skipped with the image still at least need_w x need_h (each
    level halves both sides, rounding up). A file with fewer levels than asked for is decoded at its smallest."""
    levels = 0
    while (levels < most and -(-width // (2 << levels)) >= need_w and -(-height // (2 << levels)) >= need_h):
        levels += 1
    return levels


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
