"""Where documents come from: manifests (JSONL, JSON, CSV/TSV), folders of images, stdin, and watched folders or
manifests. Pure input parsing, no Kafka: every source yields ``DocumentRef`` (already validated against
the document schema), ``Rejection`` (a bad input line, with its line number and raw text) or ``IDLE``
(nothing new right now: the publisher uses the pause to settle acknowledgements).

Image validity is not decided here; a folder source only picks files whose extension looks like an
image, and the decode stage dead-letters what does not decode.
"""

from __future__ import annotations

import csv
import gzip
import io
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator, Union

import orjson

from schemas import DocumentRef, SchemaError
from schemas.messages import loads_exact

# What a folder source picks up: every format the decode stage reads (it decides by content, not by name).
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif", ".tif", ".tiff", ".bmp", ".jp2", ".j2k",
                              ".jpf", ".jpx", ".heic", ".heif", ".avif", ".pbm", ".pgm", ".ppm", ".pnm", ".qoi"})
_BOM = b"\xef\xbb\xbf"
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


def printable(text: Path | str) -> str:
    """A name as text any record can hold: the stray bytes of a name that is not UTF-8 (a Latin-1 file name) show
    as U+FFFD. Used for a document's ``source`` and for what a rejection says."""
    return os.fsencode(text).decode("utf-8", "replace")


def validated(doc: DocumentRef) -> DocumentRef:
    """Raises SchemaError naming the field; the publisher then encodes without validating again."""
    doc.encode()
    return doc


# --- JSON lines ----------------------------------------------------------------------------------

_KNOWN_KEYS = {"doc_id", "image_uris", "images", "metadata", "source", "schema_version", "published_at"}


def parse_json_line(raw: bytes, *, line: int, origin: str, base_dir: str | Path) -> DocumentRef | Rejection:
    """One manifest line: {"doc_id": ..., "image_uris"|"images": [...], "metadata": {...}}.

    Other top-level keys join the metadata (like a CSV manifest's extra columns); an explicit
    "metadata" object wins on a clash.
    """
    try:
        data = loads_exact(raw.removeprefix(_BOM))  # a UTF-8 byte-order mark, as Windows editors write
    except ValueError as exc:  # orjson's JSONDecodeError is one
        return Rejection(origin, line, "invalid_json", f"not valid JSON: {exc}", raw)
    return parse_document_object(data, raw, line=line, origin=origin, base_dir=base_dir)


def parse_document_object(data: Any, raw: bytes, *, line: int, origin: str,
                          base_dir: str | Path) -> DocumentRef | Rejection:
    """A parsed JSON value that should be a document (a manifest line, or an element of a JSON manifest's list)."""

    def reject(reason: str, detail: str, doc_id: Any = None) -> Rejection:
        return Rejection(origin, line, reason, detail, raw, doc_id if isinstance(doc_id, str) else None)

    if not isinstance(data, dict):
        return reject("not_an_object", f"expected a JSON object, got {type(data).__name__}")
    if data.get("schema_version", 1) != 1 or isinstance(data.get("schema_version"), bool):
        # A line written for another version of the document schema: publishing it as version 1 would hide that.
        return reject("schema_violation", f"schema_version {data.get('schema_version')!r}: this producer writes "
                      "version 1", data.get("doc_id"))
    doc_id = data.get("doc_id")
    if isinstance(doc_id, int) and not isinstance(doc_id, bool):
        doc_id = str(doc_id)  # numeric ids, as databases export them; their text is the id
    if doc_id is None or doc_id == "":
        return reject("missing_doc_id", "doc_id is missing or empty")
    if "image_uris" in data and "images" in data:
        return reject("ambiguous_images", "both image_uris and images are set; use one", doc_id)
    images = data.get("image_uris", data.get("images"))
    if isinstance(images, str) and images:
        images = [images]  # one image named without a list
    if images is None or images == []:
        return reject("empty_image_list", "image_uris (or images) is missing or empty", doc_id)
    if not isinstance(images, list):
        field = "image_uris" if "image_uris" in data else "images"
        return reject("schema_violation", f"document: {field}: must be a list of strings, "
                      f"got {type(images).__name__}", doc_id)
    images = tuple(resolve_uri(u, base_dir) if isinstance(u, str) and u else u for u in images)
    metadata = data.get("metadata", {})
    extra = {k: v for k, v in data.items() if k not in _KNOWN_KEYS}
    if extra and isinstance(metadata, dict):
        metadata = {**extra, **metadata}
    try:
        return validated(DocumentRef(doc_id=doc_id, image_uris=images, metadata=metadata,
                                     source=f"{origin}:{line}"))
    except SchemaError as exc:
        return reject("schema_violation", str(exc), doc_id)


