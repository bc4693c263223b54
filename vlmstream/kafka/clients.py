"""Client factories: every producer, consumer and admin client of the pipeline is made here, from the settings."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any, Iterable

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

from vlmstream.config import Settings


def make_producer(settings: Settings, *, transactional_id: str | None = None, **overrides: Any) -> KafkaProducer:
    kwargs: dict[str, Any] = {
        **settings.kafka.client_kwargs(),
        "client_id": f"{settings.kafka.client_id}-producer",
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": settings.producer.linger_ms,
        "max_request_size": settings.kafka.max_message_bytes + 512 * 1024,
        "retries": 2**31 - 1,
        "max_in_flight_requests_per_connection": 5,
    }
    if settings.producer.compression_type:
        kwargs["compression_type"] = settings.producer.compression_type
    if transactional_id:
        kwargs["transactional_id"] = transactional_id
    kwargs.update(overrides)
    return KafkaProducer(**kwargs)


def make_consumer(settings: Settings, group_id: str | None, topics: Iterable[str] = (), *,
                  read_committed: bool = True, **overrides: Any) -> KafkaConsumer:
    """read_committed unless asked otherwise: any writer of a topic may be transactional (our workers in
    exactly-once mode, Kafka Streams, Flink, an outbox), and an aborted transaction's records must not be processed.
    On a topic without transactions it reads exactly what read_uncommitted would."""
    kwargs: dict[str, Any] = {
        **settings.kafka.client_kwargs(),
        "client_id": f"{settings.kafka.client_id}-consumer",
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_partition_fetch_bytes": settings.kafka.max_message_bytes + 1024 * 1024,
        "fetch_max_bytes": max(52428800, 2 * settings.kafka.max_message_bytes),
        "isolation_level": "read_committed" if read_committed else "read_uncommitted",
    }
    kwargs.update(overrides)
    consumer = KafkaConsumer(**kwargs)
    topics = list(topics)
    if topics:
        consumer.subscribe(topics)
    return consumer


def make_admin(settings: Settings) -> KafkaAdminClient:
    return KafkaAdminClient(**settings.kafka.client_kwargs(), client_id=f"{settings.kafka.client_id}-admin")


def unique_client_id(settings: Settings, role: str) -> str:
    """A client id no other consumer shares, so the broker's member list can tell this one apart."""
    return f"{settings.kafka.client_id}-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
