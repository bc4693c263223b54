"""The decode stage's per-image failures, each with its stable ``error_kind``. (``BadAspectRatio`` belongs to the
model family's resize rule: vlmstream/models/qwen2_vl.py.)"""

from __future__ import annotations

from vlmstream.images.errors import ImageError, TooManyPixels  # noqa: F401 - shared with `vlmstream view`: its home


class NotAnImage(ImageError):
    error_kind = "decode_not_an_image"


class UnsupportedFormat(ImageError):
    error_kind = "decode_unsupported"


class TruncatedImage(ImageError):
    error_kind = "decode_truncated"


class CorruptImage(ImageError):
    error_kind = "decode_corrupt"


class PageOutOfRange(ImageError):
    error_kind = "decode_page_out_of_range"


class DecodeTimeout(ImageError):
    """Decoding took longer than ``decode.decode_time_limit_s`` (the stage's ``time_limit``)."""

    error_kind = "decode_timeout"
