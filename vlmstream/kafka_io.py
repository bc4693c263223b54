"""Kafka plumbing shared by the runners: client factories, topic administration, dead letters and
out-of-order offset tracking. Stages (decode, inference) never import this module; runners do.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from kafka.errors import CorruptRecordError, TopicAlreadyExistsError, UnsupportedCodecError

from schemas import DeadLetter, b64_or_none, now, source_coords
from vlmstream.config import Settings

log = logging.getLogger(__name__)


class FatalPipelineError(RuntimeError):
    """The broker or engine is gone: stop without committing (a supervisor restarts the process)."""


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


def subscribe_when_known(consumer: KafkaConsumer, topics: Iterable[str], listener=None,
                         timeout_s: float = 60.0, should_stop: Callable[[], bool] | None = None) -> None:
    """Subscribe once this consumer's metadata lists partitions for every topic: every group consumer joins so.

    A group leader that assigns while its metadata still lacks a topic's partitions hands out nothing, and
    kafka-python 3.0 does not reliably recover: an inference consumer of `vlmstream run` (topics created a moment
    before) was assigned [], then left out of its group (the broker listed it Empty) while it polled on with a
    zero timeout, for good (CI, 2026-11-30; a results aggregator earlier). Knowing the partitions before joining
    closes that window. Raises FatalPipelineError when a topic has none after timeout_s (it does not exist).
    """
    topics = list(topics)
    consumer.subscribe(topics, listener=listener)
    deadline = time.monotonic() + timeout_s
    for topic in topics:
        while not consumer.partitions_for_topic(topic):
            if should_stop is not None and should_stop():
                return
            if time.monotonic() > deadline:
                raise FatalPipelineError(f"topic {topic!r} has no partitions in the cluster metadata after "
                                         f"{timeout_s:.0f}s: does it exist? (`vlmstream topics create`)")
            time.sleep(0.2)
    # One more metadata update now that the subscription is set: the group protocol compares the metadata it
    # assigned with against later updates, and a snapshot taken before the subscription made every first join
    # rebalance twice.
    consumer.topics()


def topic_partitions(consumer: KafkaConsumer, topics: Iterable[str], timeout_s: float = 30.0,
                     missing_ok: bool = False) -> list[TopicPartition]:
    """Every partition of these topics for a consumer that assigns them itself (no group), from its cluster
    metadata. A topic created a moment before may list none yet, which would make a reader miss it silently:
    wait up to timeout_s for each to list some. A topic still without partitions then raises FatalPipelineError,
    or is left out with missing_ok (a reader for whom an absent topic means nothing to read)."""
    topics = list(topics)
    deadline = time.monotonic() + timeout_s
    while True:
        found = {topic: consumer.partitions_for_topic(topic) or set() for topic in topics}
        missing = [topic for topic, partitions in found.items() if not partitions]
        if not missing or missing_ok or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if missing and not missing_ok:
        raise FatalPipelineError(f"topics not found on the cluster: {missing} (`vlmstream topics create`)")
    return sorted(TopicPartition(topic, p) for topic, partitions in found.items() for p in partitions)


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


def poll_past_unreadable(consumer: KafkaConsumer, **poll_kwargs) -> dict[TopicPartition, list[Any]]:
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


def unique_client_id(settings: Settings, role: str) -> str:
    """A client id no other consumer shares, so the broker's member list can tell this one apart."""
    return f"{settings.kafka.client_id}-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class GroupMembershipWatchdog:
    """Notices a consumer that its group no longer lists, so its owner can rejoin.

    kafka-python 3.0 can lose a member without noticing: seen three times on a loaded machine (an inference
    consumer assigned [], or its partitions lost, and then absent from the broker's member list for good while it
    polled on). An empty assignment is also normal (more members than partitions, a standby), so only when it has
    lasted ``grace_s`` does the watchdog ask the broker, at most every ``check_every_s``, whether a member with this
    consumer's client id is in the group; when none is, ``left_out`` says so.
    """

    def __init__(self, settings: Settings, group_id: str, client_id: str, *, grace_s: float = 30.0,
                 check_every_s: float = 15.0):
        self.settings, self.group_id, self.client_id = settings, group_id, client_id
        self.grace_s, self.check_every_s = grace_s, check_every_s
        self._empty_since: float | None = None
        self._last_check = 0.0

    def left_out(self, assignment: set[TopicPartition]) -> bool:
        """``assignment``: the consumer's current one (its owner has just read it)."""
        now = time.monotonic()
        if assignment:
            self._empty_since = None
            return False
        if self._empty_since is None:
            self._empty_since = now
        if now - self._empty_since < self.grace_s or now - self._last_check < self.check_every_s:
            return False
        self._last_check = now
        try:
            admin = make_admin(self.settings)
            try:
                group = admin.describe_groups([self.group_id])[self.group_id]
            finally:
                admin.close()
        except Exception as exc:  # noqa: BLE001 - the broker is busy or away: ask again later
            log.warning("group %s: membership check failed: %r", self.group_id, exc)
            return False
        members = [m.get("client_id") for m in group.get("members") or []]
        if self.client_id in members:
            return False
        log.warning("group %s (%s) does not list this consumer (%s) after %.0f s without partitions: rejoining",
                    self.group_id, group.get("group_state"), self.client_id, now - self._empty_since)
        self._empty_since = now
        return True


