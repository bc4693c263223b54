"""Operations on consumer groups and the dead-letter topic: replay (rewind a stage), redrive (republish
dead letters' original records), status (lag, group state, dead-letter counts). Plain functions that
return values; ``vlmstream/cli/ops.py`` prints them.
"""

from __future__ import annotations

import base64
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, TypeVar

from kafka import TopicPartition
from kafka.admin import OffsetSpec, OffsetTimestamp
from kafka.errors import CoordinatorNotAvailableError, KafkaError, NotCoordinatorError
from kafka.structs import OffsetAndMetadata

from schemas import DeadLetter, DocumentRef, SchemaError
from vlmstream.config import Settings
from vlmstream.kafka.clients import make_admin, make_consumer, make_producer
from vlmstream.kafka.group import topic_partitions
from vlmstream.kafka.records import poll_past_unreadable

STAGES = ("decode", "infer", "results")
IDLE_STATES = {"Empty", "Dead"}

T = TypeVar("T")


class ReplayRefused(RuntimeError):
    """The group has live members: rewinding under them would be overwritten by their next commit."""


def stage_group(settings: Settings, stage: str) -> tuple[str, list[str]]:
    """The consumer group of a stage and the topics it reads."""
    from consumers.results import results_group_id

    t = settings.topics
    if stage == "decode":
        return settings.decode.group_id, [t.documents]
    if stage == "infer":
        return settings.infer.group_id, [t.images]
    if stage == "results":
        return results_group_id(settings), [t.descriptions, t.deadletter]
    raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")


def parse_target(text: str) -> tuple[str, int | None]:
    """``earliest`` | ``offset:N`` | ``timestamp:ISO-8601`` or ``timestamp:<epoch ms>``."""
    if text == "earliest":
        return "earliest", None
    kind, _, value = text.partition(":")
    if kind == "offset" and value.lstrip("-").isdigit():
        return "offset", int(value)
    if kind == "timestamp" and value:
        if value.isdigit():
            return "timestamp", int(value)
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=timezone.utc)
        return "timestamp", int(parsed.timestamp() * 1000)
    raise ValueError(f"cannot read target {text!r}: use earliest, offset:N or timestamp:ISO-or-epoch-ms")


def _retry(call: Callable[[], T], attempts: int = 15) -> T:
    # A fresh broker answers "coordinator not available" until __consumer_offsets exists.
    for attempt in range(attempts):
        try:
            return call()
        except (CoordinatorNotAvailableError, NotCoordinatorError):
            if attempt == attempts - 1:
                raise
            time.sleep(min(2.0, 0.2 * 2 ** attempt))
    raise AssertionError("unreachable")


def group_state(admin: Any, group_id: str) -> tuple[str, list[dict[str, Any]]]:
    described = _retry(lambda: admin.describe_groups([group_id]))[group_id]
    return described.get("group_state") or "Dead", list(described.get("members") or [])


def _partitions(admin: Any, topics: list[str]) -> list[TopicPartition]:
    tps = []
    for topic in admin.describe_topics(topics):
        name = topic.get("name") or topic.get("topic")
        for p in topic.get("partitions", []):
            tps.append(TopicPartition(name, p.get("partition_index", p.get("partition"))))
    return sorted(tps)


@dataclass
class PartitionPlan:
    tp: TopicPartition
    committed: int | None
    current: int  # where the group resumes today (committed, or the earliest offset when never committed)
    new: int
    end: int
    images: int | None = None

    @property
    def redo(self) -> int:
        return max(0, self.current - self.new)


@dataclass
class ReplayPlan:
    stage: str
    group_id: str
    target: str
    state: str
    members: int
    partitions: list[PartitionPlan] = field(default_factory=list)

    @property
    def messages(self) -> int:
        return sum(p.redo for p in self.partitions)

    @property
    def images(self) -> int | None:
        counts = [p.images for p in self.partitions]
        return None if any(c is None for c in counts) else sum(counts)


