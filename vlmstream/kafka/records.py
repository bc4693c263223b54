"""Records as values: one the client cannot parse, and the dead letter that carries a record to redrive."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import CorruptRecordError, UnsupportedCodecError

from schemas import DeadLetter, b64_or_none, now, source_coords

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnreadableRecord:
    """A record kafka-python could not parse (a header key that is not UTF-8, as a librdkafka client may write;
    a failed CRC; a batch in a compression codec whose library is missing), in a record's place: where it is, and
    why. It has no key, value or headers to carry."""

    topic: str
    partition: int
    offset: int
    error: str
    key: None = None
    value: None = None
    headers: tuple = ()
    timestamp: int = -1


# What a runner gets from a poll: a record kafka-python parsed, or one it could not, in its place.
Record = ConsumerRecord | UnreadableRecord


def poll_past_unreadable(consumer: KafkaConsumer, **poll_kwargs) -> dict[TopicPartition, list[Record]]:
    """``consumer.poll``, except that a record kafka-python cannot parse comes back as an ``UnreadableRecord`` and
    the consumer moves past it. Raised, it would stop the consumer on the same record after every restart, since
    nothing past it is ever committed. Raises as before where the record's partition cannot be told."""
    try:
        return consumer.poll(**poll_kwargs)
    except (CorruptRecordError, UnsupportedCodecError) as exc:
        # A batch in a codec kafka-python cannot decompress fails on every record in it: seeking past one at a
        # time makes each of them its own unreadable record, so none of them is lost without a trace.
        # kafka-python names neither partition nor offset; its fetcher still holds the records it failed on,
        # and their partition's position is the record that failed (a private attribute: checked, not assumed).
        failed_on = getattr(getattr(consumer, "_fetcher", None), "_next_partition_records", None)
        tp = getattr(failed_on, "topic_partition", None)
        if tp is None or tp not in consumer.assignment():
            raise
        offset = consumer.position(tp)
        log.error("skipping the record at %s/%d@%d that cannot be read: %s", tp.topic, tp.partition, offset, exc)
        consumer.seek(tp, offset + 1)
        return {tp: [UnreadableRecord(tp.topic, tp.partition, offset, f"{type(exc).__name__}: {exc}")]}


def dead_letter_from_record(record: Record, *, stage: str, error_kind: str, detail: str, retriable: bool = False,
                            doc_id: str | None = None, image_index: int | None = None,
                            image_count: int | None = None, source_uri: str | None = None,
                            attempts: int = 1) -> DeadLetter:
    """A dead letter that carries the original record, so `vlmstream redrive` can publish it again."""
    # Every header travels, the image metadata header included: `redrive` republishes image records, which
    # are useless without it.
    headers = {}
    for key, value in record.headers or ():
        try:
            headers[key] = value.decode()
        except (UnicodeDecodeError, AttributeError):
            headers[key] = repr(value)
    return DeadLetter(
        stage=stage, error_kind=error_kind, detail=detail[:4000], retriable=retriable,
        doc_id=doc_id, image_index=image_index, image_count=image_count, source_uri=source_uri,
        source=source_coords(record.topic, record.partition, record.offset), attempts=attempts,
        original_key_b64=b64_or_none(record.key), original_value_b64=b64_or_none(record.value),
        original_headers=headers or None,
        # Exactly, for redrive: a binary value from another client would otherwise come back as its repr.
        original_headers_b64=tuple((key, b64_or_none(value)) for key, value in record.headers or ()) or None,
        created_at=now(),
    )
