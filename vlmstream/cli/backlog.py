"""What `vlmstream run` finds queued ahead of its documents, and how its stages move while it waits.

The documents and images topics are shared by every run that uses the same cluster and topic names (the local
broker keeps its data under the user's cache folder, for every checkout). Records an earlier run published and no
worker has processed yet are the decode and inference groups' lag: a new run's workers join those groups and take
the older records first. ``measure_backlog`` counts them in images; ``StageProbe`` reads the groups' committed
offsets again every few seconds for the run's progress lines; ``RateMemory`` keeps the last run's inference rate on
this machine, so a backlog can be given a duration before this run's inference has started.
"""

from __future__ import annotations

import json
import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka import TopicPartition
from kafka.admin import OffsetSpec
from kafka.protocol.consumer import IsolationLevel

from schemas import document_image_count
from vlmstream.cli.groups import group_state, retry_until_coordinator, stage_partitions
from vlmstream.config import Settings
from vlmstream.kafka.clients import make_admin, make_consumer
from vlmstream.kafka.records import poll_past_unreadable


@dataclass
class Backlog:
    """Records below the topics' end offsets at the run's start that the stages' groups have not committed past."""

    decode_group: str
    infer_group: str
    documents_topic: str
    images_topic: str
    documents: int  # documents on the documents topic not yet decoded
    document_images: int  # images those documents name (estimated from those read in time unless images_counted)
    images: int  # decoded images on the images topic not yet described
    images_counted: bool = True  # False: reading the queued documents ran out of time; document_images is scaled
    ends: dict[TopicPartition, int] = field(default_factory=dict)  # end offsets when measured

    @property
    def images_ahead(self) -> int:
        return self.images + self.document_images

    def notice(self, rate: RememberedRate | None) -> str | None:
        """What `run` prints first when anything is queued ahead (a headline, then where it waits); None when
        nothing is."""
        if not self.images and not self.documents:
            return None
        floor = "" if self.images_counted else "about "
        if rate is not None and rate.images_per_s > 0:
            how_long = (f"about {self.images_ahead / rate.images_per_s:.0f} s at {rate.images_per_s:.2f} img/s, the "
                        f"last run's inference rate here at {rate.pixels_note()}; larger images take longer")
        else:
            how_long = "how long: the progress lines say once inference moves; no earlier rate is known here"
        parts = []
        if self.images:
            parts.append(f"{self.images} decoded on {self.images_topic} not yet described by group {self.infer_group}")
        if self.documents:
            named = f"{self.document_images}{'' if self.images_counted else ', estimated from those read,'} images"
            parts.append(f"{self.documents} documents ({named}) on {self.documents_topic} not yet decoded by group "
                         f"{self.decode_group}")
        return (f"{floor}{self.images_ahead} images from earlier runs are queued ahead of yours ({how_long})\n"
                f"  {'; '.join(parts)}")


def measure_backlog(settings: Settings, count_within_s: float = 3.0) -> Backlog:
    """The decode group's lag on the documents topic (and the images those documents name, read within
    count_within_s) and the inference group's lag on the images topic. A partition a group never committed counts
    from its earliest offset, where the group's workers would start (auto_offset_reset=earliest)."""
    t = settings.topics
    admin = make_admin(settings)
    try:
        docs = _lag(admin, settings.decode.group_id, t.documents)
        images = _lag(admin, settings.infer.group_id, t.images)
    finally:
        admin.close()
    ends = {tp: end for tp, (_start, end) in {**docs, **images}.items()}
    counted = count_document_images(settings, docs, count_within_s)
    return Backlog(settings.decode.group_id, settings.infer.group_id, t.documents, t.images,
                   documents=sum(end - start for start, end in docs.values()), document_images=counted.images,
                   images=sum(end - start for start, end in images.values()), images_counted=counted.exact,
                   ends=ends)


