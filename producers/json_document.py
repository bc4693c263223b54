"""A JSON object as a document: a JSON-lines manifest's line, an element of a .json manifest's list, a JSON line
on stdin or in a followed manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from producers.items import BOM, Rejection, resolve_uri, validated
from schemas import DocumentRef, SchemaError
from schemas.messages import loads_exact

_KNOWN_KEYS = {"doc_id", "image_uris", "images", "metadata", "source", "schema_version", "published_at"}


def parse_json_line(raw: bytes, *, line: int, origin: str, base_dir: str | Path) -> DocumentRef | Rejection:
    """One manifest line: {"doc_id": ..., "image_uris"|"images": [...], "metadata": {...}}.

    Other top-level keys join the metadata (like a CSV manifest's extra columns); an explicit
    "metadata" object wins on a clash.
    """
    try:
        data = loads_exact(raw.removeprefix(BOM))
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
