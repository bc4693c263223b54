"""The job `vlmstream estimate` predicts, seen without fetching an image: its documents (a folder, a manifest or the
documents topic's backlog), each local image's size from its file header (Pillow reads no pixels), the size the
model takes it at (the family's resize rule and the budget), hence its size class; and the sample drawn from it.
A manifest's PDFs named by URL are the exception: a few are fetched to count their pages (``count_remote_pdfs``),
as are those of the sample's documents (``settle_sample_pdfs``); the others' pages are assumed."""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import typer

from producers.items import is_remote_pdf, pdf_page_uris

# Images per document, the strata's edges: 1, 2-3, 4-7, 8-15, 16-31, 32+.
_IPD_EDGES = (1, 2, 4, 8, 16, 32)
SIZE_HEADERS_WITHIN_S = 20.0
# A manifest's PDFs named by URL fetched to count their pages before the sample is drawn (spread over the job), and
# the time spent on them; the others' pages are assumed from these until the sample fetches its own.
REMOTE_PDFS_COUNTED = 8
REMOTE_PDFS_WITHIN_S = 20.0


@dataclass
class JobImage:
    uri: str
    size_class: str
    source_px: int | None
    effective_px: int | None
    assumed: bool = False  # a page of a remote PDF whose pages were not counted: there may be more or fewer


@dataclass
class RemotePdfs:
    """A manifest's PDFs named by URL (http(s), fsspec): the page URIs of those fetched and counted (one URI, the PDF
    as it is, where it could not be fetched or read or has too many pages: the producer leaves those so), and the
    pages assumed for each of the others: the mean of those counted."""

    pages: dict[str, list[str]] = field(default_factory=dict)
    assumed_pages: int = 1

    def readable(self) -> list[int]:
        """Pages of each counted PDF that could be read: what the assumption rests on."""
        return [len(uris) for pdf, uris in self.pages.items() if uris != [pdf]]


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
    remote_pdfs: RemotePdfs | None = None

    def assumed_pdfs(self) -> tuple[int, int]:
        """(remote PDFs whose pages are assumed, the images the job counts for them)."""
        pages = [im.uri for d in self.documents for im in d.images if im.assumed]
        return sum(uri.endswith("#page=1") for uri in pages), len(pages)

    def images_range(self) -> tuple[int, int] | None:
        """The fewest and most images the job may hold: each PDF whose pages are assumed at the fewest and the most
        pages of those counted (None: nothing assumed)."""
        pdfs, images = self.assumed_pdfs()
        counted = self.remote_pdfs.readable() if self.remote_pdfs is not None else []
        if not pdfs or not counted:
            return None
        rest = self.images - images
        return rest + pdfs * min(counted), rest + pdfs * max(counted)

    def pdfs_said(self) -> str | None:
        """What the job's count of remote PDFs' pages rests on, for the estimate's assumptions."""
        remote = self.remote_pdfs
        if remote is None or not remote.pages:
            return None
        pdfs, images = self.assumed_pdfs()
        counted = remote.readable()
        said = (f"{len(remote.pages)} remote PDF(s) fetched and their pages counted"
                + (f" ({len(remote.pages) - len(counted)} could not be read or had too many pages: one image each, "
                   "as the producer leaves them)" if len(counted) < len(remote.pages) else ""))
        if not pdfs:
            return said
        span = self.images_range()
        return (f"{said}; {pdfs} remote PDF(s) not fetched: their pages assumed, {remote.assumed_pages} each "
                + (f"(the mean of those counted, which held {min(counted)}-{max(counted)}; the range covers "
                   f"{min(counted)} to {max(counted)} each: {span[0]}-{span[1]} images in the job)"
                   if span else "(none could be counted: nothing to widen the range by)")
                + f", {images} of the job's images")

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
               within_s: float = SIZE_HEADERS_WITHIN_S, pdf_dpi: float = 200.0,
               remote_pdfs: RemotePdfs | None = None) -> JobShape:
    """Each document's images with their size class, from file headers only (a PDF page's from its page tree, at
    ``pdf_dpi``); past within_s (or for remote and unreadable images) the size is unknown ('?'). ``remote_pdfs``:
    what ``count_remote_pdfs`` counted, to mark the pages it assumed."""
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
                images.append(JobImage(uri, size_class(None, None), None, None,
                                       assumed=remote_pdfs is not None and _assumed_page(uri, remote_pdfs)))
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
    return JobShape(out, unseen, remote_pdfs)


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


