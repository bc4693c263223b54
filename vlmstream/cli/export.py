"""`vlmstream export`: the output topics into files a downstream job reads without Kafka.

One consumer group (`export.group_id`, default "vlmstream-export") remembers how far the files go: each run appends
what arrived since the last one, so a nightly export, or one that follows the topics (`--follow`), never writes a
record twice unless it is killed between writing and committing (at-least-once; key on doc_id and image_index
downstream). The files, in the output folder:

  descriptions.jsonl   one Description per line, as published
  results.jsonl        one DocumentResult per line (per document: how many images succeeded and failed)
  deadletter.jsonl     one DeadLetter per line
  embeddings.jsonl     one line per embedding without its vector: doc_id, image_index, model, dim, dtype, row
                       and offset (the vector's index and byte offset in the vector file)
  embeddings.<dtype>   the vectors, row after row, little-endian (np.fromfile(path, "<f2").reshape(-1, dim))

Partitions are assigned to this process directly, not through a group rebalance: run one export per group.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

import orjson
from kafka.structs import OffsetAndMetadata

from schemas import DeadLetter, Description, DocumentResult, Embedding, SchemaError
from vlmstream.config import Settings
from vlmstream.kafka.clients import make_consumer
from vlmstream.kafka.group import topic_partitions
from vlmstream.kafka.records import poll_past_unreadable

KINDS = ("descriptions", "embeddings", "results", "deadletter")
_ITEM_BYTES = {"float16": 2, "float32": 4}
# What a line of each JSON-lines file must be: the topic's own schema (another writer's record may not be).
_SCHEMAS = {"descriptions": Description, "results": DocumentResult, "deadletter": DeadLetter}


@dataclass
class ExportReport:
    written: dict[str, int] = field(default_factory=dict)  # kind -> records appended this run
    unreadable: int = 0  # records that did not decode (counted, kept out of the files)
    files: list[str] = field(default_factory=list)


class _Files:
    """The output files, opened for appending; flushed and synced before every commit."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._open: dict[str, IO[bytes]] = {}
        self._repair()

    def _repair(self) -> None:
        """Cut what a killed export left half-written: its records were never committed, so this run writes them
        again, and a partial line or vector would corrupt what follows (a misplaced row in the vector file)."""
        for path in self.folder.glob("*.jsonl"):
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):
                with open(path, "r+b") as fh:
                    fh.truncate(data.rfind(b"\n") + 1)
        # The index and the vector files are buffered apart, so a kill can leave either ahead of the other:
        # keep the index lines whose vectors are all there, then cut each vector file after its last kept one.
        index = self.folder / "embeddings.jsonl"
        sizes = {dtype: (self.folder / f"embeddings.{dtype}").stat().st_size
                 if (self.folder / f"embeddings.{dtype}").exists() else 0 for dtype in _ITEM_BYTES}
        ends = dict.fromkeys(_ITEM_BYTES, 0)
        kept = 0
        if index.exists():
            with open(index, "rb") as fh:
                for line in fh:
                    meta = orjson.loads(line)
                    end = meta["offset"] + meta["dim"] * _ITEM_BYTES[meta["dtype"]]
                    if end > sizes[meta["dtype"]]:
                        break  # its vector never reached the disk; this run writes it again
                    ends[meta["dtype"]] = max(ends[meta["dtype"]], end)
                    kept += len(line)
            if kept < index.stat().st_size:
                with open(index, "r+b") as fh:
                    fh.truncate(kept)
        for dtype, size in sizes.items():
            if size > ends[dtype]:
                with open(self.folder / f"embeddings.{dtype}", "r+b") as fh:  # vectors after the last index line
                    fh.truncate(ends[dtype])

    def append(self, name: str, data: bytes) -> int:
        """Appends data; returns the file's size before it (the row number of fixed-size vectors follows)."""
        fh = self._open.get(name)
        if fh is None:
            fh = self._open[name] = open(self.folder / name, "ab")
        offset = fh.tell()
        fh.write(data)
        return offset

    def sync(self) -> None:
        for fh in self._open.values():
            fh.flush()
            os.fsync(fh.fileno())

    def close(self) -> list[str]:
        self.sync()
        for fh in self._open.values():
            fh.close()
        return sorted(str(self.folder / name) for name in self._open)


def export(settings: Settings, out_dir: str | Path, kinds: tuple[str, ...] = KINDS, *, follow: bool = False,
           group_id: str = "vlmstream-export", should_stop: Callable[[], bool] = lambda: False) -> ExportReport:
    """Append the chosen output topics' new records to files in out_dir. Without follow, stops once it has
    reached the end every partition had when it started."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; choose from {KINDS}")
    topics = {getattr(settings.topics, kind): kind for kind in kinds}
    report = ExportReport(written={kind: 0 for kind in kinds})
    files = _Files(Path(out_dir))
    # read_committed: with infer.exactly_once, aborted transactions' records never reach the files.
    consumer = make_consumer(settings, group_id, read_committed=True)
    try:
        partitions = topic_partitions(consumer, topics)
        consumer.assign(partitions)
        committed = {tp: consumer.committed(tp) for tp in partitions}
        for tp, offset in committed.items():
            if offset is None:
                consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, offset)
        ends = consumer.end_offsets(partitions)
        while not should_stop():
            batch = poll_past_unreadable(consumer, timeout_ms=500)  # one it cannot parse: counted
            for tp, records in batch.items():
                for record in records:
                    if not _write(files, topics[tp.topic], record.value, report):
                        report.unreadable += 1
            if batch:
                files.sync()  # the files hold every record before the group says so
                consumer.commit({tp: OffsetAndMetadata(consumer.position(tp), "", -1) for tp in batch})
            if not follow and all(consumer.position(tp) >= ends[tp] for tp in partitions):
                break
    finally:
        report.files = files.close()
        consumer.close()
    return report


def _write(files: _Files, kind: str, value: bytes | None, report: ExportReport) -> bool:
    if value is None:
        return False
    if kind != "embeddings":
        try:
            data = orjson.loads(value)
            if not isinstance(data, dict):
                return False
            _SCHEMAS[kind].from_dict(data)
        except (orjson.JSONDecodeError, SchemaError):
            return False
        files.append(f"{kind}.jsonl", orjson.dumps(data) + b"\n")  # one line, whatever the writer's layout
        report.written[kind] += 1
        return True
    try:
        embedding = Embedding.decode(value)
        vector = base64.b64decode(embedding.vector_b64, validate=True)
    except (SchemaError, ValueError):
        return False
    if len(vector) != embedding.dim * _ITEM_BYTES[embedding.dtype]:
        return False  # a short or long vector would shift every later row of the vector file
    offset = files.append(f"embeddings.{embedding.dtype}", vector)
    # row: the vector's index when every vector has this size (one model); offset: its bytes' start regardless.
    meta = {"doc_id": embedding.doc_id, "image_index": embedding.image_index, "model": embedding.model,
            "dim": embedding.dim, "dtype": embedding.dtype, "row": offset // len(vector) if vector else 0,
            "offset": offset}
    files.append("embeddings.jsonl", orjson.dumps(meta) + b"\n")
    report.written[kind] += 1
    return True