def read_json_document_list(path: str | Path) -> Iterator[DocumentRef | Rejection]:
    """A .json manifest: a list of document objects, {"documents": [...]}, or one document object. Read whole:
    JSON lines suit manifests too large for memory."""
    path = Path(path).absolute()
    base_dir, origin = str(path.parent), printable(path)
    with _open_manifest(path) as fh:
        raw = fh.read()
    try:
        data = loads_exact(raw.removeprefix(_BOM))
    except ValueError as exc:
        yield Rejection(origin, None, "invalid_json", f"not valid JSON: {exc}", raw[:4096])
        return
    items = data.get("documents") if isinstance(data, dict) and isinstance(data.get("documents"), list) else data
    for index, item in enumerate(items if isinstance(items, list) else [items], start=1):
        yield parse_document_object(item, _json_bytes(item), line=index, origin=origin, base_dir=base_dir)


def _json_bytes(item: Any) -> bytes:
    """The element's own text for its dead letter; one too deep for orjson to write again gets a cut repr."""
    try:
        return orjson.dumps(item)
    except TypeError:
        return repr(item)[:4096].encode("utf-8", "surrogateescape")


def read_jsonl(path: str | Path) -> Iterator[DocumentRef | Rejection]:
    path = Path(path).absolute()
    base_dir, origin = str(path.parent), printable(path)
    with _open_manifest(path) as fh:
        for line_no, raw in enumerate(fh, start=1):
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield parse_json_line(raw, line=line_no, origin=origin, base_dir=base_dir)


# --- CSV -----------------------------------------------------------------------------------------


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


# Header names matched whatever their case; other columns keep theirs (they become metadata keys).
_CANONICAL_COLUMNS = {"doc_id": "doc_id", "image_uri": "image_uri", "image_uris": "image_uris"}
# A document with thousands of images in one image_uris cell is legal; csv's default limit is 128 KiB per cell.
csv.field_size_limit(2**31 - 1)
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


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


def read_csv(path: str | Path) -> Iterator[DocumentRef | Rejection]:
    """Columns doc_id and image_uri (one row per image) and/or image_uris (a JSON list or a
    ';'-separated list). Consecutive rows with the same doc_id form one document; its other columns
    (first row's non-empty values) become metadata. One bad row rejects its whole document: publishing
    the document without that image would change it without anyone noticing.
    """
    path = Path(path).absolute()
    base_dir, origin = str(path.parent), printable(path)
    # surrogateescape: a row that is not UTF-8 (a spreadsheet's Latin-1 export) is rejected alone, not the file.
    with io.TextIOWrapper(_open_manifest(path), newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
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
        seen: dict[str, int] = {}
        group: dict[str, Any] | None = None

        def close(group: dict[str, Any]) -> DocumentRef | Rejection:
            raw = b"\n".join(group["raw"])
            if group["error"]:
                reason, detail, line = group["error"]
                return Rejection(origin, line, reason, detail, raw, group["doc_id"])
            try:
                return validated(DocumentRef(doc_id=group["doc_id"], image_uris=tuple(group["images"]),
                                             metadata=group["metadata"], source=f"{origin}:{group['line']}"))
            except SchemaError as exc:
                return Rejection(origin, group["line"], "schema_violation", str(exc), raw, group["doc_id"])

        line_end = reader.line_num
        while True:
            try:
                row = next(reader, None)
            except csv.Error as exc:
                # Where a broken row ends, and so which document it belongs to, is unknowable: the document being
                # read and the rest of the file are rejected, each said so, rather than published without it.
                unread = (f"line {line_end + 1}: {exc}; the manifest is not read past it (fix the row, then run "
                          "again: documents already published are skipped)")
                if group is not None:
                    group["error"] = group["error"] or (
                        "invalid_csv_row", f"the next row cannot be read and may be one of this document's: {unread}",
                        line_end + 1)
                    yield close(group)
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
            if group is None or group["doc_id"] != doc_id:
                if group is not None:
                    yield close(group)
                group = {"doc_id": doc_id, "line": line_start, "images": [], "raw": [], "error": None,
                         "metadata": {c: cells[c] for c in meta_columns if cells.get(c, "").strip()}}
                if doc_id in seen:
                    group["error"] = ("duplicate_doc_id", f"rows of document {doc_id!r} must be consecutive; "
                                      f"it already appeared at line {seen[doc_id]}", line_start)
                else:
                    seen[doc_id] = line_start
            group["raw"].append(raw)
            if not_utf8:
                group["error"] = group["error"] or ("invalid_utf8", "a row of the document is not UTF-8 text (save the "
                                                    "manifest as UTF-8)", line_start)
                continue
            if surplus:
                # An unquoted delimiter inside a cell (a data: URI, a name with a comma): which cell is which is lost.
                group["error"] = group["error"] or (
                    "invalid_csv_row", f"the row has {len(row)} cells, the header names {len(columns)}: quote a cell "
                    f"that holds the delimiter", line_start)
                continue
            single = (cells.get("image_uri") or "").strip()
            try:
                images = _split_uri_list(cells.get("image_uris", ""))
            except ValueError as exc:
                group["error"] = group["error"] or ("invalid_image_list", str(exc), line_start)
                continue
            images += [single] if single else []
            if not images:
                group["error"] = group["error"] or ("empty_image_list", "the row names no image", line_start)
            group["images"].extend(resolve_uri(u, base_dir) for u in images)
        if group is not None:
            yield close(group)


_GZIP_MAGIC = b"\x1f\x8b"
_WIDE_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
              b"\xfe\xff": "UTF-16"}


