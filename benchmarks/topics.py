"""Reading a whole topic back after a benchmark's run: every record of every partition, from the beginning, until
the topic has been quiet for a few seconds. Scripts run from the repository root (or put it on sys.path)."""

from __future__ import annotations

import time


def read_topic(settings, topic: str, quiet_s: float = 5.0) -> list:
    """Every record of ``topic`` (all partitions, from the beginning), read until none has come for ``quiet_s``."""
    from vlmstream.kafka.clients import make_consumer
    from vlmstream.kafka.group import topic_partitions

    consumer = make_consumer(settings, None)
    out = []
    try:
        consumer.assign(topic_partitions(consumer, [topic]))
        consumer.seek_to_beginning()
        quiet = time.monotonic()
        while time.monotonic() - quiet < quiet_s:
            for records in consumer.poll(timeout_ms=500).values():
                quiet = time.monotonic()
                out += records
    finally:
        consumer.close()
    return out
