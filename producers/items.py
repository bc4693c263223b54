"""What every source yields, and the small parts all sources share. Sources are pure input parsing, no Kafka:
each yields ``DocumentRef`` (already validated against the document schema), ``Rejection`` (a bad input line,
with its line number and raw text) or ``IDLE`` (nothing new right now: the publisher uses the pause to settle
acknowledgements).

Image validity is not decided by any source; a folder source only picks files whose extension looks like an
image, and the decode stage dead-letters what does not decode.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Union
from urllib.parse import unquote, urlsplit

from schemas import DocumentRef, SchemaError

BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark, as Windows editors and PowerShell pipes write
# A scheme of two or more letters (one letter is a Windows drive: C:\\scan.jpg): http://, s3://, file:, data:, urn:...
# The decode stage decides which it fetches and dead-letters the rest by name; a path it must not become.
_URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")
_DIGITS = re.compile(r"(\d+)")


class _Idle:
    def __repr__(self) -> str:
        return "IDLE"


IDLE = _Idle()


@dataclass(frozen=True)
class Rejection:
    """An input line that cannot become a document. ``reason`` is a stable code, ``detail`` the why."""

    origin: str
    line: int | None
    reason: str
    detail: str
    raw: bytes
    doc_id: str | None = None

    def where(self) -> str:
        return f"{self.origin}:{self.line}" if self.line is not None else self.origin


SourceItem = Union[DocumentRef, Rejection, _Idle]


def natural_key(text: str) -> tuple:
    """'page2' sorts before 'page10'."""
    # isdecimal, not isdigit: '²' is a digit to isdigit but not a number to int().
    return tuple(int(part) if part.isdecimal() else part.lower() for part in _DIGITS.split(text))


def resolve_uri(uri: str, base_dir: str | Path) -> str:
    """URLs pass through; local paths become absolute, relative ones against ``base_dir``. Spaces around the text
    are a manifest's, not the file's. Plain string operations: this runs for every image of every manifest line."""
    uri = uri.strip()
    if ":" in uri and _URI_SCHEME.match(uri):
        return uri
    if uri.startswith("~"):
        uri = os.path.expanduser(uri)
    return os.path.normpath(os.path.join(base_dir, uri))


def replace_non_utf8(name: Path | str) -> str:
    """A name as text any record can hold: the stray bytes of a name that is not UTF-8 (a Latin-1 file name) show
    as U+FFFD. Used for a document's ``source`` and for what a rejection says."""
    return os.fsencode(name).decode("utf-8", "replace")


def validated(doc: DocumentRef) -> DocumentRef:
    """Raises SchemaError naming the field; the publisher then encodes without validating again."""
    doc.encode()
    return doc


def _is_local(uri: str) -> bool:
    return uri.startswith("file://") or not (":" in uri and _URI_SCHEME.match(uri))


def is_remote_pdf(uri: str) -> bool:
    """A PDF named by an http(s) or fsspec URL without ``#page=N``: one whose pages only fetching it can count."""
    return ("#page=" not in uri and not _is_local(uri)
            and unquote(urlsplit(uri).path).lower().endswith(".pdf"))


def pdf_page_uris(uri: str, max_pdf_pages: int, read: Callable[[str], bytes] | None = None) -> list[str]:
    """A PDF named without ``#page=N`` as one URI per page, its pages counted from its page tree (nothing
    rendered): a local one (a path or a ``file://`` URI) read here, a remote one (``http(s)://``, an fsspec URL)
    fetched through ``read`` (the fetcher decode reads images with, ``vlmstream/images/fetch.py``, with its host
    rules and size cap); without ``read`` a remote PDF stays as it is (the decode stage describes its first page and
    notes the others). Anything else stays as it is, and so does a PDF that cannot be read or fetched (the decode
    stage names what is wrong) and one of more than ``max_pdf_pages`` pages (decode.max_pdf_pages: the decode
    stage's dead letter names it)."""
    if "#page=" in uri:
        return [uri]
    local = _is_local(uri)
    path = uri if local and not uri.startswith("file://") else unquote(urlsplit(uri).path)
    if not path.lower().endswith(".pdf") or (not local and read is None):
        return [uri]
    from vlmstream.images import pdf  # only documents naming PDFs pay for PDFium

    try:
        pages = pdf.count_pages(path if local else read(uri))
    except Exception:  # noqa: BLE001 - any failure is the decode stage's to name
        return [uri]
    return [uri] if not 1 <= pages <= max_pdf_pages else [f"{uri}#page={n}" for n in range(1, pages + 1)]


def with_pdf_pages(items: Iterable[Any], max_pdf_pages: int,
                   read: Callable[[str], bytes] | None = None) -> Iterator[Any]:
    """Each document of ``items`` with its PDFs as one image per page (``pdf_page_uris``; ``read`` fetches remote
    ones); anything else as it is. A document the page URIs make too long for the schema becomes a rejection."""
    for item in items:
        if not isinstance(item, DocumentRef) or not any(".pdf" in uri.lower() for uri in item.image_uris):
            yield item
            continue
        uris = tuple(page for uri in item.image_uris for page in pdf_page_uris(uri, max_pdf_pages, read))
        try:
            yield item if uris == item.image_uris else validated(replace(item, image_uris=uris))
        except SchemaError as exc:
            yield Rejection(item.source or "manifest", None, "schema_violation", f"with each PDF page: {exc}",
                            item.doc_id.encode("utf-8", "surrogateescape"), item.doc_id)


def with_id_prefix(items: Iterable[Any], prefix: str) -> Iterator[Any]:
    """Each document of ``items`` with ``prefix`` before its id; anything else as it is. For sources whose ids repeat
    across inputs (a folder's ids are paths relative to it, so two folders of IMG_0001.JPG share ids), which on
    the compacted results topic would replace each other's results. A prefixed id the schema refuses becomes a
    rejection naming the setting."""
    for item in items:
        if not prefix or not isinstance(item, DocumentRef):
            yield item
            continue
        try:
            yield validated(replace(item, doc_id=prefix + item.doc_id))
        except SchemaError as exc:
            yield Rejection(item.source or "--id-prefix", None, "schema_violation",
                            f"with --id-prefix: {exc}",
                            (prefix + item.doc_id).encode("utf-8", "surrogateescape"), item.doc_id)

