"""One image record on its way through the inference runner, and the bounded window that holds such records."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from kafka import TopicPartition

from schemas import ImagePayload
from vlmstream.kafka.records import Record


@dataclass
class Work:
    record: Record
    tp: TopicPartition
    meta: ImagePayload
    attempts: int = 0
    polled_at: float = field(default_factory=time.monotonic)
    submitted_at: float = 0.0
    request_id: str = ""

    @property
    def offset(self) -> int:
        return self.record.offset

    @property
    def tokens(self) -> int:
        return self.meta.visual_tokens


# The metadata of a record whose own could not be read (an unreadable record, an invalid header).
NO_META = ImagePayload(doc_id="-", image_index=0, image_count=1, source_uri="-", codec="raw", width=0, height=0,
                       grid_thw=(1, 0, 0))


class InFlightWindow:
    """The records a runner holds: fetched and waiting (``backlog``), failed and waiting to be retried (``retries``,
    a heap by due time), and in the engine (``in_flight``, by request id). What enters the engine is bounded by
    images and by visual tokens; one image over the token bound still goes in, alone."""

    def __init__(self, max_images: int, max_tokens: int):
        self.max_images = max_images
        self.max_tokens = max_tokens
        self.backlog: deque[Work] = deque()
        self.retries: list[tuple[float, int, Work]] = []
        self.in_flight: dict[str, Work] = {}
        self.tokens = 0  # visual tokens in the engine
        self._seq = itertools.count()

    def has_work(self) -> bool:
        return bool(self.backlog or self.retries or self.in_flight)

    def waiting(self) -> bool:
        """Records that could go to the engine once there is room or their retry is due."""
        return bool(self.backlog or self.retries)

    def full(self) -> bool:
        """No more fetching: records wait, or the engine holds as many images as it may."""
        return bool(self.backlog) or len(self.in_flight) >= self.max_images

    def free(self) -> int:
        return self.max_images - len(self.in_flight)

    def room(self, tokens: int) -> bool:
        if not self.in_flight:
            return True  # one image larger than the token bound must still get through, alone
        return len(self.in_flight) < self.max_images and self.tokens + tokens <= self.max_tokens

    def admissible(self, now: float) -> Iterator[Work]:
        """Due retries first, then the backlog, while there is room; ``start`` each one that goes to the engine."""
        while self.retries and self.retries[0][0] <= now and self.room(self.retries[0][2].tokens):
            yield heapq.heappop(self.retries)[2]
        while self.backlog and self.room(self.backlog[0].tokens):
            yield self.backlog.popleft()

    def start(self, work: Work) -> None:
        self.in_flight[work.request_id] = work
        self.tokens += work.tokens

    def finish(self, request_id: str) -> Work | None:
        """The work of a finished request, or None when its partition was dropped meanwhile."""
        work = self.in_flight.pop(request_id, None)
        if work is not None:
            self.tokens -= work.tokens
        return work

    def retry(self, work: Work, due: float) -> None:
        heapq.heappush(self.retries, (due, next(self._seq), work))

    def next_retry_in(self, now: float) -> float | None:
        return max(0.0, self.retries[0][0] - now) if self.retries else None

    def holds(self, partitions: set[TopicPartition] | None) -> bool:
        """Any work of ``partitions`` (of any partition with None) still to finish."""
        pool = list(self.in_flight.values()) + [w for _, _, w in self.retries] + list(self.backlog)
        return any(partitions is None or w.tp in partitions for w in pool)

    def drop(self, partitions: Iterable[TopicPartition]) -> None:
        """Forget the work of ``partitions``: their next owner redoes it from the commit point."""
        partitions = set(partitions)
        for rid in [rid for rid, w in self.in_flight.items() if w.tp in partitions]:
            self.finish(rid)
        self.backlog = deque(w for w in self.backlog if w.tp not in partitions)
        self.retries = [r for r in self.retries if r[2].tp not in partitions]
        heapq.heapify(self.retries)
