"""The pipeline's topics: their specs from the settings, creation, and warnings where existing ones differ."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from kafka.errors import (
    ClusterAuthorizationFailedError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
)

from vlmstream.config import Settings
from vlmstream.kafka.clients import make_admin

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    configs: dict[str, str]


def replication(settings: Settings, brokers: int) -> tuple[int, int | None]:
    """(replication factor, min.insync.replicas to set or None) for a cluster of ``brokers``: the configured ones,
    or min(3, brokers) and, from a factor of 3, 2 in sync, so that one broker can fail without losing a write
    acknowledged by all in-sync replicas (our producers use acks=all). The single local broker gets (1, None),
    as it always had; on a cluster the topic config is set even at 1, against a broker default of 2."""
    t = settings.topics
    factor = t.replication_factor or min(3, max(1, brokers))
    min_isr = t.min_insync_replicas
    if min_isr is None and brokers > 1:
        min_isr = 2 if factor >= 3 else 1
    return factor, min_isr


def pipeline_topic_specs(settings: Settings, brokers: int = 1) -> list[TopicSpec]:
    """The seven topics, replicated as ``replication`` says for a cluster of ``brokers``."""
    t = settings.topics
    factor, min_isr = replication(settings, brokers)
    max_bytes = str(settings.kafka.max_message_bytes + 1024 * 1024)
    durability = {"min.insync.replicas": str(min_isr)} if min_isr is not None else {}
    data = {"retention.ms": str(t.retention_ms), "max.message.bytes": max_bytes, **durability}
    keyed_output = dict(data)
    return [
        TopicSpec(t.documents, t.partitions, factor, dict(data)),
        # Image payloads are large and transient: shorter retention would also do; replay needs them.
        TopicSpec(t.images, t.partitions, factor, dict(data)),
        TopicSpec(t.descriptions, t.partitions, factor, keyed_output),
        TopicSpec(t.embeddings, t.partitions, factor, dict(keyed_output)),
        # One result per document, keyed by doc_id: compaction keeps the latest without losing any document.
        TopicSpec(t.results, t.partitions, factor,
                  {"cleanup.policy": "compact", "max.message.bytes": max_bytes, **durability}),
        # One summary per document, keyed by doc_id: compaction keeps the latest (the newest version's answer).
        TopicSpec(t.summaries, t.partitions, factor,
                  {"cleanup.policy": "compact", "max.message.bytes": max_bytes, **durability}),
        TopicSpec(t.deadletter, max(1, t.partitions // 4), factor,
                  {"retention.ms": str(t.deadletter_retention_ms), "max.message.bytes": max_bytes, **durability}),
    ]


def broker_count(admin: KafkaAdminClient) -> int:
    """The brokers the cluster lists now (describe cluster)."""
    return max(1, len(admin.describe_cluster().get("brokers", [])))


@dataclass
class TopicReport:
    created: list[str]
    existing: list[str]
    warnings: list[str]


def create_topics(settings: Settings, specs: list[TopicSpec] | None = None) -> TopicReport:
    """Create missing topics; for existing ones compare partitions, replicas and configs and warn on differences.
    Without ``specs``, the pipeline's seven, replicated for the brokers the cluster lists now."""
    admin = make_admin(settings)
    report = TopicReport([], [], [])
    try:
        specs = specs if specs is not None else pipeline_topic_specs(settings, broker_count(admin))
        existing = set(admin.list_topics())
        new = [NewTopic(s.name, s.partitions, s.replication_factor, topic_configs=s.configs)
               for s in specs if s.name not in existing]
        if new:
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass  # another process created them between list and create: that is the goal
            except (TopicAuthorizationFailedError, ClusterAuthorizationFailedError) as exc:
                # A secured cluster: a stage's principal neither creates topics nor sees those it has no rights on
                # (listed here as missing); the admin creates them. A topic the stage needs and lacks fails later,
                # by name, where the stage uses it.
                log.info("not allowed to create topics %s (%s): left to the admin (`vlmstream topics create`)",
                         ", ".join(n.name for n in new), type(exc).__name__)
                new = []
            report.created = [n.name for n in new]
            _wait_until_visible(admin, {s.name: s.partitions for s in specs if s.name in report.created})
        present = [s for s in specs if s.name in existing]
        report.existing = [s.name for s in present]
        if present:
            report.warnings = _compare_existing(admin, present)
    finally:
        admin.close()
    for warning in report.warnings:
        log.warning(warning)
    return report


def _wait_until_visible(admin: KafkaAdminClient, partitions: dict[str, int], timeout_s: float = 30.0) -> None:
    """Return once every new topic shows all its partitions with a leader. A consumer group that joins
    earlier can be assigned only the partitions visible so far and leave the rest unread until the next
    metadata refresh (seen in tests: a fresh 3-partition topic assigned as 2)."""


    deadline = time.monotonic() + timeout_s
    while partitions and time.monotonic() < deadline:
        try:
            described = admin.describe_topics(list(partitions))
        except Exception:  # noqa: BLE001 - not visible yet is the expected answer right after creation
            described = []
        ready = {d.get("name") or d.get("topic") for d in described
                 if len([p for p in d.get("partitions", []) if p.get("leader_id", -1) >= 0])
                 >= partitions.get(d.get("name") or d.get("topic"), 0)}
        partitions = {name: count for name, count in partitions.items() if name not in ready}
        if partitions:
            time.sleep(0.1)
    if partitions:
        log.warning("topics not fully visible after %.0fs: %s", timeout_s, sorted(partitions))


def _compare_existing(admin: KafkaAdminClient, specs: list[TopicSpec]) -> list[str]:
    warnings: list[str] = []
    described = {d.get("name") or d.get("topic"): d for d in admin.describe_topics([s.name for s in specs])}
    resources = [ConfigResource(ConfigResourceType.TOPIC, s.name) for s in specs]
    configs: dict[str, dict[str, str]] = {}
    response = admin.describe_configs(resources)
    # kafka-python 3.x answers {"topic": {name: {config: {"value": ...}}}}.
    for name, entries in (response.get("topic", {}) if isinstance(response, dict) else {}).items():
        configs[name] = {key: (entry.get("value") if isinstance(entry, dict) else entry)
                         for key, entry in entries.items()}
    for spec in specs:
        partitions = described.get(spec.name, {}).get("partitions", [])
        if len(partitions) != spec.partitions:
            warnings.append(f"topic {spec.name} has {len(partitions)} partitions; the config asks for "
                            f"{spec.partitions}")
        replicas = max((len(p.get("replica_nodes", [])) for p in partitions), default=spec.replication_factor)
        if replicas != spec.replication_factor:
            warnings.append(f"topic {spec.name} has {replicas} replicas; the config asks for "
                            f"{spec.replication_factor}")
        actual = configs.get(spec.name, {})
        for key, wanted in spec.configs.items():
            if key in actual and str(actual[key]) != wanted:
                warnings.append(f"topic {spec.name}: {key}={actual[key]}; the config asks for {wanted}")
    return warnings
