"""What the decode stage returns: a decoded image or a failure, both plain values (no Kafka here)."""

from __future__ import annotations

from dataclasses import dataclass

from vlmstream.images.errors import ImageError



@dataclass(frozen=True)
class PreparedImage:
    """Pixels at exactly the model's input size, encoded with ``codec`` (jpeg, png, or raw RGB)."""

    data: bytes
    codec: str
    width: int
    height: int
    orig_width: int
    orig_height: int
    grid_thw: tuple[int, int, int]
    source_format: str
    decode_ms: float
    fetch_bytes: int
    # Per-step wall times in ms (fetch_ms, decode_ms, resize_ms, encode_ms) and the source size class, for metrics.
    timings: dict[str, float] | None = None
    # Pages of a multi-page source of which only the first was decoded (no `#page=N` in its URI); 1 otherwise.
    pages: int = 1
    # CPU seconds (in ms) this worker's thread spent preparing it (decode, resize, encode): unlike the wall times it
    # does not grow when other processes share the cores, so an estimate can add it to theirs.
    prepare_cpu_ms: float | None = None
    # A PDF page's text layer (decode.pdf_page_text_chars); '' otherwise.
    page_text: str = ""


@dataclass(frozen=True)
class ImageFailure:
    error_kind: str
    detail: str
    retriable: bool
    stage: str = "decode"

    @classmethod
    def from_error(cls, error: ImageError) -> "ImageFailure":
        return cls(error.error_kind, str(error), error.retriable)
