"""One document's state in the results aggregator and its rules: which records change its result, when it is
complete, the result (or the dead letter) it makes, and what an emitted result leaves behind to judge late records
by. No Kafka here: the aggregator (``aggregator.py``) hands in decoded records and sends what comes out."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from schemas import DeadLetter, Description, DocumentResult, SchemaError, now

if TYPE_CHECKING:
    from kafka import TopicPartition

    from vlmstream.kafka.checkpoint import Output

# Dead letters that note something about an image that was still decoded and described: not a failure of it.
NOTES = ("pages_not_described",)
# Dead letters of this aggregator and of the stages that read its results: not about an image of the document.
DOWNSTREAM_STAGES = ("results", "condense")


@dataclass
class DocumentState:
    doc_id: str
    image_count: int | None = None
    images: dict[int, dict[str, Any]] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    document_error: dict[str, Any] | None = None
    # error_kind -> image index -> detail: what an earlier stage noted about an image that did not fail
    notes: dict[str, dict[int, str]] = field(default_factory=dict)
    first: dict[TopicPartition, int] = field(default_factory=dict)  # lowest offset of its records per partition
    last: dict[TopicPartition, int] = field(default_factory=dict)
    opened_at: float = field(default_factory=time.monotonic)
    emitted: bool = False
    held: list[Output] = field(default_factory=list)  # exactly-once: its outputs, until a transaction carries them

    def add_position(self, tp: TopicPartition, offset: int) -> None:
        self.first[tp] = min(self.first.get(tp, offset), offset)
        self.last[tp] = max(self.last.get(tp, offset), offset)

    def behind(self, points: Mapping[TopicPartition, int]) -> bool:
        """Whether the commit points have passed every record of it: a restart would re-read none of them."""
        return all(last < points.get(tp, last + 1) for tp, last in self.last.items())

    def is_new_version(self, count: int | None) -> bool:
        """Whether a record's image count differs from the one known: a newer version of the document (the producer
        republished it with other images), which replaces what the result said. Records the count as known."""
        new_version = None not in (self.image_count, count) and self.image_count != count
        if count is not None:
            self.image_count = count
        return new_version

    def complete(self) -> bool:
        if self.document_error is not None:
            return True
        return self.image_count is not None and all(i in self.images for i in range(self.image_count))

    def add_description(self, d: Description) -> bool:
        """Take an image's description; whether the result would now say something else about it."""
        new_version = self.is_new_version(d.image_count)  # another source URI at an index (below) is one too
        # A PDF page's text layer belongs to its image; the rest of the metadata is the document's.
        shared = {key: value for key, value in d.metadata.items() if key != "page_text"}
        if shared:
            self.metadata = {**shared, **self.metadata}
        before = self.images.get(d.image_index)
        self.images[d.image_index] = {"image_index": d.image_index, "status": "ok", "source_uri": d.source_uri,
                                      "text": d.text, "model": d.model}
        if isinstance(d.metadata.get("page_text"), str) and d.metadata["page_text"]:
            self.images[d.image_index]["page_text"] = d.metadata["page_text"]
        # Another model's description of an image is a replay with that model: the result says so, image by image.
        return (before is None or before.get("status") != "ok" or new_version
                or before.get("source_uri") != d.source_uri or before.get("model") != d.model)

    def add_dead_letter(self, letter: DeadLetter) -> bool | None:
        """Take a dead letter about the document or one of its images: whether the result would now say something
        else, or None when the letter is no reason to emit (a note before the result went out; a failed try of
        an image that succeeded)."""
        new_version = self.is_new_version(letter.image_count)
        failure = {"status": "failed", "source_uri": letter.source_uri, "stage": letter.stage,
                   "error_kind": letter.error_kind, "detail": letter.detail[:1000]}
        if letter.error_kind in NOTES and letter.image_index is not None:
            # The image itself was decoded and is on its way; only the note goes into the result's metadata. The
            # two topics are read in no fixed order: a note after the result has gone out sends it again.
            notes = self.notes.setdefault(letter.error_kind, {})
            changed = notes.get(letter.image_index) != letter.detail[:1000]
            notes[letter.image_index] = letter.detail[:1000]
            return changed if self.emitted else None
        if letter.image_index is None:
            changed = self.document_error is None
            self.document_error = {k: failure[k] for k in ("stage", "error_kind", "detail")}
            return changed
        before = self.images.get(letter.image_index)
        if before is not None and before["status"] == "ok" and letter.source_uri in (None, before.get("source_uri")):
            return None  # the image succeeded on another try: its dead letter is history
        self.images[letter.image_index] = {"image_index": letter.image_index, **failure}
        return before is None or new_version or before.get("source_uri") != letter.source_uri

    def outcomes(self, missing_kind: str | None = None) -> list[dict[str, Any]]:
        """Every image's entry in the result, in index order: an image without an outcome failed with the document's
        error, or with ``missing_kind`` (``missing`` unless given)."""
        count = self.image_count
        if count is None:
            count = max(self.images, default=-1) + 1
        images = []
        for index in range(count):
            entry = self.images.get(index)
            if entry is None:
                error = self.document_error or {"stage": "results", "error_kind": missing_kind or "missing",
                                                "detail": "no description or dead letter arrived for this image"}
                entry = {"image_index": index, "status": "failed", "source_uri": None, **error}
            images.append(entry)
        return images

    def result(self, images: list[dict[str, Any]]) -> DocumentResult:
        """The document's result over ``images`` (``outcomes()``), its notes and error in the metadata."""
        succeeded = sum(1 for i in images if i["status"] == "ok")
        metadata = dict(self.metadata)
        if self.document_error is not None:
            metadata["document_error"] = self.document_error
        for kind, by_image in self.notes.items():
            metadata[kind] = {str(index): detail for index, detail in sorted(by_image.items())}
        return DocumentResult(doc_id=self.doc_id, image_count=len(images), succeeded=succeeded,
                              failed=len(images) - succeeded, images=tuple(images), metadata=metadata,
                              completed_at=now())

    def dead_letter(self, error_kind: str, detail: str) -> tuple[DeadLetter, bytes]:
        """The aggregator's own dead letter about this document (stage ``results``) and its bytes."""
        letter = DeadLetter(stage="results", error_kind=error_kind, detail=detail[:4000], doc_id=self.doc_id,
                            image_count=self.image_count, created_at=now())
        try:
            return letter, letter.encode()
        except SchemaError:  # the document's own id or count is what cannot be written: name it in the detail
            letter = DeadLetter(stage="results", error_kind=error_kind, created_at=now(),
                                detail=f"document {self.doc_id[:200]!r} (count {self.image_count}): {detail}"[:4000])
            return letter, letter.encode()