def _open_manifest(path: Path) -> IO[bytes]:
    """The manifest's bytes, gunzipped when they are gzip (known by content: .jsonl.gz, .csv.gz or any name)."""
    with open(path, "rb") as fh:
        gzipped = fh.read(2) == _GZIP_MAGIC
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def _wide_encoding(path: Path) -> str | None:
    with _open_manifest(path) as fh:
        head = fh.read(4)
    return next((name for bom, name in _WIDE_BOMS.items() if head.startswith(bom)), None)


def read_manifest(path: str | Path) -> Iterator[DocumentRef | Rejection]:
    """CSV by a .csv or .tsv suffix (delimiter from the header), one JSON document list by .json, JSON lines
    otherwise; each may be gzipped (.gz after the suffix). UTF-8 text: a UTF-16 file (Windows' "Unicode") is
    rejected whole, by name, rather than line by line as invalid JSON."""
    path = Path(path)
    if encoding := _wide_encoding(path):
        return iter([Rejection(printable(path.absolute()), None, "unsupported_encoding",
                               f"the manifest is {encoding} text; save it as UTF-8", b"")])
    name = path.name.lower().removesuffix(".gz")
    suffix = os.path.splitext(name)[1]
    if suffix in (".csv", ".tsv"):
        return read_csv(path)
    if suffix == ".json":
        return read_json_document_list(path)
    return read_jsonl(path)


# --- stdin ---------------------------------------------------------------------------------------


def parse_stdin_line(raw: bytes, *, line: int, base_dir: str | Path, origin: str = "stdin") -> DocumentRef | Rejection:
    """A JSON object like a manifest line, or a bare path/URI: one image, one document, id = the text."""
    text = raw.strip().removeprefix(_BOM)  # PowerShell pipes start with one
    if text.startswith(b"{"):
        return parse_json_line(text, line=line, origin=origin, base_dir=base_dir)
    if text.startswith(b"["):
        try:
            orjson.loads(text)
        except orjson.JSONDecodeError:
            pass  # a path that starts with '[': "[scan] page 1.jpg"
        else:
            return Rejection(origin, line, "not_an_object", "a JSON array: give one document object per line, or a "
                             "bare path", raw)
    try:
        uri = text.decode()
    except UnicodeDecodeError as exc:
        return Rejection(origin, line, "invalid_utf8", str(exc), raw)
    try:
        return validated(DocumentRef(doc_id=uri, image_uris=(resolve_uri(uri, base_dir),),
                                     source=f"{origin}:{line}"))
    except SchemaError as exc:
        return Rejection(origin, line, "schema_violation", str(exc), raw, uri)


def read_lines(stream: IO[bytes], *, base_dir: Path | None = None, idle_s: float = 1.0,
               stop: threading.Event | None = None) -> Iterator[SourceItem]:
    """Lines of a (possibly never-ending) byte stream such as stdin.

    A reader thread feeds a queue so the publisher hears IDLE while the stream is quiet and can
    settle acknowledgements (and notice ``stop``) instead of blocking inside readline.
    """
    base_dir = base_dir or Path.cwd()
    lines: queue.Queue[bytes | None] = queue.Queue(maxsize=10_000)

    def pump() -> None:
        try:
            for raw in stream:
                lines.put(raw)
        finally:
            lines.put(None)

    threading.Thread(target=pump, name="vlmstream-stdin", daemon=True).start()
    line_no = 0
    quiet_for = 0.05  # a short pause ends a burst: the lines so far go out without waiting for more
    while not (stop and stop.is_set()):
        try:
            raw = lines.get(timeout=quiet_for)
        except queue.Empty:
            yield IDLE
            quiet_for = idle_s
            continue
        quiet_for = 0.05
        if raw is None:
            return
        line_no += 1
        if raw.strip():
            yield parse_stdin_line(raw.rstrip(b"\r\n"), line=line_no, base_dir=base_dir)


