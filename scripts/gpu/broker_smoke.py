"""Start the local Kafka broker the way the pipeline does (vlmstream.broker with JAVA_HOME / VLMSTREAM_HOME from the
environment), create the pipeline topics, produce one record with the pipeline's idempotent producer, read it back
with a group consumer, then stop the broker (unless --keep). Exit 0 only when the record came back.

Usage: python scripts/gpu/broker_smoke.py [--keep]   (port from VLMSTREAM_BROKER__PORT, bootstrap from
VLMSTREAM_KAFKA__BOOTSTRAP_SERVERS; both must agree)
"""

from __future__ import annotations

import sys
import time
import uuid

from vlmstream.broker import lifecycle
from vlmstream.config import load_settings
from vlmstream.kafka.clients import make_consumer, make_producer
from vlmstream.kafka.topics import create_topics


def main() -> int:
    keep = "--keep" in sys.argv
    settings = load_settings()
    t0 = time.monotonic()
    bootstrap = lifecycle.start(settings)
    started_s = time.monotonic() - t0
    ok = False
    try:
        report = create_topics(settings)
        topic = settings.topics.documents
        payload = f"smoke-{uuid.uuid4().hex}".encode()
        producer = make_producer(settings)
        producer.send(topic, key=b"smoke", value=payload).get(timeout=30)
        producer.close()
        consumer = make_consumer(settings, f"smoke-{uuid.uuid4().hex[:8]}", [topic], consumer_timeout_ms=30_000)
        ok = any(record.value == payload for record in consumer)
        consumer.close()
        print(f"BROKER_SMOKE {'OK' if ok else 'FAILED'} bootstrap={bootstrap} start_s={started_s:.1f} "
              f"topics_created={len(report.created)} roundtrip_s={time.monotonic() - t0 - started_s:.1f}", flush=True)
    finally:
        if not keep:
            lifecycle.stop(settings, reason="broker_smoke: the smoke test done")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
