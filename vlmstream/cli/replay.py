"""`vlmstream replay`: rewind a stage's consumer group to a point (earliest, an offset, a time) so its workers
redo the messages after it. A plan first (what would be redone, in messages and images), then the commit of the
new offsets, refused while the group has members. Plain functions that return values; ``vlmstream/cli/ops.py``
prints them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from kafka import TopicPartition
from kafka.admin import OffsetSpec, OffsetTimestamp
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from schemas import DocumentRef, SchemaError
from vlmstream.cli.groups import (
    IDLE_STATES,
    group_state,
    retry_until_coordinator,
    stage_group,
    stage_partitions,
)
from vlmstream.config import Settings
from vlmstream.kafka.clients import make_admin, make_consumer
from vlmstream.kafka.records import poll_past_unreadable


class ReplayRefused(RuntimeError):
    """The group has live members: rewinding under them would be overwritten by their next commit."""


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
        tps = stage_partitions(admin, topics)
        committed = retry_until_coordinator(lambda: admin.list_group_offsets({group_id: tps}))[group_id]
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
    """infer: one message is one image. decode: read the documents to redo and add up their image_uris. results and
    condense: unknown (None); condense redoes one document per message."""
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
