"""A runner's commits when its records finish out of order (the inference runner's images, the condense runner's
documents): in-order offsets, through the checkpoint.

Completion is out of order, so an ``OffsetTracker`` per partition yields the commit point (the lowest offset still
pending). At-least-once, a record's outputs are sent as it finishes and ``Checkpoint.commit`` flushes them before
the offsets. Exactly-once, they are held until their record lies inside the committed prefix and then go out in
the transaction that commits it (``Checkpoint.commit_transaction``), so a crash never publishes them twice.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

from kafka import TopicPartition

from vlmstream.kafka.checkpoint import Checkpoint, Output
from vlmstream.kafka.offsets import OffsetTracker

log = logging.getLogger(__name__)


class DonePrefix:
    """Per partition, the records done and the outputs that wait for their commit (exactly-once)."""

    def __init__(self, checkpoint: Checkpoint, *, exactly_once: bool, commit_every: int, interval_s: float):
        self.checkpoint = checkpoint
        self.exactly_once = exactly_once
        self.commit_every = commit_every
        self.interval_s = interval_s
        self.tracker = OffsetTracker()
        self._held: dict[TopicPartition, dict[int, list[Output]]] = {}
        self._done_since_commit = 0
        self._last_commit = time.monotonic()

    def track(self, tp: TopicPartition, offset: int) -> None:
        self.tracker.track(tp, offset)

    def done(self, tp: TopicPartition, offset: int, outputs: list[Output]) -> None:
        if self.exactly_once:
            self._held.setdefault(tp, {})[offset] = outputs
        else:
            for output in outputs:
                self.checkpoint.producer.send(output)
        self.tracker.done(tp, offset)
        self._done_since_commit += 1

    def due(self) -> bool:
        return self._done_since_commit > 0 and (
            self._done_since_commit >= self.commit_every or time.monotonic() - self._last_commit >= self.interval_s)

    def _points(self) -> dict[TopicPartition, int]:
        self._done_since_commit = 0
        self._last_commit = time.monotonic()
        return self.tracker.commit_point()

    def commit(self) -> dict[TopicPartition, int]:
        """Commit the done prefix of every partition; returns the points committed."""
        points = self._points()
        if not points:
            return {}
        if self.exactly_once:
            self.checkpoint.commit_transaction(points, self._release(points))
        else:
            self.checkpoint.commit(points)
        log.debug("committed %s", {f"{tp.topic}/{tp.partition}": p for tp, p in points.items()})
        return points

    async def commit_from_listener(self) -> dict[TopicPartition, int]:
        """``commit`` from a rebalance listener, where the consumer's blocking commit is refused. A transaction
        needs no consumer call: it commits as ``commit`` does."""
        if self.exactly_once:
            return self.commit()
        points = self._points()
        await self.checkpoint.commit_from_listener(points)
        return points

    def _release(self, points: dict[TopicPartition, int]) -> list[Output]:
        """The held outputs of the records below the commit points, in offset order."""
        released: list[Output] = []
        for tp, point in points.items():
            held = self._held.get(tp, {})
            for offset in sorted(o for o in held if o < point):
                released.extend(held.pop(offset))
        return released

    def forget(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Drop the state of partitions that leave; returns where each must be read again from."""
        partitions = set(partitions)
        resume = self.tracker.resume_points(partitions)
        self.tracker.forget(partitions)
        for tp in partitions:
            self._held.pop(tp, None)
        return resume