def within_record_limit(result: DocumentResult, max_message_bytes: int) -> tuple[bytes, bool]:
    """The result's bytes, and whether its texts were cut: over the record limit (forty long descriptions can be),
    the texts are cut to share what fits, each marked so. The descriptions topic keeps every text whole. Raises
    ``SchemaError`` when even the cut result does not fit."""
    value = result.encode()
    limit = max_message_bytes - 64 * 1024  # headers and the record's own framing
    if len(value) <= limit:
        return value, False
    marker = " [cut: the whole text is on the descriptions topic]"
    texts = [(i.get("text") or "").encode() for i in result.images]
    share = max(0, (limit - (len(value) - sum(map(len, texts)))) // max(1, len(texts)) - len(marker))
    for _ in range(4):  # bytes of text, not characters; JSON escapes can still add some: shrink and retry
        images = tuple({**i, "text": t[:share].decode(errors="ignore") + marker} if len(t) > share else i
                       for i, t in zip(result.images, texts))
        value = dataclasses.replace(result, images=images).encode()
        if len(value) <= limit or share <= 0:
            break
        share = max(0, int(share * limit / len(value)) - 1)
    if len(value) > limit:
        raise SchemaError("document_result", "(message)", f"{len(value)} bytes even with its texts cut, "
                          f"over kafka.max_message_bytes")
    return value, True


def rebuild_points(positions: Mapping[TopicPartition, int],
                   docs: Iterable[DocumentState]) -> dict[TopicPartition, int]:
    """Per partition, the offset from which a restart rebuilds every document it would see in full: below the first
    record of every open document, and below every record of an emitted one that a restart would partly re-read.
    ``positions``: the next offset to read per partition; ``docs`` is iterated more than once."""
    points = dict(positions)
    for doc in docs:
        if not doc.emitted:
            for tp, first in doc.first.items():
                points[tp] = min(points.get(tp, first), first)
    moved = True
    while moved:  # emitted documents that a restart would partly re-read pin all their records
        moved = False
        for doc in docs:
            if doc.emitted and not doc.behind(points):
                for tp, first in doc.first.items():
                    if first < points.get(tp, first + 1):
                        points[tp] = first
                        moved = True
    return points


def short_hash(text: str | None) -> bytes:
    """4 bytes for a source URI or a model name; zeros for none."""
    return hashlib.blake2b(text.encode(), digest_size=4).digest() if text else b"\0\0\0\0"


MIXED_MODELS = b"mixed"  # five bytes: never a 4-byte hash


@dataclass(frozen=True, slots=True)
class EmittedResult:
    """What the last result emitted for a document said, compactly: enough to tell a late record of the same
    version (which must not make the result worse) from a newer version (which replaces it)."""

    image_count: int
    uri_hashes: bytes  # 4 bytes per index, zeros where the source URI is unknown
    succeeded: frozenset[int]
    model_hash: bytes  # the model that described every image that succeeded; MIXED_MODELS where they differ

    @classmethod
    def of(cls, images: list[dict[str, Any]]) -> "EmittedResult":
        models = {i.get("model") for i in images if i["status"] == "ok"}
        model_hash = short_hash(models.pop()) if len(models) == 1 else MIXED_MODELS
        return cls(len(images), b"".join(short_hash(i.get("source_uri")) for i in images),
                   frozenset(i["image_index"] for i in images if i["status"] == "ok"), model_hash)

    def described_by(self, model: str | None) -> bool:
        """Whether every image that succeeded was described by ``model``: a description by another one is a
        replay with that model, which may replace the result, not a duplicate."""
        return self.model_hash == short_hash(model)

    def same_version(self, image_count: int | None, uris: dict[int, str | None]) -> bool:
        """No other image count, and no other source URI at an index both know."""
        if image_count is not None and image_count != self.image_count:
            return False
        zero = b"\0\0\0\0"
        for index, uri in uris.items():
            if not 0 <= index < self.image_count:
                return False
            known = self.uri_hashes[4 * index:4 * index + 4]
            if uri and known != zero and known != short_hash(uri):
                return False
        return True

    def adds_nothing(self, image_count: int | None, image_index: int | None, source_uri: str | None, *,
                     success: bool, model: str | None = None) -> bool:
        """Whether a record of this document is of the same version and cannot add a success to this result (a
        redriven image that succeeded, or a replay with another model, can)."""
        uris = {} if image_index is None else {image_index: source_uri}
        if not self.same_version(image_count, uris):
            return False
        return not (success and (image_index not in self.succeeded or not self.described_by(model)))
