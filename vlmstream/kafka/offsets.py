"""Out-of-order completion, in-order commits: the commit point of each partition."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Iterable

from kafka import TopicPartition


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
