"""`vlmstream status`: each stage's consumer lag, group state and members, its backlog in images (the documents
topic's records converted with the image count each document carries), with a sample how fast it gets through
images, each topic's throughput over recent windows, and dead-letter counts. Plain functions that return values;
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
    consumed_per_s: float | None = None  # records, over the status command's sample, when it took one
    images: int | None = None  # the backlog in images (decode: the images its lagging documents name; infer: its lag)
    images_exact: bool = True  # False: too many documents to read in time, the count is scaled from those read
    images_per_s: float | None = None  # images it got through per second over the sample

    @property
    def eta_s(self) -> float | None:
        """Seconds until the backlog is done at the sampled rate (in images where the stage counts them); None
        without a sample or while nothing moved."""
        total, rate = sum(self.lag.values()), self.consumed_per_s
        if self.images is not None and self.images_per_s is not None:
            total, rate = self.images, self.images_per_s
        if rate is None or (total and not rate):
            return None
        return total / rate if total else 0.0


@dataclass
class _Position:
    group_id: str
    lag: Counter
    position: int  # how far the group has got: its committed offsets summed
    spans: dict  # tp -> (committed, end) for partitions with a lag
    committed: dict  # tp -> committed offset (the earliest for a partition never committed)


def _stage_positions(admin: Any, stage: str, settings: Settings) -> _Position:
    """Where a stage's group stands on its input topics; the earliest offset stands in for a partition it never
    committed (where its workers would start)."""
    group_id, topics = stage_group(settings, stage)
    tps = stage_partitions(admin, topics)
    committed = retry_until_coordinator(lambda: admin.list_group_offsets({group_id: tps}))[group_id]
    earliest = admin.list_partition_offsets({tp: OffsetSpec.EARLIEST for tp in tps})
    latest = admin.list_partition_offsets({tp: OffsetSpec.LATEST for tp in tps})
    lag: Counter = Counter({t: 0 for t in topics})
    position, spans, at = 0, {}, {}
    for tp in tps:
        meta = committed.get(tp)
        done = max(meta.offset if meta is not None and meta.offset >= 0 else 0, earliest[tp].offset)
        lag[tp.topic] += max(0, latest[tp].offset - done)
        position += done
        at[tp] = done
        if latest[tp].offset > done:
            spans[tp] = (done, latest[tp].offset)
    return _Position(group_id, lag, position, spans, at)


def pipeline_status(settings: Settings, sample_s: float = 0.0,
                    count_within_s: float = 5.0) -> tuple[list[StageStatus], Counter]:
    """Each stage's group, lag, backlog in images and dead letters. With sample_s > 0, also how fast each stage
    gets through its work: its committed offsets read twice, sample_s apart (what the workers actually got
    through), and for decode the images it published meanwhile."""
    from vlmstream.cli.backlog import count_document_images

    admin = make_admin(settings)
    stages = []
    try:
        before = {stage: _stage_positions(admin, stage, settings) for stage in STAGES} if sample_s > 0 else {}
        if sample_s > 0:
            time.sleep(sample_s)
        for stage in STAGES:
            at = _stage_positions(admin, stage, settings)
            state, members = group_state(admin, at.group_id)
            rate = max(0, at.position - before[stage].position) / sample_s if sample_s > 0 else None
            status = StageStatus(stage, at.group_id, state, len(members), dict(at.lag), rate)
            if stage == "decode":
                counted = count_document_images(settings, at.spans, count_within_s)
                status.images, status.images_exact = counted.images, counted.exact
                if sample_s > 0:  # the images of the documents it committed past during the sample
                    passed = {tp: (before["decode"].committed.get(tp, done), done)
                              for tp, done in at.committed.items() if done > before["decode"].committed.get(tp, done)}
                    status.images_per_s = count_document_images(settings, passed, count_within_s).images / sample_s
            elif stage == "infer":
                status.images, status.images_per_s = sum(at.lag.values()), rate  # one record per image
            stages.append(status)
    finally:
        admin.close()
    letters: Counter = Counter()
    for _record, letter in read_dead_letters(settings):
        letters[(letter.stage, letter.error_kind) if letter else ("?", "unreadable")] += 1
    return stages, letters


def stage_bottleneck(settings: Settings, stages: list[StageStatus]):
    """The stage that limits the pipeline now, from each stage's backlog in images: the last stage with a queue
    beyond what its members hold in work (an inference member holds up to infer.images_in_flight images)."""
    from vlmstream.projection.live import StageView, bottleneck

    by_name = {s.stage: s for s in stages}
    decode, infer = by_name.get("decode"), by_name.get("infer")
    held = infer.members * settings.infer.images_in_flight(settings.infer.batch_size) if infer else 0
    return bottleneck([
        StageView("decode", decode.images_per_s if decode else None, decode.images or 0 if decode else 0),
        StageView("inference", infer.images_per_s if infer else None, infer.images or 0 if infer else 0,
                  allowance=held),
    ])


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
