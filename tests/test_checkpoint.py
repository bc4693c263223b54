"""The commit checkpoint on the real broker: a failed send stops every commit, a commit is ``offset + 1`` of the last
done record, and an aborted transaction's outputs never reach read_committed readers."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import NewTopic

from tests.kafka_helpers import read_topic
from vlmstream.config import Settings
from vlmstream.kafka.checkpoint import CheckedProducer, Checkpoint, Commit, Output
from vlmstream.kafka.clients import make_admin, make_consumer, make_producer
from vlmstream.kafka.errors import FatalPipelineError

SMALL_LIMIT = 2048  # max.message.bytes of the topic a too-large output goes to


@pytest.fixture
def small_topic(topic_names: Settings):
    """A uuid-named topic that refuses records over SMALL_LIMIT bytes (the producer itself would send them)."""
    name = f"test.{uuid.uuid4().hex[:10]}.small"
    admin = make_admin(topic_names)
    try:
        admin.create_topics([NewTopic(name, 1, 1, topic_configs={"max.message.bytes": str(SMALL_LIMIT)})])
    finally:
        admin.close()
    yield name
    admin = make_admin(topic_names)
    try:
        admin.delete_topics([name])
    except Exception:  # noqa: BLE001 - cleanup is best effort; uuid names never collide
        pass
    finally:
        admin.close()


def inputs(settings: Settings, count: int) -> TopicPartition:
    """``count`` records on partition 0 of the documents topic (any bytes: the checkpoint never reads them)."""
    producer = make_producer(settings)
    try:
        for i in range(count):
            producer.send(settings.topics.documents, key=f"k{i}".encode(), value=f"v{i}".encode(), partition=0)
        producer.flush()
    finally:
        producer.close()
    return TopicPartition(settings.topics.documents, 0)


def consume(settings: Settings, group_id: str, tp: TopicPartition, count: int) -> tuple[KafkaConsumer, list]:
    """A consumer of the group, assigned ``tp`` by hand (no join to wait for), and the first ``count`` records."""
    consumer = make_consumer(settings, group_id)
    consumer.assign([tp])
    records: list = []
    deadline = time.monotonic() + 30
    while len(records) < count and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=200).values():
            records.extend(batch)
    assert len(records) == count
    return consumer, records


@contextmanager
def checkpoint_over(settings: Settings, group_id: str, count: int, **producer_kwargs):
    """``count`` input records consumed by the group, and a checkpoint over that consumer and a new producer:
    (the input partition, its records, the checkpoint). Closes both clients without committing."""
    tp = inputs(settings, count)
    consumer, records = consume(settings, group_id, tp, count)
    producer = make_producer(settings, **producer_kwargs)
    try:
        if "transactional_id" in producer_kwargs:
            producer.init_transactions()
        yield tp, records, Checkpoint(consumer, CheckedProducer(producer), name="test")
    finally:
        producer.close()
        consumer.close(autocommit=False)


def committed(settings: Settings, group_id: str, topic: str, *, expected: dict | None = None,
              timeout_s: float = 10.0) -> dict[int, int]:
    """The group's committed offsets of ``topic``; with ``expected``, waits up to timeout_s for them (a
    transaction's offsets become visible once the broker has written its commit marker)."""
    deadline = time.monotonic() + timeout_s
    while True:
        admin = make_admin(settings)
        try:
            offsets = admin.list_group_offsets(group_id).get(group_id, {})
        finally:
            admin.close()
        found = {tp.partition: om.offset for tp, om in offsets.items() if tp.topic == topic and om.offset >= 0}
        if expected is None or found == expected or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


