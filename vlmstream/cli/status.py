"""`vlmstream status`: each stage's consumer lag, group state and members (with a sample, how fast it consumes),
each topic's throughput over recent windows, and dead-letter counts. Plain functions that return values;
``vlmstream/cli/ops.py`` prints them.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kafka.admin import OffsetSpec, OffsetTimestamp

from vlmstream.cli.groups import (
    STAGES,
    group_state,
    retry_until_coordinator,
    stage_group,
    stage_partitions,
)
from vlmstream.cli.redrive import read_dead_letters
from vlmstream.config import Settings
from vlmstream.kafka.clients import make_admin


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
    tps = stage_partitions(admin, topics)
    committed = retry_until_coordinator(lambda: admin.list_group_offsets({group_id: tps}))[group_id]
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
                     ("summaries", "documents condensed"), ("deadletter", "dead letters"))


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
            tps = stage_partitions(admin, [topic])
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