def _lag(admin: Any, group_id: str, topic: str) -> dict[TopicPartition, tuple[int, int]]:
    """tp -> (where the group resumes, end offset), for the partitions with records the group has not committed."""
    tps = stage_partitions(admin, [topic])
    if not tps:
        return {}
    committed = retry_until_coordinator(lambda: admin.list_group_offsets({group_id: tps}))[group_id]
    earliest = admin.list_partition_offsets({tp: OffsetSpec.EARLIEST for tp in tps})
    latest = admin.list_partition_offsets({tp: OffsetSpec.LATEST for tp in tps})
    lag = {}
    for tp in tps:
        meta = committed.get(tp)
        start = meta.offset if meta is not None and meta.offset >= 0 else earliest[tp].offset
        start = max(start, earliest[tp].offset)  # records past retention are gone, not queued
        if latest[tp].offset > start:
            lag[tp] = (start, latest[tp].offset)
    return lag


@dataclass
class ImageCount:
    """Images named by a span of documents-topic records: counted exactly (``exact``) or, when reading them all ran
    out of time, extrapolated from the documents read (``documents_read`` of ``documents``)."""

    images: int
    documents: int
    documents_read: int
    exact: bool
    # Per partition, (offset, images) of each document read, and the offset it was read up to.
    by_record: dict[TopicPartition, list[tuple[int, int]]] = field(default_factory=dict)
    read_to: dict[TopicPartition, int] = field(default_factory=dict)

    def describe(self) -> str:
        if self.exact:
            return f"{self.images} images"
        return (f"about {self.images} images (estimated from {self.documents_read} of {self.documents} documents "
                "read)")


def count_document_images(settings: Settings, spans: dict[TopicPartition, tuple[int, int]],
                          within_s: float) -> ImageCount:
    """Images named by the documents in spans (tp -> [start, end) offsets), read without a group: each record's
    ``vlmstream-images`` header, or its value for a writer that does not set one. Past within_s, the count read so
    far is scaled to the whole span and marked not exact."""
    wanted = sum(end - start for start, end in spans.values())
    if not spans:
        return ImageCount(0, 0, 0, True)
    consumer = make_consumer(settings, None)
    images, seen = 0, 0
    by_record: dict[TopicPartition, list[tuple[int, int]]] = {tp: [] for tp in spans}
    read_to = {tp: start for tp, (start, _end) in spans.items()}
    try:
        consumer.assign(list(spans))
        for tp, (start, _end) in spans.items():
            consumer.seek(tp, start)
        deadline = time.monotonic() + within_s
        done: set[TopicPartition] = set()
        while len(done) < len(spans) and time.monotonic() < deadline:
            for tp, records in poll_past_unreadable(consumer, timeout_ms=200).items():
                for record in records:
                    if record.offset >= spans[tp][1]:
                        continue
                    seen += 1
                    count = document_image_count(record.headers, record.value) or 0  # None: decode dead-letters it
                    images += count
                    by_record[tp].append((record.offset, count))
            for tp, (_start, end) in spans.items():
                read_to[tp] = min(end, consumer.position(tp))
            done = {tp for tp, (_start, end) in spans.items() if read_to[tp] >= end}
    finally:
        consumer.close()
    # Offsets count transaction markers too, so "every partition read to its end" is the test, not seen == wanted.
    if len(done) == len(spans) or seen >= wanted:
        return ImageCount(images, seen, seen, True, by_record, read_to)
    return ImageCount(round(images * wanted / seen) if seen else 0, wanted, seen, False, by_record, read_to)


# --- while the run waits ---------------------------------------------------------------------------------------


@dataclass
class StageSnapshot:
    at: float
    documents_waiting: int  # on the documents topic, not yet committed by the decode group
    images_waiting: int  # on the images topic (its last stable offsets), not yet committed by the inference group
    images_published: int  # the images topic's end offsets, summed
    described: int  # the inference group's committed offsets on the images topic, summed
    earlier_ahead: int  # of the backlog measured at the start: images records not yet committed past
    earlier_documents: int  # and documents not yet committed past
    infer_members: int
    # Images decode has still to put out: those the documents it has not committed past name, less those it already
    # published for them (see StageProbe; scaled from the documents read, past 1 s).
    document_images_waiting: int = 0
    decode_done: int = 0  # images decode put out since the first reading (see StageProbe)
    infer_done: int = 0  # images records the inference group committed past since the first reading
    rewound: tuple[str, ...] = ()  # the stages whose group committed offsets lower than at the last reading


