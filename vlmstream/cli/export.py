"""`vlmstream export`: the output topics into files a downstream job reads without Kafka.

One consumer group (`export.group_id`, default "vlmstream-export") remembers how far the files go: each run adds
what arrived since the last one, so a nightly export, or one that follows the topics (`--follow`), writes each record
once. Two formats:

--format jsonl (the default): files appended to, synced before every commit; a run killed between writing and
committing writes those records again (at-least-once; key on doc_id and image_index downstream).

  descriptions.jsonl   one Description per line, as published
  results.jsonl        one DocumentResult per line (per document: how many images succeeded and failed)
  deadletter.jsonl     one DeadLetter per line
  summaries.jsonl      one document summary per line (the condense stage's topic, when the cluster has it)
  embeddings.jsonl     one line per embedding without its vector: doc_id, image_index, model, dim, dtype, row
                       and offset (the vector's index and byte offset in the vector file)
  embeddings.<dtype>   the vectors, row after row, little-endian (np.fromfile(path, "<f2").reshape(-1, dim))

--format parquet: rolling files named by kind (descriptions-000001.parquet, ...), each complete on disk before its
offsets are committed, and never a record twice, even after a kill (vlmstream/cli/export_parquet.py).

Partitions are assigned to this process directly, not through a group rebalance: run one export per group.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

import orjson
from kafka.structs import OffsetAndMetadata, TopicPartition

from schemas import DeadLetter, Description, DocumentResult, Embedding, SchemaError
from vlmstream.cli.export_parquet import ParquetSink
from vlmstream.config import Settings
from vlmstream.kafka.clients import make_consumer
from vlmstream.kafka.group import topic_partitions
from vlmstream.kafka.records import poll_past_unreadable

KINDS = ("descriptions", "embeddings", "results", "deadletter", "summaries")
# The condense stage may not run: its topic absent from the cluster is nothing to export, not an error.
OPTIONAL_KINDS = frozenset({"summaries"})
FORMATS = ("jsonl", "parquet")
_ITEM_BYTES = {"float16": 2, "float32": 4}
# What a line of each JSON-lines file must be: the topic's own schema (another writer's record may not be).
_SCHEMAS = {"descriptions": Description, "results": DocumentResult, "deadletter": DeadLetter}


@dataclass
class ExportReport:
    written: dict[str, int] = field(default_factory=dict)  # kind -> records appended this run
    unreadable: int = 0  # records that did not decode (counted, kept out of the files)
    already_on_disk: int = 0  # records a stopped run had written but not committed (Parquet): skipped
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


class _JsonLines:
    """The JSON-lines sink: append, and sync before every commit."""

    def __init__(self, folder: Path):
        self._files = _Files(folder)

    def resume_at(self, tp: TopicPartition, committed: int) -> int:
        return committed

    def add(self, kind: str, tp: TopicPartition, offset: int, value: bytes | None) -> bool:
        return _write(self._files, kind, value)

    def checkpoint(self, positions: dict[TopicPartition, int], *, final: bool = False) -> dict[TopicPartition, int]:
        self._files.sync()  # the files hold every record before the group says so
        return positions

    def close(self) -> list[str]:
        return self._files.close()


def export(settings: Settings, out_dir: str | Path, kinds: tuple[str, ...] = KINDS, *, format: str = "jsonl",
           follow: bool = False, group_id: str = "vlmstream-export",
           should_stop: Callable[[], bool] = lambda: False) -> ExportReport:
    """Add the chosen output topics' new records to files in out_dir. Without follow, stops once it has reached
    the end every partition had when it started."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; choose from {KINDS}")
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; choose from {FORMATS}")
    topics = {getattr(settings.topics, kind): kind for kind in kinds}
    # read_committed: with infer.exactly_once, aborted transactions' records never reach the files.
    consumer = make_consumer(settings, group_id, read_committed=True)
    sink = None
    report = ExportReport()
    try:
        partitions = topic_partitions(consumer, [t for t, k in topics.items() if k not in OPTIONAL_KINDS])
        partitions += topic_partitions(consumer, [t for t, k in topics.items() if k in OPTIONAL_KINDS],
                                       missing_ok=True)
        present = {topics[tp.topic] for tp in partitions}
        topics = {t: k for t, k in topics.items() if k in present}
        report.written = {kind: 0 for kind in kinds if kind in present}
        sink = (_JsonLines(Path(out_dir)) if format == "jsonl"
                else ParquetSink(Path(out_dir), settings.export, topics))
        consumer.assign(partitions)
        beginnings = consumer.beginning_offsets(partitions)
        for tp in partitions:
            committed = consumer.committed(tp)
            consumer.seek(tp, sink.resume_at(tp, committed if committed is not None else beginnings[tp]))
        ends = consumer.end_offsets(partitions)
        committed_at: dict[TopicPartition, int] = {}
        while True:
            stopping = should_stop()
            batch = {} if stopping else poll_past_unreadable(consumer, timeout_ms=500)  # unparsable: counted
            for tp, records in batch.items():
                kind = topics[tp.topic]
                for record in records:
                    added = sink.add(kind, tp, record.offset, getattr(record, "value", None))
                    if added:
                        report.written[kind] += 1
                    elif added is None:
                        report.already_on_disk += 1
                    else:
                        report.unreadable += 1
            done = stopping or (not follow and all(consumer.position(tp) >= ends[tp] for tp in partitions))
            durable = sink.checkpoint({tp: consumer.position(tp) for tp in partitions}, final=done)
            moved = {tp: offset for tp, offset in durable.items() if committed_at.get(tp) != offset}
            if moved:  # only what the files hold, and only after they are on disk
                consumer.commit({tp: OffsetAndMetadata(offset, "", -1) for tp, offset in moved.items()})
                committed_at.update(moved)
            if done:
                break
    finally:
        if sink is not None:
            report.files = sink.close()
        consumer.close()
    return report


def _write(files: _Files, kind: str, value: bytes | None) -> bool:
    if value is None:
        return False
    if kind != "embeddings":
        try:
            data = orjson.loads(value)
            if not isinstance(data, dict):
                return False
            if kind in _SCHEMAS:  # summaries: whatever the condense stage's message holds, as an object
                _SCHEMAS[kind].from_dict(data)
        except (orjson.JSONDecodeError, SchemaError):
            return False
        files.append(f"{kind}.jsonl", orjson.dumps(data) + b"\n")  # one line, whatever the writer's layout
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
    return True
