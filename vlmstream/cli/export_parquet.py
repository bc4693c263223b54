"""`vlmstream export --format parquet`: the output topics as Parquet files that DuckDB, pandas and polars open as
they are (`SELECT * FROM 'out/descriptions-*.parquet'`, `pd.read_parquet(path)`).

Files roll: one kind's file is closed once the records it holds reach ``export.max_file_bytes`` (as published), at
the end of a run, and with --follow every ``export.flush_interval_s``. Each file is written under a hidden temporary
name (``.descriptions-000007.parquet.tmp``, which a ``*.parquet`` glob never matches), synced, renamed into place and
its folder synced; only then are its records' offsets committed. Each file's footer says which offsets of which
partitions it covers (key ``vlmstream`` in the Parquet key-value metadata), so a run killed after the rename but
before the commit is caught up by the next: records already covered by a file are skipped, never written twice. A
temporary file a killed run left behind is deleted.

The columns of each kind are fixed (``SCHEMAS``, described in README.md), so every file of a kind has one schema;
free-form parts of a message (metadata, structured output, timings) are JSON text, which DuckDB's ``->>`` reads.
"""

from __future__ import annotations

import base64
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from kafka.structs import TopicPartition

from schemas import DeadLetter, Description, DocumentResult, Embedding, SchemaError
from vlmstream.config import ExportSettings
from vlmstream.images.pages import split_page

METADATA_KEY = b"vlmstream"
_COORDS = [pa.field("kafka_partition", pa.int32()), pa.field("kafka_offset", pa.int64())]


def _page(source_uri: str | None) -> int | None:
    """The page of a multi-page file (a PDF, a TIFF) the URI names with ``#page=N``, as a column to filter on."""
    return split_page(source_uri)[1] if source_uri else None