class _PartitionImages:
    """One documents partition's image counts from the probe's first offset there on, each document's read once.
    Those below the decode group's committed offset are kept as one sum: a view that follows a long run holds the
    counts of the documents waiting only."""

    def __init__(self, start: int):
        self.start = start  # where the decode group stood at the first reading (or was rewound to)
        self.read_to = start
        self.kept_from = start  # the documents in [start, kept_from) are summed in images_below
        self.images_below = 0.0
        self.offsets: list[int] = []  # of the documents read from kept_from on
        self.upto: list[int] = [0]  # upto[i]: the images of the first i of them
        self.documents_read = 0
        self.images_read = 0

    def add(self, rows: list[tuple[int, int]], read_to: int) -> None:
        for offset, images in rows:
            self.offsets.append(offset)
            self.upto.append(self.upto[-1] + images)
            self.documents_read += 1
            self.images_read += images
        self.read_to = max(self.read_to, read_to)

    def images(self, low: int, high: int, per_document: float) -> float:
        """Images of the documents at offsets [low, high) (low: the start, or at least kept_from): those read, and
        the rest at per_document each."""
        below = 0.0
        if low < self.kept_from:
            below, low = self.images_below, self.kept_from
        i, j = bisect_left(self.offsets, low), bisect_left(self.offsets, high)
        return below + self.upto[j] - self.upto[i] + max(0, high - max(low, self.read_to)) * per_document

    def fold(self, offset: int, per_document: float) -> None:
        """Sum the documents below offset into images_below (those not read yet at per_document: reading goes on
        from offset)."""
        if offset <= self.kept_from:
            return
        self.images_below = self.images(self.start, offset, per_document)
        i = bisect_left(self.offsets, offset)
        base = self.upto[i]
        self.offsets = self.offsets[i:]
        self.upto = [images - base for images in self.upto[i:]]
        self.kept_from = offset
        self.read_to = max(self.read_to, offset)


