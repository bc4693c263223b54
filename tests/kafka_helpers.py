"""Helpers for tests on the real broker: uuid-named topics, reading a topic back, end and committed offsets."""

from __future__ import annotations

import time
import uuid
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from vlmstream.config import Settings
from vlmstream.kafka.clients import make_admin
from vlmstream.kafka.topics import TopicSpec, create_topics, pipeline_topic_specs


def create_uuid_topics(settings: Settings, partitions: int = 3) -> Settings:
    """A copy of ``settings`` whose topics are new, uuid-named and created with ``partitions``: all but the
    summaries topic, which only the tests that need it create (``create_summaries_topic``), since export and view
    must work without it."""
    suffix = uuid.uuid4().hex[:10]
    names = {name: f"test.{suffix}.{name}" for name in
             ("documents", "images", "descriptions", "embeddings", "results", "deadletter", "summaries")}
    topics = settings.topics.model_copy(update={**names, "partitions": partitions})
    scoped = settings.model_copy(update={"topics": topics})
    specs = [TopicSpec(s.name, partitions if s.name != topics.deadletter else 1, 1, s.configs)
             for s in pipeline_topic_specs(scoped) if s.name != topics.summaries]
    create_topics(scoped, specs)
    return scoped


def create_summaries_topic(scoped: Settings) -> Settings:
    """The summaries topic of ``create_uuid_topics``'s settings, as the pipeline creates it (compacted)."""
    spec = next(s for s in pipeline_topic_specs(scoped) if s.name == scoped.topics.summaries)
    create_topics(scoped, [TopicSpec(spec.name, scoped.topics.partitions, 1, spec.configs)])
    return scoped


def delete_topics(settings: Settings, scoped: Settings) -> None:
    admin = make_admin(settings)
    try:
        t = scoped.topics
        for names in ([t.documents, t.images, t.descriptions, t.embeddings, t.results, t.deadletter], [t.summaries]):
            try:
                admin.delete_topics(names)
            except Exception:  # noqa: BLE001 - cleanup is best effort (the summaries topic may not exist)
                pass
    finally:
        admin.close()


def read_topic(settings: Settings, topic: str, *, expected: int | None = None, timeout_s: float = 30.0,
               idle_s: float = 2.0, read_committed: bool = False) -> list[Any]:
    """Every record of ``topic`` from the beginning, without a consumer group.

    Stops when ``expected`` records arrived (then waits ``idle_s`` more for extras, so a test can
    see duplicates), or when the topic is quiet for ``idle_s`` with ``expected`` unset, or at timeout.
    """
    consumer = KafkaConsumer(**settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False,
                             auto_offset_reset="earliest",
                             isolation_level="read_committed" if read_committed else "read_uncommitted",
                             max_partition_fetch_bytes=settings.kafka.max_message_bytes + 1024 * 1024,
                             fetch_max_bytes=max(52428800, 2 * settings.kafka.max_message_bytes))
    try:
        partitions = None
        deadline = time.monotonic() + timeout_s
        while partitions is None and time.monotonic() < deadline:
            partitions = consumer.partitions_for_topic(topic)
            if partitions is None:
                time.sleep(0.2)
        if partitions is None:
            return []
        consumer.assign([TopicPartition(topic, p) for p in partitions])
        consumer.seek_to_beginning()
        records: list[Any] = []
        last_new = time.monotonic()
        reached_at = None
        while time.monotonic() < deadline:
            batch = consumer.poll(timeout_ms=200)
            for recs in batch.values():
                records.extend(recs)
                last_new = time.monotonic()
            if expected is not None and len(records) >= expected:
                reached_at = reached_at or time.monotonic()
                if time.monotonic() - reached_at >= idle_s:
                    break
            elif expected is None and time.monotonic() - last_new >= idle_s:
                break
        return records
    finally:
        consumer.close()


def end_offsets(settings: Settings, topic: str, *, read_committed: bool = False) -> dict[int, int]:
    consumer = KafkaConsumer(**settings.kafka.client_kwargs(), group_id=None,
                             isolation_level="read_committed" if read_committed else "read_uncommitted")
    try:
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        return {tp.partition: offset for tp, offset in consumer.end_offsets(partitions).items()}
    finally:
        consumer.close()


def committed_offsets(settings: Settings, group_id: str, topic: str) -> dict[int, int]:
    admin = make_admin(settings)
    try:
        offsets = admin.list_group_offsets(group_id).get(group_id, {})
    finally:
        admin.close()
    return {tp.partition: om.offset for tp, om in offsets.items() if tp.topic == topic and om.offset >= 0}


class NotUtf8HeaderKey(str):
    """A header key written as bytes that are not UTF-8, as librdkafka-based clients can: kafka-python's producer
    asks the key for its bytes, and kafka-python's consumer then cannot parse the record."""

    def encode(self, *args, **kwargs) -> bytes:
        return b"trace-\xff\xfe"


def send_in_aborted_transaction(settings: Settings, topic: str, key: bytes, value: bytes, headers: list,
                                transactional_id: str) -> None:
    """One record to partition 0 of ``topic`` inside a transaction that is then aborted, as a transactional
    producer that failed or was fenced leaves it: read_committed readers must never see it."""
    from vlmstream.kafka.clients import make_producer

    producer = make_producer(settings, transactional_id=transactional_id)
    try:
        producer.init_transactions()
        producer.begin_transaction()
        producer.send(topic, key=key, value=value, headers=headers, partition=0)
        producer.flush()
        producer.abort_transaction()
    finally:
        producer.close()
