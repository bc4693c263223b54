"""`vlmstream redrive`: republish dead letters' original records to their source topic for another try; and
reading the dead-letter topic, which `vlmstream status` counts. Plain functions that return values;
``vlmstream/cli/ops.py`` prints them.
"""

from __future__ import annotations

import base64
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kafka import TopicPartition

from schemas import DeadLetter, SchemaError
from vlmstream.config import Settings
from vlmstream.kafka.clients import make_consumer, make_producer
from vlmstream.kafka.group import topic_partitions
from vlmstream.kafka.records import poll_past_unreadable


def read_dead_letters(settings: Settings, timeout_s: float = 30.0) -> list[tuple[Any, DeadLetter | None]]:
    """Every record of the dead-letter topic from the beginning, without a group (read up to the end offsets
    seen at the start)."""
    # read_committed (make_consumer's default): a dead letter of an aborted transaction was written again by the
    # retry that followed it.
    consumer = make_consumer(settings, None)
    out: list[tuple[Any, DeadLetter | None]] = []
    try:
        # No dead-letter topic means no dead letters, not an error: nothing failed yet on this cluster.
        tps = topic_partitions(consumer, [settings.topics.deadletter], timeout_s=0, missing_ok=True)
        if not tps:
            return out
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in tps) and time.monotonic() < deadline:
            for records in poll_past_unreadable(consumer, timeout_ms=500).values():
                for record in records:
                    if record.offset >= ends[TopicPartition(record.topic, record.partition)]:
                        continue
                    try:
                        out.append((record, DeadLetter.decode(record.value)))
                    except SchemaError:
                        out.append((record, None))
    finally:
        consumer.close()
    return out


@dataclass
class RedriveReport:
    selected: int = 0
    republished: Counter = field(default_factory=Counter)  # by source topic
    skipped: Counter = field(default_factory=Counter)  # by reason


def redrive(settings: Settings, *, stage: str | None = None, error_kind: str | None = None,
            dry_run: bool = False) -> RedriveReport:
    """Republish the original record of each matching dead letter to its source topic for another try."""
    from schemas import HEADER_META, ImagePayload

    report = RedriveReport()
    producer = None if dry_run else make_producer(settings)
    try:
        for _record, letter in read_dead_letters(settings):
            if letter is None or (stage and letter.stage != stage) or (error_kind and letter.error_kind != error_kind):
                continue
            report.selected += 1
            if not letter.source or letter.original_value_b64 is None:
                report.skipped["no original record"] += 1
                continue
            value = base64.b64decode(letter.original_value_b64)
            if letter.original_headers_b64 is not None:
                headers = [(k, base64.b64decode(v) if v is not None else None) for k, v in letter.original_headers_b64]
            else:  # a dead letter without the exact copy of its headers: their text values only
                headers = [(k, v.encode()) for k, v in (letter.original_headers or {}).items()]
            meta_raw = (letter.original_headers or {}).get(HEADER_META)
            if meta_raw is not None:
                meta = ImagePayload.decode(meta_raw)
                if not meta.claim_check and meta.payload_bytes is not None and len(value) != meta.payload_bytes:
                    report.skipped["original value truncated"] += 1  # dead letters keep at most 1 MiB
                    continue
            elif letter.source["topic"] == settings.topics.images:
                report.skipped["image record without its metadata header"] += 1
                continue
            report.republished[letter.source["topic"]] += 1
            if producer is not None:
                key = base64.b64decode(letter.original_key_b64) if letter.original_key_b64 else None
                producer.send(letter.source["topic"], value=value, key=key, headers=headers)
        if producer is not None:
            producer.flush()
    finally:
        if producer is not None:
            producer.close()
    return report