@pytest.mark.kafka
def test_a_failed_send_raises_from_flush_and_nothing_is_committed(topic_names, small_topic, unique):
    settings, group_id = topic_names, f"test-checkpoint-{unique}"
    with checkpoint_over(settings, group_id, 2) as (tp, records, checkpoint):
        sender = checkpoint.producer
        sender.send(Output(settings.topics.descriptions, b"k", b"fits", []))
        sender.send(Output(small_topic, b"k", b"x" * (4 * SMALL_LIMIT), []))  # the broker refuses it
        with pytest.raises(FatalPipelineError, match=r"1 send\(s\) failed, first: .*MessageSizeTooLarge"):
            checkpoint.commit({tp: records[-1].offset + 1})
        assert checkpoint.stopped
        # The failure stays: no later flush passes it, and a stopped checkpoint commits nothing more.
        with pytest.raises(FatalPipelineError):
            sender.flush()
        assert checkpoint.commit({tp: records[-1].offset + 1}) is Commit.SKIPPED
        assert asyncio.run(checkpoint.commit_from_listener({tp: records[-1].offset + 1})) is Commit.SKIPPED
    assert committed(settings, group_id, tp.topic) == {}


@pytest.mark.kafka
def test_offsets_commit_offset_plus_one_after_the_outputs(topic_names, unique):
    settings, group_id = topic_names, f"test-checkpoint-{unique}"
    with checkpoint_over(settings, group_id, 3) as (tp, records, checkpoint):
        for record in records:
            checkpoint.producer.send(Output(settings.topics.descriptions, record.key, record.value, []))
        assert checkpoint.commit({tp: records[-1].offset + 1}) is Commit.DONE
    assert [r.offset for r in records] == [0, 1, 2]
    assert committed(settings, group_id, tp.topic) == {0: 3}
    # The outputs were acknowledged before the offsets moved.
    assert len(read_topic(settings, settings.topics.descriptions, expected=3, idle_s=0.5)) == 3
    # The group's next reader starts after the last done record.
    again = make_consumer(settings, group_id)
    try:
        again.assign([tp])
        assert again.position(tp) == 3
    finally:
        again.close(autocommit=False)


@pytest.mark.kafka
def test_a_transaction_commits_outputs_with_offsets_or_neither(topic_names, small_topic, unique):
    settings, group_id = topic_names, f"test-checkpoint-{unique}"
    out = settings.topics.descriptions
    with checkpoint_over(settings, group_id, 2, transactional_id=f"test-checkpoint-{unique}") as (
            tp, records, checkpoint):
        # Committed: the first record's output and its offset, together.
        checkpoint.commit_transaction({tp: records[0].offset + 1}, [Output(out, b"kept", b"kept", [])])
        assert committed(settings, group_id, tp.topic, expected={0: 1}) == {0: 1}
        # Aborted: one output the broker refuses fails the whole transaction, the good output and the offset too.
        with pytest.raises(FatalPipelineError):
            checkpoint.commit_transaction({tp: records[1].offset + 1}, [
                Output(out, b"aborted", b"aborted", []), Output(small_topic, b"k", b"x" * (4 * SMALL_LIMIT), [])])
        assert checkpoint.stopped
    assert committed(settings, group_id, tp.topic) == {0: 1}
    visible = read_topic(settings, out, read_committed=True, idle_s=1.0, timeout_s=15)
    assert [r.key for r in visible] == [b"kept"]
    # The aborted output is in the log (a read_uncommitted reader sees it): only read_committed hides it.
    written = read_topic(settings, out, read_committed=False, idle_s=1.0, timeout_s=15)
    assert sorted(r.key for r in written) == [b"aborted", b"kept"]


def test_without_kafka_pythons_async_commit_a_listener_commits_nothing_and_says_so(caplog):
    """The listener's commit uses kafka-python's private coordinator API; without it the checkpoint warns."""
    producer = SimpleNamespace(flush=lambda timeout=None: None)
    checkpoint = Checkpoint(SimpleNamespace(), CheckedProducer(producer), name="test")
    with caplog.at_level(logging.WARNING, logger="vlmstream.kafka.checkpoint"):
        outcome = asyncio.run(checkpoint.commit_from_listener({TopicPartition("t", 0): 5}))
    assert outcome is Commit.SKIPPED
    assert "no async commit for listeners" in caplog.text
