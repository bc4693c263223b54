"""The per-image failure: every error of the decode stage, the payload codec and the claim-check store is one."""

from __future__ import annotations


class ImageError(Exception):
    """A per-image failure. ``error_kind`` is stable and machine-readable; ``retriable`` says whether the
    same input may succeed later (a timeout, a 503), as opposed to never (corrupt bytes, a 404)."""

    error_kind = "image_error"
    retriable = False

    def __init__(self, detail: str, *, error_kind: str | None = None, retriable: bool | None = None):
        super().__init__(detail)
        if error_kind is not None:
            self.error_kind = error_kind
        if retriable is not None:
            self.retriable = retriable


class TooManyPixels(ImageError):
    """More pixels than ``decode.max_source_pixels``: the decompression-bomb guard, which refuses a genuine large
    scan (a map, a poster) by the same rule, so the reason names the setting its owner would raise. Raised by the
    decode stage and by ``vlmstream view``'s thumbnails alike."""

    error_kind = "decode_too_many_pixels"

    def __init__(self, what: str, limit: int):
        super().__init__(f"{what}: over decode.max_source_pixels ({limit:,}; "
                         f"VLMSTREAM_DECODE__MAX_SOURCE_PIXELS raises it)")
