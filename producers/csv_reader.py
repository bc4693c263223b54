"""A CSV or TSV manifest's rows as documents. Columns doc_id and image_uri (one row per image) and/or image_uris
(a JSON list or a ';'-separated list); consecutive rows with the same doc_id form one document. Reads an open
text stream: ``producers.manifest`` opens the file (gzip, encodings)."""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, NamedTuple

import orjson

from producers.items import Rejection, resolve_uri, validated
from schemas import DocumentRef, SchemaError

# Header names matched whatever their case; other columns keep theirs (they become metadata keys).
_CANONICAL_COLUMNS = {"doc_id": "doc_id", "image_uri": "image_uri", "image_uris": "image_uris"}
# A document with thousands of images in one image_uris cell is legal; csv's default limit is 128 KiB per cell.
csv.field_size_limit(2**31 - 1)
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


class RowError(NamedTuple):
    """Why a document's rows cannot be published, and the line that said so."""

    reason: str
    detail: str
    line: int


@dataclass(slots=True)
class CsvDocument:
    """The consecutive rows of one document read so far. One bad row rejects the whole document: publishing it
    without that image would change it without anyone noticing."""

    doc_id: str
    line: int  # its first row
    metadata: dict[str, str]
    images: list[str] = field(default_factory=list)
    rows: list[bytes] = field(default_factory=list)  # each row's text, for the rejection
    error: RowError | None = None

    def fail(self, reason: str, detail: str, line: int) -> None:
        """Reject the document; the first reason among its rows is the one reported."""
        if self.error is None:
            self.error = RowError(reason, detail, line)

    def close(self, origin: str) -> DocumentRef | Rejection:
        raw = b"\n".join(self.rows)
        if self.error is not None:
            return Rejection(origin, self.error.line, self.error.reason, self.error.detail, raw, self.doc_id)
        try:
            return validated(DocumentRef(doc_id=self.doc_id, image_uris=tuple(self.images), metadata=self.metadata,
                                         source=f"{origin}:{self.line}"))
        except SchemaError as exc:
            return Rejection(origin, self.line, "schema_violation", str(exc), raw, self.doc_id)


def _split_uri_list(cell: str) -> list[str]:
    cell = cell.strip()
    if not cell:
        return []
    if cell.startswith("["):
        parsed = orjson.loads(cell)
        if not isinstance(parsed, list) or not all(isinstance(u, str) for u in parsed):
            raise ValueError("image_uris must be a JSON list of strings")
        return [u.strip() for u in parsed if u.strip()]
    return [u.strip() for u in cell.split(";") if u.strip()]


def _row_text(row: list[str]) -> bytes:
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow(row)
    return out.getvalue().encode("utf-8", "surrogateescape")  # a non-UTF-8 row keeps its original bytes


def _csv_delimiter(fh: IO[str]) -> str:
    """The delimiter that splits the header into a doc_id column: ',' (the default), tab, ';' (spreadsheets in
    locales with a decimal comma) or '|'. The file is left at its start."""
    start = fh.tell()
    first = fh.readline()
    fh.seek(start)
    for delimiter in (",", "\t", ";", "|"):
        names = next(csv.reader([first], delimiter=delimiter), [])
        if "doc_id" in (n.strip().lower() for n in names):
            return delimiter
    return ","


def csv_documents(fh: IO[str], *, origin: str, base_dir: str | Path) -> Iterator[DocumentRef | Rejection]:
    """The documents of a CSV text stream opened with ``newline=""``. A document's other columns (its first row's
    non-empty values) become metadata. A row that is not UTF-8 (read with surrogateescape) is rejected alone."""
    # strict: a quote never closed is an error, not a cell that swallows the rest of the file.
    reader = csv.reader(fh, delimiter=_csv_delimiter(fh), strict=True)
    try:
        header = next(reader, None)
    except csv.Error as exc:
        yield Rejection(origin, 1, "invalid_csv_header", f"the header cannot be read: {exc}", b"")
        return
    if header is None:
        return
    columns = [_CANONICAL_COLUMNS.get(c.strip().lower(), c.strip()) for c in header]
    if "doc_id" not in columns or not ({"image_uri", "image_uris"} & set(columns)):
        yield Rejection(origin, 1, "invalid_csv_header",
                        f"the header must name doc_id and image_uri or image_uris; it has {columns}",
                        _row_text(header))
        return
    if twice := sorted({c for c in columns if c and columns.count(c) > 1}):
        yield Rejection(origin, 1, "invalid_csv_header", f"the header names {twice} more than once (one of "
                        "each would be lost)", _row_text(header))
        return
    meta_columns = [c for c in columns if c not in ("doc_id", "image_uri", "image_uris")]
    first_line: dict[str, int] = {}  # doc_id -> the line its rows started at
    document: CsvDocument | None = None
    line_end = reader.line_num
    while True:
        try:
            row = next(reader, None)
        except csv.Error as exc:
            # Where a broken row ends, and so which document it belongs to, is unknowable: the document being
            # read and the rest of the file are rejected, each said so, rather than published without it.
            unread = (f"line {line_end + 1}: {exc}; the manifest is not read past it (fix the row, then run "
                      "again: documents already published are skipped)")
            if document is not None:
                document.fail("invalid_csv_row", f"the next row cannot be read and may be one of this document's: "
                              f"{unread}", line_end + 1)
                yield document.close(origin)
            yield Rejection(origin, line_end + 1, "invalid_csv_row", unread, b"")
            return
        if row is None:
            break
        line_start, line_end = line_end + 1, reader.line_num
        if not any(cell.strip() for cell in row):
            continue
        cells = dict(zip(columns, row))
        raw = _row_text(row)
        surplus = [cell for cell in row[len(columns):] if cell.strip()]
        not_utf8 = any(_NOT_UTF8.search(cell) for cell in row)
        doc_id = (cells.get("doc_id") or "").strip()
        if not_utf8 and (not doc_id or _NOT_UTF8.search(doc_id)):
            yield Rejection(origin, line_start, "invalid_utf8", "the row is not UTF-8 text (save the manifest "
                            "as UTF-8)", raw)
            continue
        if not doc_id:
            yield Rejection(origin, line_start, "missing_doc_id", "doc_id is empty", raw)
            continue
        if document is None or document.doc_id != doc_id:
            if document is not None:
                yield document.close(origin)
            document = CsvDocument(doc_id, line_start,
                                   {c: cells[c] for c in meta_columns if cells.get(c, "").strip()})
            if doc_id in first_line:
                document.fail("duplicate_doc_id", f"rows of document {doc_id!r} must be consecutive; it already "
                              f"appeared at line {first_line[doc_id]}", line_start)
            else:
                first_line[doc_id] = line_start
        document.rows.append(raw)
        if not_utf8:
            document.fail("invalid_utf8", "a row of the document is not UTF-8 text (save the manifest as UTF-8)",
                          line_start)
            continue
        if surplus:
            # An unquoted delimiter inside a cell (a data: URI, a name with a comma): which cell is which is lost.
            document.fail("invalid_csv_row", f"the row has {len(row)} cells, the header names {len(columns)}: "
                          "quote a cell that holds the delimiter", line_start)
            continue
        single = (cells.get("image_uri") or "").strip()
        try:
            images = _split_uri_list(cells.get("image_uris", ""))
        except ValueError as exc:
            document.fail("invalid_image_list", str(exc), line_start)
            continue
        images += [single] if single else []
        if not images:
            document.fail("empty_image_list", "the row names no image", line_start)
        document.images.extend(resolve_uri(u, base_dir) for u in images)
    if document is not None:
        yield document.close(origin)