def _assumed_page(uri: str, remote: RemotePdfs) -> bool:
    pdf, _, page = uri.rpartition("#page=")
    return bool(pdf) and page.isdigit() and pdf not in remote.pages and is_remote_pdf(pdf)


def count_remote_pdfs(documents: list[Any], decode: Any, *, count: int = REMOTE_PDFS_COUNTED,
                      within_s: float = REMOTE_PDFS_WITHIN_S) -> tuple[list[Any], RemotePdfs]:
    """The documents with each PDF named by URL as its pages, as the producer publishes them: up to ``count`` such
    PDFs, spread evenly over the job, fetched with the decode stage's rules and size cap (``decode``: its settings)
    and counted within ``within_s``; each of the others as the mean of those pages (``RemotePdfs.assumed_pages``),
    ``#page=1`` to ``#page=N``, for ``read_shape`` to mark as assumed."""
    remote = list(dict.fromkeys(uri for d in documents for uri in d.image_uris if is_remote_pdf(uri)))
    counted = RemotePdfs()
    if not remote:
        return documents, counted
    picks = (remote if len(remote) <= count else remote[:count] if count < 2
             else [remote[round(i * (len(remote) - 1) / (count - 1))] for i in range(count)])
    deadline = time.monotonic() + within_s
    _fetch_and_count(picks, counted, decode, deadline)
    readable = counted.readable()
    counted.assumed_pages = max(1, round(statistics.fmean(readable))) if readable else 1
    return [_with_pages(d, counted) for d in documents], counted


def settle_sample_pdfs(shape: JobShape, sample: list[JobDocument], decode: Any) -> None:
    """The sample runs what the job will publish, so the remote PDFs of its documents whose pages were assumed are
    fetched and counted here; every document of the job naming one of them (the sample's among them) gets its
    pages, as remote images of unknown size."""
    from vlmstream.projection.sample import size_class

    remote = shape.remote_pdfs
    if remote is None:
        return
    wanted = list(dict.fromkeys(im.uri.rpartition("#page=")[0] for d in sample for im in d.images if im.assumed))
    if not wanted:
        return
    _fetch_and_count(wanted, remote, decode, None)
    for job_doc in shape.documents:
        if not any(im.assumed and im.uri.rpartition("#page=")[0] in remote.pages for im in job_doc.images):
            continue
        images = []
        for im in job_doc.images:
            pdf, _, page = im.uri.rpartition("#page=")
            if not (im.assumed and pdf in remote.pages):
                images.append(im)
            elif page == "1":
                images.extend(JobImage(uri, size_class(None, None), None, None) for uri in remote.pages[pdf])
        job_doc.images = images
        job_doc.doc = replace(job_doc.doc, image_uris=tuple(im.uri for im in images))


def _fetch_and_count(pdfs: list[str], remote: RemotePdfs, decode: Any, deadline: float | None) -> None:
    from vlmstream.images.fetch import Fetcher

    fetcher = Fetcher.from_settings(decode)
    try:
        for pdf in pdfs:
            if deadline is not None and time.monotonic() > deadline:
                break
            if pdf not in remote.pages:
                remote.pages[pdf] = pdf_page_uris(pdf, decode.max_pdf_pages, fetcher.fetch)
    finally:
        fetcher.close()


def _with_pages(doc: Any, remote: RemotePdfs) -> Any:
    if not any(is_remote_pdf(uri) for uri in doc.image_uris):
        return doc
    uris = tuple(page for uri in doc.image_uris for page in (
        remote.pages.get(uri) or [f"{uri}#page={n}" for n in range(1, remote.assumed_pages + 1)]
        if is_remote_pdf(uri) else [uri]))
    return replace(doc, image_uris=uris)


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

        # A local PDF as its pages, as the producer publishes it (a remote one: count_remote_pdfs).
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