def plan_replay(settings: Settings, stage: str, target: str) -> ReplayPlan:
    group_id, topics = stage_group(settings, stage)
    kind, value = parse_target(target)
    admin = make_admin(settings)
    try:
        state, members = group_state(admin, group_id)
        tps = _partitions(admin, topics)
        committed = _retry(lambda: admin.list_group_offsets({group_id: tps}))[group_id]
        earliest = admin.list_partition_offsets({tp: OffsetSpec.EARLIEST for tp in tps})
        latest = admin.list_partition_offsets({tp: OffsetSpec.LATEST for tp in tps})
        by_time = (admin.list_partition_offsets({tp: OffsetTimestamp(value) for tp in tps})
                   if kind == "timestamp" else {})
    finally:
        admin.close()
    plan = ReplayPlan(stage, group_id, target, state, len(members))
    for tp in tps:
        first, end = earliest[tp].offset, latest[tp].offset
        meta = committed.get(tp)
        done = meta.offset if meta is not None and meta.offset >= 0 else None
        if kind == "earliest":
            new = first
        elif kind == "offset":
            new = value
        else:
            found = by_time[tp].offset
            new = end if found is None or found < 0 else found  # nothing at or after T: nothing to redo
        new = min(max(new, first), end)
        plan.partitions.append(PartitionPlan(tp, done, done if done is not None else first, new, end))
    _count_images(settings, plan)
    return plan


def _count_images(settings: Settings, plan: ReplayPlan) -> None:
    """infer: one message is one image. decode: read the documents to redo and add up their image_uris."""
    if plan.stage == "infer":
        for p in plan.partitions:
            p.images = p.redo
        return
    if plan.stage != "decode":
        return
    todo = [p for p in plan.partitions if p.redo]
    for p in plan.partitions:
        p.images = 0
    if not todo:
        return
    consumer = make_consumer(settings, None)
    try:
        for p in todo:
            consumer.assign([p.tp])
            consumer.seek(p.tp, p.new)
            deadline = time.monotonic() + 30
            while consumer.position(p.tp) < p.current and time.monotonic() < deadline:
                for records in poll_past_unreadable(consumer, timeout_ms=500).values():
                    for record in records:
                        if record.offset >= p.current:
                            continue
                        try:
                            p.images += len(DocumentRef.decode(record.value).image_uris)
                        except SchemaError:
                            pass  # an invalid document is redone too, but yields no image
    finally:
        consumer.close()


def apply_replay(settings: Settings, plan: ReplayPlan) -> None:
    """Commit the plan's offsets for the group; refuses while the group has members."""
    admin = make_admin(settings)
    try:
        state, members = group_state(admin, plan.group_id)
        if members or state not in IDLE_STATES:
            raise ReplayRefused(f"group {plan.group_id} is {state} with {len(members)} member(s): stop the "
                                f"{plan.stage} workers first (their next commit would undo the rewind)")
        offsets = {p.tp: OffsetAndMetadata(p.new, "", -1) for p in plan.partitions}
        errors = admin.alter_group_offsets(plan.group_id, offsets)
        failed = {tp: err for tp, err in (errors or {}).items() if err is not None and err.__name__ != "NoError"}
        if failed:
            raise KafkaError(f"altering offsets failed: {failed}")
    finally:
        admin.close()


# --- dead letters ------------------------------------------------------------------------------


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
            else:  # dead letters written before the exact copy: text values only
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


# --- status ------------------------------------------------------------------------------------


@dataclass
class StageStatus:
    stage: str
    group_id: str
    state: str
    members: int
    lag: dict[str, int]  # topic -> end offsets - committed (uncommitted partitions count from the earliest)
    consumed_per_s: float | None = None  # over the status command's sample, when it took one

    @property
    def eta_s(self) -> float | None:
        """Seconds until the lag is consumed at the sampled rate; None without a sample or while nothing moved."""
        total = sum(self.lag.values())
        if self.consumed_per_s is None or (total and not self.consumed_per_s):
            return None
        return total / self.consumed_per_s if total else 0.0