def _json_text(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


SCHEMAS: dict[str, pa.Schema] = {
    "descriptions": pa.schema([
        ("doc_id", pa.string()), ("image_index", pa.int32()), ("image_count", pa.int32()), ("text", pa.string()),
        ("model", pa.string()), ("prompt_id", pa.string()), ("engine", pa.string()), ("source_uri", pa.string()),
        ("page", pa.int32()), ("mode", pa.string()), ("revision", pa.string()), ("prompt_tokens", pa.int32()),
        ("output_tokens", pa.int32()), ("visual_tokens", pa.int32()), ("json", pa.string()),
        ("timings_ms", pa.string()), ("metadata", pa.string()), ("created_at", pa.float64()), *_COORDS]),
    "results": pa.schema([
        ("doc_id", pa.string()), ("image_count", pa.int32()), ("succeeded", pa.int32()), ("failed", pa.int32()),
        ("images", pa.string()), ("metadata", pa.string()), ("completed_at", pa.float64()), *_COORDS]),
    "deadletter": pa.schema([
        ("stage", pa.string()), ("error_kind", pa.string()), ("detail", pa.string()), ("retriable", pa.bool_()),
        ("doc_id", pa.string()), ("image_index", pa.int32()), ("image_count", pa.int32()),
        ("source_uri", pa.string()), ("page", pa.int32()), ("source_topic", pa.string()),
        ("source_partition", pa.int32()),
        ("source_offset", pa.int64()), ("attempts", pa.int32()), ("original_key", pa.binary()),
        ("original_value", pa.binary()), ("original_headers", pa.string()), ("created_at", pa.float64()),
        *_COORDS]),
    # The condense stage's message is read as JSON whatever its fields: the document and the whole record.
    "summaries": pa.schema([("doc_id", pa.string()), ("summary", pa.string()), *_COORDS]),
}
_EMBEDDING_FIELDS = [("doc_id", pa.string()), ("image_index", pa.int32()), ("image_count", pa.int32()),
                     ("model", pa.string()), ("pooling", pa.string()), ("grid_thw", pa.list_(pa.int32(), 3)),
                     ("created_at", pa.float64())]
_VECTOR_TYPES = {"float16": pa.float16(), "float32": pa.float32()}
_ITEM_BYTES = {"float16": 2, "float32": 4}


def embedding_schema(dtype: str, dim: int) -> pa.Schema:
    """Embeddings of one model: the vector a fixed-size list of ``dim`` values of the topic's dtype."""
    return pa.schema([*_EMBEDDING_FIELDS, ("vector", pa.list_(_VECTOR_TYPES[dtype], dim)), *_COORDS])


def _row(kind: str, value: bytes) -> dict[str, Any] | tuple[dict[str, Any], tuple[str, int], bytes]:
    """One record as a row of its kind's file; raises SchemaError/ValueError for a record that is not its topic's
    message. Embeddings come back with their (dtype, dim) and vector bytes."""
    data = orjson.loads(value)
    if not isinstance(data, dict):
        raise SchemaError("not a JSON object")
    if kind == "descriptions":
        d = Description.from_dict(data)
        return {"doc_id": d.doc_id, "image_index": d.image_index, "image_count": d.image_count, "text": d.text,
                "model": d.model, "prompt_id": d.prompt_id, "engine": d.engine, "source_uri": d.source_uri,
                "page": _page(d.source_uri), "mode": d.mode, "revision": d.revision, "prompt_tokens": d.prompt_tokens,
                "output_tokens": d.output_tokens, "visual_tokens": d.visual_tokens, "json": _json_text(d.json),
                "timings_ms": _json_text(d.timings_ms), "metadata": _json_text(d.metadata or None),
                "created_at": d.created_at}
    if kind == "results":
        r = DocumentResult.from_dict(data)
        return {"doc_id": r.doc_id, "image_count": r.image_count, "succeeded": r.succeeded, "failed": r.failed,
                "images": _json_text([dict(i) for i in r.images]), "metadata": _json_text(r.metadata or None),
                "completed_at": r.completed_at}
    if kind == "deadletter":
        x = DeadLetter.from_dict(data)
        source = x.source or {}
        headers = x.original_headers if x.original_headers is not None else x.original_headers_b64
        return {"stage": x.stage, "error_kind": x.error_kind, "detail": x.detail, "retriable": x.retriable,
                "doc_id": x.doc_id, "image_index": x.image_index, "image_count": x.image_count,
                "source_uri": x.source_uri, "page": _page(x.source_uri), "source_topic": source.get("topic"),
                "source_partition": source.get("partition"), "source_offset": source.get("offset"),
                "attempts": x.attempts,
                "original_key": base64.b64decode(x.original_key_b64) if x.original_key_b64 else None,
                "original_value": base64.b64decode(x.original_value_b64) if x.original_value_b64 else None,
                "original_headers": _json_text(headers), "created_at": x.created_at}
    if kind == "summaries":
        doc_id = data.get("doc_id")
        if not isinstance(doc_id, str):
            raise SchemaError("a summary without a doc_id")
        return {"doc_id": doc_id, "summary": orjson.dumps(data).decode()}
    e = Embedding.from_dict(data)
    vector = base64.b64decode(e.vector_b64, validate=True)
    if e.dtype not in _ITEM_BYTES or len(vector) != e.dim * _ITEM_BYTES[e.dtype]:
        raise SchemaError(f"a vector of {len(vector)} bytes is not {e.dim} x {e.dtype}")
    row = {"doc_id": e.doc_id, "image_index": e.image_index, "image_count": e.image_count, "model": e.model,
           "pooling": e.pooling, "grid_thw": list(e.grid_thw) if e.grid_thw is not None else None,
           "created_at": e.created_at}
    return row, (e.dtype, e.dim), vector


@dataclass
class _Buffer:
    """The rows of one kind's next file."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    vectors: list[bytes] = field(default_factory=list)
    shape: tuple[str, int] | None = None  # embeddings: (dtype, dim) of every vector in the buffer
    bytes: int = 0
    partitions: set[TopicPartition] = field(default_factory=set)  # those with rows here
    opened_at: float = 0.0


class ParquetSink:
    """Rows into rolling Parquet files; says which offsets are safely on disk. ``kinds`` maps topic -> kind."""

    def __init__(self, folder: Path, settings: ExportSettings, kinds: dict[str, str],
                 clock: Callable[[], float] = time.monotonic):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.settings = settings
        self.kinds = kinds
        self.clock = clock
        self.files: list[str] = []
        self._buffers = {kind: _Buffer() for kind in kinds.values()}
        self._seen: dict[TopicPartition, int] = {}  # the offset after the last record handled
        self._durable: dict[TopicPartition, int] = {}  # every record below it is in a file or needs none
        # [first, end) ranges that files already in the folder cover, ahead of where this run reads
        self._on_disk: dict[TopicPartition, list[tuple[int, int]]] = {}
        self._next_number: dict[str, int] = {kind: 1 for kind in kinds.values()}
        for stale in folder.glob(".*.parquet.tmp"):  # a killed run's unfinished file: its offsets were never
            stale.unlink()                           # committed, and this run writes its records again
        for path in folder.glob("*-*.parquet"):
            self._remember(path)

    def _remember(self, path: Path) -> None:
        match = re.fullmatch(r"(\w+)-(\d+)\.parquet", path.name)
        if not match or match.group(1) not in self._next_number:
            return
        kind, number = match.group(1), int(match.group(2))
        self._next_number[kind] = max(self._next_number[kind], number + 1)
        meta = (pq.read_metadata(path).metadata or {}).get(METADATA_KEY)
        if meta is None:
            return
        covered = orjson.loads(meta)
        if covered.get("topic") not in self.kinds:
            return
        for partition, (first, end) in covered["ranges"].items():
            self._on_disk.setdefault(TopicPartition(covered["topic"], int(partition)), []).append((first, end))

    def resume_at(self, tp: TopicPartition, committed: int) -> int:
        """Where to read tp from: its committed offset, moved past the files that already hold what follows it
        (written by a run that was stopped before it could commit them)."""
        position = committed
        for first, end in sorted(self._on_disk.get(tp, ())):
            if first <= position < end:
                position = end
        # Reading only goes forward from here: the ranges behind it can never match again, and neither can the
        # files this run writes, so each record is checked against few ranges, however many files there are.
        self._on_disk[tp] = [(first, end) for first, end in self._on_disk.get(tp, ()) if end > position]
        self._seen[tp] = self._durable[tp] = position
        return position

    def _covered(self, tp: TopicPartition, offset: int) -> bool:
        ranges = self._on_disk.get(tp)
        return bool(ranges) and any(first <= offset < end for first, end in ranges)

    def add(self, kind: str, tp: TopicPartition, offset: int, value: bytes | None) -> bool | None:
        """True: buffered; False: not this topic's message (counted, left out); None: already in a file."""
        if self._covered(tp, offset):
            self._seen[tp] = offset + 1
            return None
        try:
            if value is None:
                raise SchemaError("no value")
            parsed = _row(kind, value)
        except (orjson.JSONDecodeError, SchemaError, ValueError, TypeError):
            self._seen[tp] = offset + 1
            return False
        buffer = self._buffers[kind]
        if isinstance(parsed, tuple):
            row, shape, vector = parsed
            if buffer.shape not in (None, shape):
                self._cut(kind)  # another model's vectors: one fixed-size column per file
                buffer = self._buffers[kind]
            buffer.shape = shape
            buffer.vectors.append(vector)
        else:
            row = parsed
        if not buffer.rows:
            buffer.opened_at = self.clock()
        row["kafka_partition"], row["kafka_offset"] = tp.partition, offset
        buffer.rows.append(row)
        buffer.partitions.add(tp)
        buffer.bytes += len(value)
        self._seen[tp] = offset + 1
        if buffer.bytes >= self.settings.max_file_bytes:
            self._cut(kind)
        return True

    def checkpoint(self, positions: dict[TopicPartition, int], *, final: bool = False) -> dict[TopicPartition, int]:
        """Close the files that are due (all of them when final) and return, per partition, the offset below which
        everything is on disk: what may be committed."""
        now = self.clock()
        for kind, buffer in self._buffers.items():
            if buffer.rows and (final or now - buffer.opened_at >= self.settings.flush_interval_s):
                self._cut(kind)
        for tp, position in positions.items():
            if tp not in self._buffers[self.kinds[tp.topic]].partitions:
                # Nothing of it waits in a buffer: past its last record, and past transaction markers too.
                self._seen[tp] = self._durable[tp] = max(self._seen.get(tp, position), position)
        return dict(self._durable)

    def _cut(self, kind: str) -> None:
        buffer = self._buffers[kind]
        if not buffer.rows:
            return
        topic = next(t for t, k in self.kinds.items() if k == kind)
        ranges = {tp.partition: (self._durable[tp], self._seen[tp]) for tp in self._seen
                  if tp.topic == topic and self._seen[tp] > self._durable[tp]}
        if buffer.shape is not None:
            dtype, dim = buffer.shape
            schema = embedding_schema(dtype, dim)
            flat = np.frombuffer(b"".join(buffer.vectors), dtype="<f2" if dtype == "float16" else "<f4")
            table = pa.Table.from_pylist(buffer.rows, schema=schema.remove(schema.get_field_index("vector")))
            vectors = pa.FixedSizeListArray.from_arrays(pa.array(flat, type=_VECTOR_TYPES[dtype]), dim)
            table = table.add_column(schema.get_field_index("vector"), schema.field("vector"), vectors)
        else:
            table = pa.Table.from_pylist(buffer.rows, schema=SCHEMAS[kind])
        covered = {"topic": topic, "ranges": {str(p): list(r) for p, r in ranges.items()}, "rows": table.num_rows}
        table = table.replace_schema_metadata({METADATA_KEY: orjson.dumps(covered)})
        name = f"{kind}-{self._next_number[kind]:06d}.parquet"
        self._next_number[kind] += 1
        self._write_durably(table, name)
        for partition, (_first, end) in ranges.items():
            self._durable[TopicPartition(topic, partition)] = end
        self.files.append(str(self.folder / name))
        self._buffers[kind] = _Buffer()

    def _write_durably(self, table: pa.Table, name: str) -> None:
        # 1. write under a hidden name that no reader's glob matches; 2. sync its bytes; 3. rename into place (atomic
        # on one file system); 4. sync the folder so the rename itself survives a power cut. Only then does the
        # caller commit the offsets.
        temporary = self.folder / f".{name}.tmp"
        pq.write_table(table, temporary, compression="zstd")
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, self.folder / name)
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> list[str]:
        return sorted(self.files)