def rewind(consumer: KafkaConsumer, points: dict[TopicPartition, int]) -> None:
    """Seek partitions back to where their dropped work starts, from a rebalance listener.

    A consumer that drops unfinished work when partitions are revoked or lost relies on their next owner starting
    at the commit point. kafka-python 3.0 keeps the fetch position of a partition that comes straight back to the
    same member (``assign_from_subscribed`` preserves its state, eager protocols included), so that owner would go
    on after the dropped records and never redo them. Seeking first makes every owner, this one too, resume there.
    """
    for tp, offset in points.items():
        try:
            consumer.seek(tp, offset)
        except Exception as exc:  # noqa: BLE001 - no longer assigned here: a new owner starts from the commit
            log.debug("rewind of %s to %d skipped: %r", tp, offset, exc)


def make_admin(settings: Settings) -> KafkaAdminClient:
    return KafkaAdminClient(**settings.kafka.client_kwargs(), client_id=f"{settings.kafka.client_id}-admin")


# --- topics -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    configs: dict[str, str]


def pipeline_topic_specs(settings: Settings) -> list[TopicSpec]:
    t = settings.topics
    max_bytes = str(settings.kafka.max_message_bytes + 1024 * 1024)
    data = {"retention.ms": str(t.retention_ms), "max.message.bytes": max_bytes}
    keyed_output = dict(data)
    return [
        TopicSpec(t.documents, t.partitions, t.replication_factor, dict(data)),
        # Image payloads are large and transient: shorter retention would also do; replay needs them.
        TopicSpec(t.images, t.partitions, t.replication_factor, dict(data)),
        TopicSpec(t.descriptions, t.partitions, t.replication_factor, keyed_output),
        TopicSpec(t.embeddings, t.partitions, t.replication_factor, dict(keyed_output)),
        # One result per document, keyed by doc_id: compaction keeps the latest without losing any document.
        TopicSpec(t.results, t.partitions, t.replication_factor,
                  {"cleanup.policy": "compact", "max.message.bytes": max_bytes}),
        TopicSpec(t.deadletter, max(1, t.partitions // 4), t.replication_factor,
                  {"retention.ms": str(t.deadletter_retention_ms), "max.message.bytes": max_bytes}),
    ]


@dataclass
class TopicReport:
    created: list[str]
    existing: list[str]
    warnings: list[str]


def create_topics(settings: Settings, specs: list[TopicSpec] | None = None) -> TopicReport:
    """Create missing topics; for existing ones compare partitions and configs and warn on differences."""
    specs = specs if specs is not None else pipeline_topic_specs(settings)
    admin = make_admin(settings)
    report = TopicReport([], [], [])
    try:
        existing = set(admin.list_topics())
        new = [NewTopic(s.name, s.partitions, s.replication_factor, topic_configs=s.configs)
               for s in specs if s.name not in existing]
        if new:
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass  # another process created them between list and create: that is the goal
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
    import time

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
        partitions = len(described.get(spec.name, {}).get("partitions", []))
        if partitions != spec.partitions:
            warnings.append(f"topic {spec.name} has {partitions} partitions; the config asks for {spec.partitions}")
        actual = configs.get(spec.name, {})
        for key, wanted in spec.configs.items():
            if key in actual and str(actual[key]) != wanted:
                warnings.append(f"topic {spec.name}: {key}={actual[key]}; the config asks for {wanted}")
    return warnings


# --- dead letters ------------------------------------------------------------------------------


def dead_letter_from_record(record: Any, *, stage: str, error_kind: str, detail: str, retriable: bool = False,
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


# --- offsets -----------------------------------------------------------------------------------


class OffsetTracker:
    """Per partition, the highest offset below which every message is done.

    Completion is out of order (a slow image must not let a later one commit past it). Offsets are
    tracked in the order the consumer delivers them (increasing per partition, with gaps where
    compaction or transaction markers sit), so the commit point is the lowest offset still pending,
    or one past the highest tracked offset when nothing is pending.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[TopicPartition, set[int]] = defaultdict(set)
        self._highest: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    def track(self, tp: TopicPartition, offset: int) -> None:
        with self._lock:
            self._pending[tp].add(offset)
            if offset > self._highest.get(tp, -1):
                self._highest[tp] = offset

    def done(self, tp: TopicPartition, offset: int) -> None:
        with self._lock:
            self._pending[tp].discard(offset)

    def _point(self, tp: TopicPartition) -> int:
        """The lowest offset still pending, or one past the highest tracked (under the lock)."""
        pending = self._pending[tp]
        return min(pending) if pending else self._highest[tp] + 1

    def commit_point(self) -> dict[TopicPartition, int]:
        """{tp: next offset to read} for partitions whose commit point moved since the last call."""
        moved: dict[TopicPartition, int] = {}
        with self._lock:
            for tp in self._highest:
                point = self._point(tp)
                if point > self._committed.get(tp, -1):
                    self._committed[tp] = point
                    moved[tp] = point
        return moved

    def resume_points(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Where reading must resume for nothing to be skipped, for each of partitions that has tracked offsets:
        its lowest pending offset, or one past the highest tracked."""
        with self._lock:
            return {tp: self._point(tp) for tp in partitions if tp in self._highest}

    def in_flight(self) -> int:
        with self._lock:
            return sum(len(p) for p in self._pending.values())

    def in_flight_for(self, tp: TopicPartition) -> int:
        with self._lock:
            return len(self._pending.get(tp, ()))

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """Drop the state of revoked partitions (their new owner resumes from the last commit)."""
        with self._lock:
            for tp in partitions:
                self._pending.pop(tp, None)
                self._highest.pop(tp, None)
                self._committed.pop(tp, None)

    def partitions(self) -> list[TopicPartition]:
        with self._lock:
            return list(self._highest)