class StageProbe:
    """Reads the stages' groups and topics every few seconds: what is waiting where, how much each stage did since
    the first reading, and how fast inference commits (over the last minute), for the run's progress lines.

    Decode's total is fixed by the producers: the images named by the documents from where its group stood at the
    first reading to the topic's end (each document's count read once from its header). Its done images are those of
    the documents it committed past, plus those it already published for the documents it has not committed past
    yet: it commits after its outputs are durable, in batches (a poll's documents), so its committed offsets trail
    what it put out, and those images would otherwise count as done and as waiting. They are the images published
    on the images topic since the first reading beyond those the documents it committed past since then name, and
    at most what it has waiting: whatever that count misses (images it dead-lettered, or published twice when a
    worker died before committing; those already out at the first reading) moves images between its done and
    waiting until it commits past their documents, never its total. With exactly-once decode, images are on the
    topic (below its last stable offset, which is what is read here) only once their documents are committed past.

    Inference counts the images records its group committed past; its total adds the images on the topic it has
    not, and those decode has still to put out. A rewound group (a replay) counts from where it was rewound to: its
    documents or images wait again, counted once, and its done count starts again."""

    def __init__(self, settings: Settings, backlog: Backlog | None = None):
        self.settings = settings
        self.backlog = backlog
        self.admin = make_admin(settings)
        self.history: deque[StageSnapshot] = deque(maxlen=64)
        self.first: StageSnapshot | None = None
        self._documents: dict[TopicPartition, _PartitionImages] = {}
        self._decode_at: dict[TopicPartition, int] = {}  # the decode group's committed offsets at the last reading
        self._decoded = 0.0  # images of the documents it committed past since the first reading, every pass counted
        self._infer_start: dict[TopicPartition, int] = {}
        self._infer_at: dict[TopicPartition, int] = {}

    def close(self) -> None:
        self.admin.close()

    def snapshot(self) -> StageSnapshot:
        t, admin = self.settings.topics, self.admin
        doc_tps, image_tps = stage_partitions(admin, [t.documents]), stage_partitions(admin, [t.images])
        latest = admin.list_partition_offsets({tp: OffsetSpec.LATEST for tp in doc_tps})
        latest.update(admin.list_partition_offsets({tp: OffsetSpec.LATEST for tp in image_tps},
                                                   isolation_level=IsolationLevel.READ_COMMITTED))
        earliest = admin.list_partition_offsets({tp: OffsetSpec.EARLIEST for tp in doc_tps + image_tps})
        decode = retry_until_coordinator(lambda: admin.list_group_offsets({self.settings.decode.group_id: doc_tps}))
        infer = retry_until_coordinator(lambda: admin.list_group_offsets({self.settings.infer.group_id: image_tps}))
        decode = decode[self.settings.decode.group_id]
        infer = infer[self.settings.infer.group_id]

        def done(committed: dict, tp: TopicPartition) -> int:
            meta = committed.get(tp)
            return meta.offset if meta is not None and meta.offset >= 0 else earliest[tp].offset

        ends = self.backlog.ends if self.backlog else {}
        snap = StageSnapshot(
            at=time.monotonic(),
            documents_waiting=sum(max(0, latest[tp].offset - done(decode, tp)) for tp in doc_tps),
            images_waiting=sum(max(0, latest[tp].offset - done(infer, tp)) for tp in image_tps),
            images_published=sum(latest[tp].offset for tp in image_tps),
            described=sum(done(infer, tp) for tp in image_tps),
            earlier_ahead=sum(max(0, ends[tp] - done(infer, tp)) for tp in image_tps if tp in ends),
            earlier_documents=sum(max(0, ends[tp] - done(decode, tp)) for tp in doc_tps if tp in ends),
            infer_members=len(group_state(admin, self.settings.infer.group_id)[1]),
        )
        self._count_decode(snap, {tp: done(decode, tp) for tp in doc_tps}, {tp: latest[tp].offset for tp in doc_tps})
        infer_at = {tp: done(infer, tp) for tp in image_tps}
        for tp, at in infer_at.items():
            if tp not in self._infer_start or at < self._infer_at.get(tp, at):
                self._infer_start[tp] = at  # first seen, or rewound: counted from there
            snap.infer_done += at - self._infer_start[tp]
        if any(at < self._infer_at.get(tp, at) for tp, at in infer_at.items()):
            snap.rewound += ("inference",)
        self._infer_at = infer_at
        if not self.settings.decode.exactly_once:  # what it published for the documents not committed past yet
            published = snap.images_published - (self.first or snap).images_published
            out = max(0, min(published - round(self._decoded), snap.document_images_waiting))
            snap.decode_done += out
            snap.document_images_waiting -= out
        self.first = self.first or snap
        self.history.append(snap)
        return snap

    def _count_decode(self, snap: StageSnapshot, at: dict[TopicPartition, int], ends: dict[TopicPartition, int]):
        """The images named by the documents decode committed past since the first reading, and by those it has
        not, from its committed offsets (``at``) and each document's image count: read once per document (up to a
        second per reading, continued at the next); those not read yet at the mean of those read."""
        for tp, offset in at.items():
            if tp not in self._documents or offset < self._documents[tp].kept_from:
                self._documents[tp] = _PartitionImages(offset)  # first seen, or rewound: counted from there
        unread = {tp: (p.read_to, ends[tp]) for tp, p in self._documents.items() if ends.get(tp, 0) > p.read_to}
        if unread:
            counted = count_document_images(self.settings, unread, within_s=1.0)
            for tp, rows in counted.by_record.items():
                self._documents[tp].add(rows, counted.read_to[tp])
        read = sum(p.documents_read for p in self._documents.values())
        per_document = sum(p.images_read for p in self._documents.values()) / read if read else 0.0
        done = waiting = passed = 0.0
        for tp, offset in at.items():
            counts = self._documents[tp]
            done += counts.images(counts.start, offset, per_document)
            waiting += counts.images(offset, ends[tp], per_document)
            if offset > self._decode_at.get(tp, offset):
                passed += counts.images(self._decode_at[tp], offset, per_document)
            counts.fold(offset, per_document)
        if any(offset < self._decode_at.get(tp, offset) for tp, offset in at.items()):
            snap.rewound += ("decode",)
        self._decode_at = dict(at)
        self._decoded += passed
        snap.decode_done, snap.document_images_waiting = round(done), round(waiting)

    def infer_rate(self, window_s: float = 60.0) -> float | None:
        """Images the inference group committed per second over the last window_s, counted from the last reading
        before it first moved in that window (so the model's loading is not in it); None before it ever moved."""
        if len(self.history) < 2:
            return None
        last = self.history[-1]
        window = [s for s in self.history if last.at - s.at <= window_s]
        start = 0
        while start + 1 < len(window) and window[start + 1].described == window[0].described:
            start += 1
        base = window[start]
        if base is last:
            moved = any(s.described != self.history[0].described for s in self.history)
            return 0.0 if moved else None
        return (last.described - base.described) / (last.at - base.at)


