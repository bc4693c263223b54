"""What a decode stage is and what it returns: a decoded image or a failure, both plain values (no Kafka here)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlmstream.images.errors import ImageError

if TYPE_CHECKING:
    from vlmstream.images.claimcheck import ClaimCheckStore


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


class Stage(ABC):
    """What the decode runner drives: ``stage(uri) -> PreparedImage | ImageFailure``, a plain callable that never
    raises, told when a document's images are done and closed when the worker stops. ``DecodeStage`` is the one
    the fleet runs; a stage holding nothing across images or documents keeps the no-op hooks."""

    # Where the runner puts payloads over the record limit; None: it opens the configured store itself.
    store: ClaimCheckStore | None = None

    @abstractmethod
    def __call__(self, uri: str) -> PreparedImage | ImageFailure:
        """One image, by URI (``#page=N`` picks a page); a failure is returned, never raised."""

    def end_document(self) -> None:
        """The document's images are done: anything held for them (a multi-page file's bytes) is let go."""

    def close(self) -> None:
        """The worker stops: release what the stage opened."""
