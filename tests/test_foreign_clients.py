"""Clients nobody on the team wrote, on the real broker: Apache Kafka's own Java client (tests/java/JavaClient.java,
run from the broker's jars) publishes documents in every compression codec Kafka has, as JVM services and
librdkafka-based clients do, and reads the pipeline's transactional outputs back with read_committed.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import kafka.codec
import orjson
import pytest
from kafka import TopicPartition

from tests.helpers import SMALL, Fleet, corpus_images
from tests.kafka_helpers import read_topic
from vlmstream.broker.jars import provision_jars
from vlmstream.config import Settings
from vlmstream.kafka.clients import make_consumer
from vlmstream.kafka.records import UnreadableRecord, poll_past_unreadable
from vlmstream.kafka.topics import TopicSpec, create_topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
JAVA_CLIENT = "tests/java/JavaClient.java"
CODECS = ("gzip", "snappy", "lz4", "zstd")


def java_client(settings: Settings, *args: str, stdin: str = "", timeout_s: float = 120) -> list[str]:
    """Runs the Java client (single-file source launch) on the broker's own jars; its output lines."""
    java = shutil.which("java")
    assert java, "java is needed: the local broker runs on it"
    classpath = f"{provision_jars(settings.broker)}/*"
    done = subprocess.run([java, "-cp", classpath, JAVA_CLIENT, args[0], settings.kafka.bootstrap_servers, *args[1:]],
                          input=stdin, capture_output=True, text=True, timeout=timeout_s,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line]


@pytest.mark.timeout(240)
def test_documents_from_the_java_client_in_every_codec_are_decoded_and_it_reads_our_outputs(
        topic_names, corpus_dir, tmp_path, unique):
    """kafka-python has only gzip built in: without the other codecs installed, a batch in snappy, lz4 or zstd
    would stop every decode worker that met it, on the same batch after every restart. The fleet runs exactly-once
    (its images are written in transactions) and its own producer writes zstd."""
    [image] = corpus_images(corpus_dir, 1, suffixes=(".jpg", ".jpeg"))
    expected = set()
    for codec in CODECS:
        lines = []
        for d in range(2):
            doc_id = f"java-{codec}-{d}-{unique}"
            # Written by hand, as a foreign client would: only the schema's required fields and some metadata.
            document = {"doc_id": doc_id, "image_uris": [str(image)], "metadata": {"client": "java", "codec": codec}}
            lines.append(f"{doc_id}\t{orjson.dumps(document).decode()}\n")
            expected.add(f"{doc_id}/0")
        assert java_client(topic_names, "produce", topic_names.topics.documents, codec, stdin="".join(lines)) == ["sent 2"]

    with Fleet(topic_names, tmp_path, "--workers", "1", "--until-idle-s", "3", "--max-pixels", str(SMALL),
               "--allowed-root", str(corpus_dir), decode={"exactly_once": True},
               producer={"compression_type": "zstd"}) as fleet:
        assert fleet.wait(120) == 0, fleet.log()

    ours = {r.key.decode(): r for r in read_topic(topic_names, topic_names.topics.images, expected=len(expected),
                                                  timeout_s=30, idle_s=1, read_committed=True)}
    assert set(ours) == expected
    assert read_topic(topic_names, topic_names.topics.deadletter, timeout_s=5, idle_s=1) == []

    theirs = java_client(topic_names, "consume", topic_names.topics.images, str(len(expected)), "30000")
    assert len(theirs) == len(expected)
    for line in theirs:
        key, header_keys, value_length = line.split("\t")
        assert key in ours
        assert header_keys.split(",") == [k for k, _ in ours[key].headers]
        assert int(value_length) == len(ours[key].value) > 0


@pytest.mark.timeout(120)
def test_a_batch_in_a_codec_this_install_cannot_read_is_one_unreadable_record_per_record(
        kafka_settings, monkeypatch):
    """Where a codec's library is missing after all, each record of such a batch comes back as an
    UnreadableRecord at its own offset (the runners dead-letter those), and the records after it are read."""
    topic = f"test.codec.{uuid.uuid4().hex[:10]}"
    create_topics(kafka_settings, [TopicSpec(topic, 1, 1, {})])
    java_client(kafka_settings, "produce", topic, "lz4", stdin="a\t1\nb\t2\nc\t3\n")
    java_client(kafka_settings, "produce", topic, "gzip", stdin="d\t4\n")
    monkeypatch.setattr(kafka.codec, "has_lz4", lambda: False)

    consumer = make_consumer(kafka_settings, None)
    try:
        consumer.assign([TopicPartition(topic, 0)])
        consumer.seek_to_beginning()
        seen: list = []
        deadline = time.monotonic() + 60
        while len(seen) < 4 and time.monotonic() < deadline:
            for records in poll_past_unreadable(consumer, timeout_ms=500).values():
                seen.extend(records)
    finally:
        consumer.close()
    assert [type(r) for r in seen[:3]] == [UnreadableRecord] * 3
    assert [r.offset for r in seen[:3]] == [0, 1, 2]
    assert all("UnsupportedCodecError" in r.error and "lz4" in r.error for r in seen[:3])
    assert len(seen) == 4 and (seen[3].key, seen[3].value, seen[3].offset) == (b"d", b"4", 3)