class LiveView:
    """Per stage, a progress line from the probe's readings (images done since the view started / done + waiting,
    the sustained rate over a sliding window, an ETA range, drift), and which stage limits the run; StageProbe says
    what each stage's images done and waiting are."""

    def __init__(self, probe: StageProbe, window_s: float = 60.0):
        from vlmstream.projection.live import StageMeter

        self.probe = probe
        self.decode = StageMeter("decode", window_s)
        self.infer = StageMeter("inference", window_s)
        self.waits: deque[tuple[float, int]] = deque(maxlen=64)  # (at, images waiting for inference)
        self.last: StageSnapshot | None = None

    def update(self) -> StageSnapshot:
        snap = self.probe.snapshot()
        self.last = snap
        for meter, done in ((self.decode, snap.decode_done), (self.infer, snap.infer_done)):
            if meter.name in snap.rewound:  # a replay: its done count, and its rate, start again
                meter.restart()
            meter.observe(snap.at, done)
        self.waits.append((snap.at, snap.images_waiting))
        return snap

    def totals(self) -> tuple[int, int]:
        """(decode's, inference's) images in all: done since the view started plus what waits for each (for
        inference, on the images topic and still to come from decode)."""
        snap = self.last
        if snap is None:
            return 0, 0
        decode = self.decode.done + snap.document_images_waiting
        return decode, self.infer.done + snap.images_waiting + snap.document_images_waiting

    def bottleneck(self):
        from vlmstream.projection.live import StageView, bottleneck

        snap = self.last
        if snap is None:
            return None
        window = [w for at, w in self.waits if snap.at - at <= self.infer.window_s]
        growing = len(window) >= 3 and window[-1] > window[0] and window[-1] >= max(window) * 0.9
        held = snap.infer_members * self.probe.settings.infer.images_in_flight(self.probe.settings.infer.batch_size)
        return bottleneck([
            StageView("decode", self.decode.rate(), snap.document_images_waiting),
            StageView("inference", self.infer.rate(), snap.images_waiting, allowance=held, growing=growing),
        ])

    def lines(self) -> list[str]:
        from vlmstream.projection.live import progress_line

        decode_total, infer_total = self.totals()
        lines = [progress_line(self.decode, decode_total), progress_line(self.infer, infer_total)]
        if (neck := self.bottleneck()) is not None:
            lines.append(f"bottleneck: {neck.why}")
        return lines


# --- the last run's rate ---------------------------------------------------------------------------------------


@dataclass
class RememberedRate:
    images_per_s: float
    max_pixels: int
    model: str

    def pixels_note(self) -> str:
        return f"{self.max_pixels / 1e6:.1f} MP per image with {Path(self.model).name or self.model}"


class RateMemory:
    """One small JSON file under the broker's home: the inference rate the last `vlmstream run` measured."""

    def __init__(self, settings: Settings):
        self.path = Path(settings.broker.home).expanduser() / "run-rate.json"

    def load(self) -> RememberedRate | None:
        try:
            data = json.loads(self.path.read_text())
            return RememberedRate(float(data["images_per_s"]), int(data["max_pixels"]), str(data["model"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, rate: RememberedRate) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rate.__dict__))
            tmp.replace(self.path)
        except OSError:
            pass  # a remembered rate is a convenience; a read-only cache must not fail the run
