"""The job `vlmstream estimate` predicts, seen without fetching an image: its documents (a folder, a manifest or the
documents topic's backlog), each local image's size from its file header (Pillow reads no pixels), the size the
model takes it at (the family's resize rule and the budget), hence its size class; and the sample drawn from it."""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

# Images per document, the strata's edges: 1, 2-3, 4-7, 8-15, 16-31, 32+.
_IPD_EDGES = (1, 2, 4, 8, 16, 32)
SIZE_HEADERS_WITHIN_S = 20.0


@dataclass
class JobImage:
    uri: str
    size_class: str
    source_px: int | None
    effective_px: int | None


@dataclass
class JobDocument:
    doc: Any  # DocumentRef
    images: list[JobImage]

    @property
    def stratum(self) -> tuple[int, str]:
        n = len(self.images)
        bucket = max(i for i, edge in enumerate(_IPD_EDGES) if n >= edge) if n else 0
        classes = Counter(im.size_class for im in self.images)
        return bucket, classes.most_common(1)[0][0] if classes else "-"


@dataclass
class JobShape:
    documents: list[JobDocument]
    unseen: list[str] = field(default_factory=list)  # what could not be seen without fetching

    @property
    def images(self) -> int:
        return sum(len(d.images) for d in self.documents)

    def classes(self) -> Counter:
        return Counter(im.size_class for d in self.documents for im in d.images)

    def per_document(self) -> Counter:
        return Counter(len(d.images) for d in self.documents)


def _local_path(uri: str) -> tuple[Path | None, int]:
    """(path, page from 1) of a local image URI; (None, 0) for a remote one."""
    path, _, fragment = uri.removeprefix("file://").partition("#")
    if "://" in path:
        return None, 0
    page = int(fragment.removeprefix("page=")) if fragment.startswith("page=") and fragment[5:].isdigit() else 1
    return Path(path), page


def _pdf_page_pixels(path: Path, page: int, pdf_dpi: float) -> tuple[int, int]:
    """A PDF page's (width, height) in pixels at ``pdf_dpi`` as displayed, from its page tree (nothing drawn)."""
    from vlmstream.images import pdf

    with pdf.open_document(path) as document:
        width, height = pdf.page_size(document, page)
    to_pixels = pdf_dpi / pdf.POINTS_PER_INCH
    return max(1, round(width * to_pixels)), max(1, round(height * to_pixels))


def read_shape(documents: list[Any], family: Any, min_pixels: int, max_pixels: int,
               within_s: float = SIZE_HEADERS_WITHIN_S, pdf_dpi: float = 200.0) -> JobShape:
    """Each document's images with their size class, from file headers only (a PDF page's from its page tree, at
    ``pdf_dpi``); past within_s (or for remote and unreadable images) the size is unknown ('?')."""
    from PIL import Image

    from vlmstream.images.errors import ImageError

    from vlmstream.projection.sample import size_class

    deadline = time.monotonic() + within_s
    out, unknown_remote, unknown_late, unknown_bad = [], 0, 0, 0
    sizes: dict[str, tuple[int, int] | None] = {}
    for doc in documents:
        images = []
        for uri in doc.image_uris:
            if uri not in sizes:
                path, page = _local_path(uri)
                size = None
                if path is None:
                    unknown_remote += 1
                elif time.monotonic() > deadline:
                    unknown_late += 1
                else:
                    try:
                        size = _pdf_page_pixels(path, page, pdf_dpi) if path.suffix.lower() == ".pdf" else None
                        if size is None:
                            with Image.open(path) as im:
                                if page > 1:
                                    im.seek(page - 1)
                                size = im.size
                    except (OSError, ValueError, EOFError, Image.DecompressionBombError, ImageError):
                        unknown_bad += 1
                sizes[uri] = size
            size = sizes[uri]
            if size is None:
                images.append(JobImage(uri, size_class(None, None), None, None))
                continue
            width, height = size
            try:
                th, tw = family.target_size(height, width, min_pixels, max_pixels)
                effective = th * tw
            except ValueError:  # an aspect ratio the model refuses: decode dead-letters it, cheaply
                effective = None
            images.append(JobImage(uri, size_class(width * height, effective), width * height, effective))
        out.append(JobDocument(doc, images))
    unseen = []
    if unknown_remote:
        unseen.append(f"{unknown_remote} remote images: sizes not read (fetching them is the job); costed at the "
                      "sample's mean")
    if unknown_late:
        unseen.append(f"{unknown_late} images past the {within_s:.0f} s spent reading headers: sizes not read; "
                      "costed at the sample's mean")
    if unknown_bad:
        unseen.append(f"{unknown_bad} local images whose header could not be read (decode will dead-letter or "
                      "decode them): costed at the sample's mean")
    return JobShape(out, unseen)


