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
