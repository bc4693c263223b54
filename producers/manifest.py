"""Manifest files: JSON lines, one JSON document list, CSV or TSV, each possibly gzipped. This module owns
opening them (gzip by content, wide encodings rejected by name) and picks the reader by suffix."""

from __future__ import annotations

import gzip
import io
import os
from pathlib import Path
from typing import IO, Any, Iterator

import orjson

from producers.csv_reader import csv_documents
from producers.items import BOM, Rejection, replace_non_utf8
from producers.json_document import parse_document_object, parse_json_line
from schemas import DocumentRef
from schemas.messages import loads_exact

_GZIP_MAGIC = b"\x1f\x8b"
_WIDE_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
              b"\xfe\xff": "UTF-16"}


def read_manifest(path: str | Path) -> Iterator[DocumentRef | Rejection]:
    """CSV by a .csv or .tsv suffix (delimiter from the header), one JSON document list by .json, JSON lines
    otherwise; each may be gzipped (.gz after the suffix). UTF-8 text: a UTF-16 file (Windows' "Unicode") is
    rejected whole, by name, rather than line by line as invalid JSON."""
    path = Path(path)
    if encoding := _wide_encoding(path):
        return iter([Rejection(replace_non_utf8(path.absolute()), None, "unsupported_encoding",
                               f"the manifest is {encoding} text; save it as UTF-8", b"")])
    name = path.name.lower().removesuffix(".gz")
    suffix = os.path.splitext(name)[1]
    if suffix in (".csv", ".tsv"):
        return read_csv(path)
    if suffix == ".json":
        return read_json_document_list(path)
    return read_jsonl(path)


def read_jsonl(path: str | Path) -> Iterator[DocumentRef | Rejection]:
    path = Path(path).absolute()
    base_dir, origin = str(path.parent), replace_non_utf8(path)
    with _open_manifest(path) as fh:
        for line_no, raw in enumerate(fh, start=1):
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield parse_json_line(raw, line=line_no, origin=origin, base_dir=base_dir)


def read_json_document_list(path: str | Path) -> Iterator[DocumentRef | Rejection]:
    """A .json manifest: a list of document objects, {"documents": [...]}, or one document object. Read whole:
    JSON lines suit manifests too large for memory."""
    path = Path(path).absolute()
    base_dir, origin = str(path.parent), replace_non_utf8(path)
    with _open_manifest(path) as fh:
        raw = fh.read()
    try:
        data = loads_exact(raw.removeprefix(BOM))
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


def read_csv(path: str | Path) -> Iterator[DocumentRef | Rejection]:
    path = Path(path).absolute()
    # surrogateescape: a row that is not UTF-8 (a spreadsheet's Latin-1 export) is rejected alone, not the file.
    with io.TextIOWrapper(_open_manifest(path), newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
        yield from csv_documents(fh, origin=replace_non_utf8(path), base_dir=str(path.parent))


def _open_manifest(path: Path) -> IO[bytes]:
    """The manifest's bytes, gunzipped when they are gzip (known by content: .jsonl.gz, .csv.gz or any name)."""
    with open(path, "rb") as fh:
        gzipped = fh.read(2) == _GZIP_MAGIC
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def _wide_encoding(path: Path) -> str | None:
    with _open_manifest(path) as fh:
        head = fh.read(4)
    return next((name for bom, name in _WIDE_BOMS.items() if head.startswith(bom)), None)