def draw_sample(shape: JobShape, target_images: int, seed: int = 0) -> list[JobDocument]:
    """Whole documents, stratified by images per document and size class: one document from every stratum first (so
    the heavy tail is always in), then the rest of the target shared out over the strata in proportion to their
    images; then a document for any size class still missing. Returned in the job's order."""
    rng = random.Random(seed)
    strata: dict[tuple[int, str], list[JobDocument]] = defaultdict(list)
    for doc in shape.documents:
        if doc.images:
            strata[doc.stratum].append(doc)
    for docs in strata.values():
        rng.shuffle(docs)
    chosen = [docs[0] for _key, docs in sorted(strata.items())]
    left = max(0, target_images - sum(len(d.images) for d in chosen))
    total = max(1, shape.images)
    for _key, docs in sorted(strata.items()):
        share = left * sum(len(d.images) for d in docs) / total
        images = 0
        for doc in docs[1:]:
            if images + len(doc.images) / 2 > share:
                break
            chosen.append(doc)
            images += len(doc.images)
    have = {im.size_class for d in chosen for im in d.images}
    for name in sorted(set(shape.classes()) - have):
        candidates = [d for d in shape.documents if d not in chosen and any(im.size_class == name for im in d.images)]
        if candidates:
            chosen.append(min(candidates, key=lambda d: len(d.images)))
    # In the job's order: what runs together (a large image padding its batch's small ones, heavy documents
    # clustered at the end) runs together in the sample too.
    position = {id(d): i for i, d in enumerate(shape.documents)}
    return sorted(chosen, key=lambda d: position[id(d)])


def job_documents(settings: Any, source: Path | None, topic: bool, per_file: bool) -> tuple[list[Any], str]:
    from schemas import DocumentRef

    if topic:
        return _backlog_documents(settings), f"the backlog of {settings.topics.documents}"
    if source is None:
        raise typer.BadParameter("give a folder, a manifest file, or --topic")
    source = source.resolve()
    if source.is_file():
        from producers.items import with_pdf_pages
        from producers.manifest import read_manifest

        # A local PDF as its pages, as the producer publishes it (a remote one stays one image of unknown size).
        documents = with_pdf_pages(read_manifest(source), settings.decode.max_pdf_pages)
        return [d for d in documents if isinstance(d, DocumentRef)], str(source)
    if source.is_dir():
        from producers.folder import scan_folder

        documents = scan_folder(source, per_file=per_file, max_pdf_pages=settings.decode.max_pdf_pages)
        return [d for d in documents if isinstance(d, DocumentRef)], str(source)
    raise typer.BadParameter(f"{source} is not a folder or a manifest file")


def _backlog_documents(settings: Any, within_s: float = 60.0) -> list[Any]:
    """The documents the decode group has not committed past (read without a group)."""
    from schemas import DocumentRef, SchemaError
    from vlmstream.cli.backlog import _lag
    from vlmstream.kafka.clients import make_admin, make_consumer
    from vlmstream.kafka.records import poll_past_unreadable

    admin = make_admin(settings)
    try:
        spans = _lag(admin, settings.decode.group_id, settings.topics.documents)
    finally:
        admin.close()
    docs: list[Any] = []
    if not spans:
        return docs
    consumer = make_consumer(settings, None)
    try:
        consumer.assign(list(spans))
        for tp, (start, _end) in spans.items():
            consumer.seek(tp, start)
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for tp, records in poll_past_unreadable(consumer, timeout_ms=300).items():
                for record in records:
                    if record.offset < spans[tp][1]:
                        try:
                            docs.append(DocumentRef.decode(record.value))
                        except SchemaError:
                            pass
            if all(consumer.position(tp) >= end for tp, (_s, end) in spans.items()):
                break
    finally:
        consumer.close()
    return docs