def _stage_positions(admin: Any, stage: str, settings: Settings) -> tuple[str, Counter, int]:
    """(group, lag per topic, how far the group has got: its committed offsets summed, the earliest offset
    standing in for a partition it never committed)."""
    group_id, topics = stage_group(settings, stage)
    tps = _partitions(admin, topics)
    committed = _retry(lambda: admin.list_group_offsets({group_id: tps}))[group_id]
    earliest = admin.list_partition_offsets({tp: OffsetSpec.EARLIEST for tp in tps})
    latest = admin.list_partition_offsets({tp: OffsetSpec.LATEST for tp in tps})
    lag: Counter = Counter({t: 0 for t in topics})
    position = 0
    for tp in tps:
        meta = committed.get(tp)
        done = meta.offset if meta is not None and meta.offset >= 0 else earliest[tp].offset
        lag[tp.topic] += max(0, latest[tp].offset - done)
        position += done
    return group_id, lag, position


def pipeline_status(settings: Settings, sample_s: float = 0.0) -> tuple[list[StageStatus], Counter]:
    """Each stage's group, lag and dead letters. With sample_s > 0, also how fast each stage consumes: its committed
    offsets read twice, sample_s apart (what the workers actually got through, in the stage's own input records)."""
    admin = make_admin(settings)
    stages = []
    try:
        before = {stage: _stage_positions(admin, stage, settings)[2] for stage in STAGES} if sample_s > 0 else {}
        if sample_s > 0:
            time.sleep(sample_s)
        for stage in STAGES:
            group_id, lag, position = _stage_positions(admin, stage, settings)
            state, members = group_state(admin, group_id)
            rate = max(0, position - before[stage]) / sample_s if sample_s > 0 else None
            stages.append(StageStatus(stage, group_id, state, len(members), dict(lag), rate))
    finally:
        admin.close()
    letters: Counter = Counter()
    for _record, letter in read_dead_letters(settings):
        letters[(letter.stage, letter.error_kind) if letter else ("?", "unreadable")] += 1
    return stages, letters


# What each topic's new records mean, for `vlmstream status`'s throughput table.
THROUGHPUT_TOPICS = (("documents", "documents published"), ("images", "images decoded"),
                     ("descriptions", "images described"), ("results", "documents completed"),
                     ("deadletter", "dead letters"))


@dataclass
class TopicThroughput:
    topic: str
    meaning: str
    records: dict[int, int]  # window in seconds -> records appended in the last window (by record timestamp)
    exists: bool = True  # a topic the cluster does not have reads as zero records: said so, not shown as idle

    def per_s(self, window_s: int) -> float:
        return self.records[window_s] / window_s


def pipeline_throughput(settings: Settings, windows_s: tuple[int, ...] = (300, 3600),
                        now_ms: int | None = None) -> list[TopicThroughput]:
    """Records appended to each pipeline topic in the last windows_s seconds, from the broker's offset-by-timestamp
    index: the sustained rates of a run, with nothing to sample. Offsets count transaction markers too (a few per
    commit with infer.exactly_once)."""
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    admin = make_admin(settings)
    try:
        rows = []
        for name, meaning in THROUGHPUT_TOPICS:
            topic = getattr(settings.topics, name)
            tps = _partitions(admin, [topic])
            if not tps:
                rows.append(TopicThroughput(topic, meaning, dict.fromkeys(windows_s, 0), exists=False))
                continue
            latest = admin.list_partition_offsets({tp: OffsetSpec.LATEST for tp in tps})
            records = {}
            for window in windows_s:
                since = admin.list_partition_offsets({tp: OffsetTimestamp(now_ms - window * 1000) for tp in tps})
                records[window] = sum(latest[tp].offset - _offset_or(since.get(tp), latest[tp].offset) for tp in tps)
            rows.append(TopicThroughput(topic, meaning, records))
        return rows
    finally:
        admin.close()


def _offset_or(found: Any, default: int) -> int:
    # No record at or after the time: the broker answers -1 (or nothing), i.e. none in the window.
    return default if found is None or found.offset is None or found.offset < 0 else found.offset