# --- folders -------------------------------------------------------------------------------------


def _image_files(root: Path, *, recursive: bool, unreadable: list[OSError] | None = None) -> list[Path]:
    """Image files below root. A folder that cannot be listed is added to ``unreadable`` (os.walk would skip it
    without a word, and its document would go out without its images)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=None if unreadable is None else unreadable.append):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")] if recursive else []
        found.extend(Path(dirpath, f) for f in filenames
                     if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS)
    return found


def folder_groups(root: str | Path, *, per_file: bool = False) -> dict[str, list[Path] | OSError]:
    """doc_id -> image files, in natural order, or the error that kept a folder of it from being listed.

    Default: each subfolder of ``root`` (images found recursively) is one document and each image file
    directly in ``root`` is a document of its own, so a folder without subfolders is per-file already.
    ``per_file``: every image file anywhere below ``root`` is one document. Ids are relative paths; a folder
    that cannot be listed is reported under its own.
    """
    root = Path(root).absolute()
    groups: dict[str, list[Path] | OSError] = {}
    if per_file:
        unreadable: list[OSError] = []
        for path in _image_files(root, recursive=True, unreadable=unreadable):
            groups[path.relative_to(root).as_posix()] = [path]
        for error in unreadable:
            groups[Path(error.filename).relative_to(root).as_posix() + "/"] = error
    else:
        for entry in os.scandir(root):
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                unreadable = []
                files = _image_files(Path(entry.path), recursive=True, unreadable=unreadable)
                if unreadable:
                    groups[entry.name] = unreadable[0]
                elif files:
                    groups[entry.name] = files
            elif os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS:
                groups[entry.name] = [Path(entry.path)]
    for doc_id, files in groups.items():
        if isinstance(files, list):
            files.sort(key=lambda p: natural_key(p.relative_to(root).as_posix()))
    return dict(sorted(groups.items(), key=lambda kv: natural_key(kv[0])))


def page_uris(path: Path) -> list[str]:
    """A multi-page TIFF (scans, faxes) as one URI per page, ``path#page=N``, so that every page is described;
    any other file as itself. A TIFF that cannot be read goes as it is: the decode stage says what is wrong. So
    does one of ``MAX_PAGES`` pages or more: the decode stage describes its first and notes the rest."""
    if path.suffix.lower() not in (".tif", ".tiff"):
        return [str(path)]
    from PIL import Image  # only folders with TIFFs pay for the import

    from vlmstream.images.pages import MAX_PAGES, count_pages

    try:
        with Image.open(path) as image:
            pages = count_pages(image)  # a walk over the page directories, no pixels
    except Exception:  # noqa: BLE001 - any failure is the decode stage's to name
        return [str(path)]
    return [str(path)] if not 1 < pages < MAX_PAGES else [f"{path}#page={n}" for n in range(1, pages + 1)]


def _folder_document(root: Path, doc_id: str, files: list[Path] | OSError) -> DocumentRef | Rejection:
    if isinstance(files, OSError):
        return Rejection(f"folder:{root}", None, "unreadable_folder",
                         f"{files.filename}: {files.strerror or files}; its document is not published without "
                         "the images it may hold", doc_id.encode("utf-8", "surrogateescape"), doc_id)
    try:
        return validated(DocumentRef(doc_id=doc_id, image_uris=tuple(uri for p in files for uri in page_uris(p)),
                                     source=f"folder:{root}"))
    except SchemaError as exc:
        return Rejection(f"folder:{root}", None, "schema_violation", f"{printable(doc_id)}: {exc}",
                         doc_id.encode("utf-8", "surrogateescape"), doc_id)


def scan_folder(root: str | Path, *, per_file: bool = False) -> Iterator[DocumentRef | Rejection]:
    root = Path(root).absolute()
    for doc_id, files in folder_groups(root, per_file=per_file).items():
        yield _folder_document(root, doc_id, files)


def _stop_requested(stop: threading.Event | None, deadline: float | None, wait_s: float) -> bool:
    if deadline is not None:
        wait_s = min(wait_s, max(0.0, deadline - time.monotonic()))
    stopped = stop.wait(wait_s) if stop is not None else (time.sleep(wait_s) or False)
    return stopped or (deadline is not None and time.monotonic() >= deadline)


def _stat_or_link(path: Path) -> os.stat_result:
    """A link whose target is gone still names an image of the document: the decode stage dead-letters it as
    missing, as when a folder is scanned once. Only a path gone altogether (moved away) raises."""
    try:
        return path.stat()
    except FileNotFoundError:
        return path.lstat()


def watch_folder(root: str | Path, *, per_file: bool = False, settle_s: float = 2.0, poll_s: float = 0.5,
                 stop: threading.Event | None = None, max_seconds: float | None = None) -> Iterator[SourceItem]:
    """Follow a folder by polling: a document is published once its files (names, sizes, mtimes) have
    stayed unchanged for ``settle_s``, so a subfolder still being copied is not sent half-full.
    Documents already there at start whose newest file is older than ``settle_s`` go out at once.
    A document that changes later is yielded again (the ledger decides whether its content changed).
    """
    root = Path(root).absolute()
    deadline = time.monotonic() + max_seconds if max_seconds is not None else None
    yielded: dict[str, tuple] = {}
    changing: dict[str, tuple[tuple, float]] = {}  # doc_id -> (signature, first seen with it)
    first_scan = True
    while True:
        now_mono, now_wall = time.monotonic(), time.time()
        groups = folder_groups(root, per_file=per_file) if root.is_dir() else {}  # may appear later
        for doc_id, files in groups.items():
            if isinstance(files, OSError):  # a folder that cannot be listed: said once, again if the error changes
                signature: tuple = ("unreadable", str(files))
                if yielded.get(doc_id) != signature:
                    yielded[doc_id] = signature
                    yield _folder_document(root, doc_id, files)
                continue
            try:
                stats = [_stat_or_link(p) for p in files]
            except FileNotFoundError:
                continue  # moved away while we looked: the next scan sees the new state
            signature = tuple((str(p), s.st_size, s.st_mtime_ns) for p, s in zip(files, stats))
            if yielded.get(doc_id) == signature:
                continue
            seen = changing.get(doc_id)
            if seen is None or seen[0] != signature:
                changing[doc_id] = (signature, now_mono)
                newest = max(s.st_mtime for s in stats)
                if not (first_scan and now_wall - newest >= settle_s):
                    continue
            elif now_mono - seen[1] < settle_s:
                continue
            changing.pop(doc_id, None)
            yielded[doc_id] = signature
            yield _folder_document(root, doc_id, files)
        first_scan = False
        yield IDLE
        if _stop_requested(stop, deadline, poll_s):
            return


def follow_jsonl(path: str | Path, *, poll_s: float = 0.5, stop: threading.Event | None = None,
                 max_seconds: float | None = None) -> Iterator[SourceItem]:
    """``tail -f`` for a JSONL manifest: existing lines first, then each new complete line (a line
    still being written, without its newline, waits). A truncated or replaced file is read again
    from its start; the ledger keeps that from publishing documents twice.
    """
    path = Path(path).absolute()
    if path.suffix.lower() in (".csv", ".tsv", ".json", ".gz"):
        raise ValueError("watching follows uncompressed JSON-lines manifests; a CSV document's rows cannot be known "
                         "complete, a .json list is one value, and a gzip stream is not read as it grows")
    base_dir, origin = str(path.parent), printable(path)
    deadline = time.monotonic() + max_seconds if max_seconds is not None else None
    fh: IO[bytes] | None = None
    inode = None
    line_no, pending = 0, b""
    try:
        while True:
            try:
                st = path.stat()
            except FileNotFoundError:
                st = None
            if st is not None and (fh is None or st.st_ino != inode or st.st_size < fh.tell()):
                if fh is not None:
                    fh.close()
                fh, inode, line_no, pending = open(path, "rb"), st.st_ino, 0, b""
            if fh is not None:
                while chunk := fh.read(1 << 20):
                    lines = (pending + chunk).split(b"\n")
                    pending = lines.pop()
                    for raw in lines:
                        line_no += 1
                        raw = raw.rstrip(b"\r")
                        if raw.strip():
                            yield parse_json_line(raw, line=line_no, origin=origin, base_dir=base_dir)
            yield IDLE
            if _stop_requested(stop, deadline, poll_s):
                return
    finally:
        if fh is not None:
            fh.close()
