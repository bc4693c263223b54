"""The document-result aggregator: descriptions + dead letters in, one DocumentResult per document out.

A document is complete when every image index in ``range(image_count)`` has a description or a dead
letter (a description wins over a dead letter of the same image: a redriven image may succeed later). A record
with another image count, or another source URI at an index, is a newer version of the document (the producer
republished it changed) and replaces what the result said.
A dead letter with a doc_id but no image_index is a document-level failure (the decode stage could not
read the document): it completes the document at once, every image without an outcome is marked failed
with that error, and the error is kept in ``metadata["document_error"]``. When such a failure does not say
how many images the document has, ``image_count`` is the number of images seen so far (often 0): the
result still exists, and ``metadata["document_error"]`` says why it is empty.

State survives restarts without an external store. Per (topic, partition) the committed offset never
passes the first record of a document that is still open, so a restart re-reads and rebuilds it. A
document already emitted also holds the commit back while any of its records would be re-read, so a
restart never rebuilds half of a finished document (it would stay open forever); the price is that a
crash can emit a document's result twice (topic ``results`` is compacted by doc_id: the copies agree).

Exactly-once (``infer.exactly_once``): a finished document's result is held back until the commit point has passed
every record of it, and then goes out in the Kafka transaction that commits that point (``Checkpoint
.commit_transaction``: results, their dead letters and the consumed offsets, all or nothing). A restart rebuilds
only documents whose results no committed transaction carries, so a read_committed reader sees each result once.
The price is latency: a finished document waits for the open documents below it on the partitions they share (at
most ``open_timeout_s``). Only the owner of the partitions holds a transactional producer, with one
transactional id per group (``results_transactional_id``): a new owner's ``init_transactions`` fences the last one
(a process killed or stopped mid-transaction: its open transaction is aborted, its later commits refused) and only
then reads the committed offsets to rebuild from. A transaction that fails mid-run (fenced, the group moved on, the
cluster slow) ends the ownership term: its results were never visible, the state is dropped and rebuilt from the
committed offsets by the next term, which may be this process's again.

Late records (a duplicate from at-least-once redelivery, a redriven image, a late dead letter) can arrive after a
document left memory (``_docs``, then the ``recent_docs`` LRU). Such a record would open the document again with
that one image, and ``open_timeout_s`` later a partial result would replace the complete one in the compacted topic.
So every emitted result leaves a compact record (``_Emitted``: image count, a 4-byte hash of each image's source
URI, the set of indexes that succeeded) in a second LRU of ``emitted_docs`` entries (200,000 by default, about
50 MB), and:

* a record of the same version (same image count, no other source URI at a known index) that cannot add a success
  (a description of an image that already succeeded, by the model that described the result; any dead letter) is
  dropped before it opens the document;
* a result of the same version that lacks a success already emitted is never sent (``stats.stale``); a redriven
  success of a document forgotten this way is kept out too (the old result stays);
* another image count or another source URI at an index is a newer version: it is emitted, and replaces the record.

A description by another model than the one that described an image before is a replay with that model (topics
replayed into an inference group running a new checkpoint): it replaces that image's entry and the result is sent
again. A document still in memory is re-sent as each image's new description arrives (the compacted topic keeps the
last); a forgotten one opens again and is sent once every image has an outcome again (a partial one times out as
stale, above, and the old result stays).

The record does not survive a restart (nor, exactly-once, the end of an ownership term): after one, a late record
of a document emitted before it can still produce a partial result ``open_timeout_s`` later (reading the compacted
results topic back would close that window).

Descriptions and dead letters are keyed by doc_id, but the dead-letter topic usually has fewer
partitions, so one document's records are spread over two partitions that no assignor can co-locate.
The group therefore gives every partition to one member (``SingleOwnerAssignor``); other members are
hot standbys. Aggregation is JSON parsing of small records, far from being a bottleneck.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator

from kafka import TopicPartition
from kafka.coordinator.assignors.abstract import (AbstractPartitionAssignor, ConsumerProtocolAssignment,
                                                  ConsumerProtocolSubscription)
from kafka.consumer.subscription_state import AsyncConsumerRebalanceListener

from schemas import DeadLetter, Description, DocumentResult, SchemaError, now
from vlmstream.config import Settings
from vlmstream.kafka.checkpoint import (CheckedProducer, Checkpoint, Commit, Output, bounded_client_kwargs,
                                        bounded_producer_kwargs)
from vlmstream.kafka.clients import make_consumer, make_producer, unique_client_id
from vlmstream.kafka.errors import FatalPipelineError
from vlmstream.kafka.group import GroupMembershipWatchdog, rewind, subscribe_when_known
from vlmstream.kafka.lag import FetchLag
from vlmstream.kafka.records import Record, UnreadableRecord, poll_past_unreadable

log = logging.getLogger(__name__)


# Dead letters that note something about an image that was still decoded and described: not a failure of it.
NOTES = ("pages_not_described",)
# Dead letters of this aggregator and of the stages that read its results: not about an image of the document.
DOWNSTREAM_STAGES = ("results", "condense")


def results_group_id(settings: Settings) -> str:
    return f"{settings.infer.group_id}-results"


def results_transactional_id(group_id: str) -> str:
    """One per aggregator group, whose single owner holds every partition: each new owner fences the one before."""
    return f"{group_id}-txn"


class SingleOwnerAssignor(AbstractPartitionAssignor):
    """Every subscribed partition to one member (the lowest member id); the rest stand by."""

    name = "vlmstream-single-owner"
    version = 0
    # Set when this process, as group leader, assigned a topic it knew no partitions of. kafka-python should then
    # rejoin once metadata arrives, but kafka-python 3.0 can leave the aggregator holding an empty assignment for
    # good; the aggregator checks this and rejoins itself.
    assigned_without_partitions = threading.Event()

    @classmethod
    def assign(cls, cluster, members):
        owner = min(members, key=lambda m: (m.group_instance_id is None, m.group_instance_id or "", m.member_id))
        topics = sorted({t for m in members for t in m.metadata.topics})
        owned = [(t, sorted(cluster.partitions_for_topic(t) or ())) for t in topics]
        if any(not partitions for _, partitions in owned):
            cls.assigned_without_partitions.set()
        return {m.member_id: ConsumerProtocolAssignment(cls.version, owned if m is owner else [], b"")
                for m in members}

    @classmethod
    def metadata(cls, topics):
        return ConsumerProtocolSubscription(cls.version, list(topics), b"")

    @classmethod
    def on_assignment(cls, assignment, generation):
        pass


@dataclass
class _Doc:
    doc_id: str
    image_count: int | None = None
    images: dict[int, dict[str, Any]] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    document_error: dict[str, Any] | None = None
    # error_kind -> image index -> detail: what an earlier stage noted about an image that did not fail
    notes: dict[str, dict[int, str]] = field(default_factory=dict)
    first: dict[TopicPartition, int] = field(default_factory=dict)  # lowest offset of its records per partition
    last: dict[TopicPartition, int] = field(default_factory=dict)
    opened_at: float = field(default_factory=time.monotonic)
    emitted: bool = False
    held: list[Output] = field(default_factory=list)  # exactly-once: its outputs, until a transaction carries them

    def add_position(self, tp: TopicPartition, offset: int) -> None:
        self.first[tp] = min(self.first.get(tp, offset), offset)
        self.last[tp] = max(self.last.get(tp, offset), offset)

    def is_new_version(self, count: int | None) -> bool:
        """Whether a record's image count differs from the one known: a newer version of the document (the producer
        republished it with other images), which replaces what the result said. Records the count as known."""
        new_version = None not in (self.image_count, count) and self.image_count != count
        if count is not None:
            self.image_count = count
        return new_version

    def complete(self) -> bool:
        if self.document_error is not None:
            return True
        return self.image_count is not None and all(i in self.images for i in range(self.image_count))


def _short_hash(text: str | None) -> bytes:
    """4 bytes for a source URI or a model name; zeros for none."""
    return hashlib.blake2b(text.encode(), digest_size=4).digest() if text else b"\0\0\0\0"


MIXED_MODELS = b"mixed"  # five bytes: never a 4-byte hash


@dataclass(frozen=True, slots=True)
class _Emitted:
    """What the last result emitted for a document said, compactly: enough to tell a late record of the same
    version (which must not make the result worse) from a newer version (which replaces it)."""

    image_count: int
    uri_hashes: bytes  # 4 bytes per index, zeros where the source URI is unknown
    succeeded: frozenset[int]
    model_hash: bytes  # the model that described every image that succeeded; MIXED_MODELS where they differ

    @classmethod
    def of(cls, images: list[dict[str, Any]]) -> "_Emitted":
        models = {i.get("model") for i in images if i["status"] == "ok"}
        model_hash = _short_hash(models.pop()) if len(models) == 1 else MIXED_MODELS
        return cls(len(images), b"".join(_short_hash(i.get("source_uri")) for i in images),
                   frozenset(i["image_index"] for i in images if i["status"] == "ok"), model_hash)

    def described_by(self, model: str | None) -> bool:
        """Whether every image that succeeded was described by ``model``: a description by another one is a
        replay with that model, which may replace the result, not a duplicate."""
        return self.model_hash == _short_hash(model)

    def same_version(self, image_count: int | None, uris: dict[int, str | None]) -> bool:
        """No other image count, and no other source URI at an index both know."""
        if image_count is not None and image_count != self.image_count:
            return False
        zero = b"\0\0\0\0"
        for index, uri in uris.items():
            if not 0 <= index < self.image_count:
                return False
            known = self.uri_hashes[4 * index:4 * index + 4]
            if uri and known != zero and known != _short_hash(uri):
                return False
        return True


@dataclass
class AggregatorStats:
    records: int = 0
    results: int = 0
    reemitted: int = 0
    timed_out: int = 0
    late: int = 0  # records of a document already emitted and forgotten, that could not improve its result: dropped
    stale: int = 0  # results not sent: fewer successes than the one already emitted for the same version
    skipped: int = 0
    texts_cut: int = 0  # results over the record limit, sent with their descriptions' texts shortened
    unwritable: int = 0  # results that could not be written at all, dead-lettered instead
    commits: int = 0
    terms: int = 0  # exactly-once: ownership terms begun (each with a fresh transactional producer)
    terms_ended: int = 0  # exactly-once: terms ended by a failed transaction or by the partitions moving
    dead_letters_by_kind: dict[str, int] = field(default_factory=dict)


class ResultsAggregator:
    """``run(stop_event, max_seconds=None, until_idle_s=None)`` in a thread or its own process.

    Once stopped it takes at most 3 x ``kafka.request_timeout_ms`` whether or not the cluster answers (flush and
    commit, leaving the group, closing the producer); a result the cluster did not acknowledge means no commit and
    exit status 4. With ``infer.exactly_once`` results and offsets commit in one transaction (module docstring)."""

    def __init__(self, settings: Settings, *, group_id: str | None = None, commit_interval_s: float = 1.0,
                 open_timeout_s: float = 3600.0, recent_docs: int = 10_000, emitted_docs: int = 200_000):
        self.settings = settings
        self.group_id = group_id or results_group_id(settings)
        self.commit_interval_s = commit_interval_s
        self.open_timeout_s = open_timeout_s
        self.recent_docs = recent_docs
        self.emitted_docs = emitted_docs
        self.exactly_once = settings.infer.exactly_once
        self.transactional_id = results_transactional_id(self.group_id)
        self.stats = AggregatorStats()
        self.lag = FetchLag()
        self._docs: dict[str, _Doc] = {}  # open, or emitted but still pinning a commit point
        self._recent: OrderedDict[str, _Doc] = OrderedDict()  # emitted and released: for late records
        self._emitted: OrderedDict[str, _Emitted] = OrderedDict()  # what went out, kept longer than _recent
        # Exactly-once: what _emitted said before results no transaction has committed yet, restored if none will.
        self._emitted_before: dict[str, _Emitted | None] = {}
        self._positions: dict[TopicPartition, int] = {}  # next offset to read, per partition consumed
        self._committed: dict[TopicPartition, int] = {}
        self._dirty = False
        self.last_record_at = time.monotonic()
        self._assigned = False
        self.open_at_stop = 0
        self.exit_code: int | None = None  # run()'s, once it has returned
        self.consumer = None
        self.producer = None
        self.sender: CheckedProducer | None = None  # the producer, raising a failed send from flush()
        self.checkpoint: Checkpoint | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def run(self, stop_event: threading.Event | None = None, max_seconds: float | None = None,
            until_idle_s: float | None = None) -> int:
        stop_event = stop_event or threading.Event()
        started = last_record = last_commit = time.monotonic()
        client_id = unique_client_id(self.settings, "results")
        membership = GroupMembershipWatchdog(self.settings, self.group_id, client_id)
        self.consumer = make_consumer(self.settings, self.group_id, (), client_id=client_id,
                                      partition_assignment_strategy=(SingleOwnerAssignor,),
                                      # Failover is not latency-critical here; a loaded host must not evict it.
                                      session_timeout_ms=30_000, **bounded_client_kwargs(self.settings))
        if not self.exactly_once:
            self._open_checkpoint(make_producer(self.settings, **bounded_producer_kwargs(self.settings)))
        # else: a transactional producer per ownership term (_begin_term), made once partitions are assigned
        t = self.settings.topics
        code = 0
        try:
            subscribe_when_known(self.consumer, [t.descriptions, t.deadletter], listener=_Rebalance(self),
                                 should_stop=stop_event.is_set)
            while not stop_event.is_set():
                clock = time.monotonic()
                if max_seconds is not None and clock - started >= max_seconds:
                    break
                if until_idle_s is not None and self._assigned and clock - last_record >= until_idle_s:
                    break
                batches = poll_past_unreadable(self.consumer, timeout_ms=200)
                self.lag.observe(self.consumer, batches)
                assigned = self.consumer.assignment()
                if not self._assigned and assigned:
                    self._assigned, last_record = True, time.monotonic()  # idle counts from the first assignment
                if not batches and not assigned:
                    # A standby member (or one not yet assigned): poll returns at once without partitions, and
                    # looping on it would burn a core.
                    stop_event.wait(0.2)
                    if SingleOwnerAssignor.assigned_without_partitions.is_set():
                        self._rejoin_with_partitions()
                if membership.left_out(assigned):  # a standby too must still be a member
                    self._rejoin_with_partitions()
                if self.exactly_once and assigned and self.checkpoint is None:
                    # Records read before the fence may start past what the last owner committed at the end.
                    batches = {}
                    if not self._begin_term(assigned):
                        stop_event.wait(1.0)
                        continue
                for tp, records in batches.items():
                    for record in records:
                        self.handle(tp, record)
                        last_record = self.last_record_at = time.monotonic()
                if time.monotonic() - last_commit >= self.commit_interval_s:
                    self._expire_open_docs()
                    self._commit_or_end_term()
                    last_commit = time.monotonic()
            self.commit()
        except FatalPipelineError as exc:
            log.error("results aggregator stopping without committing: %s", exc)
            code = 4
        except Exception:  # noqa: BLE001 - in a thread an exception would vanish; say it and stop
            log.exception("results aggregator failed; stopping without committing")
            code = 1
        finally:
            if code and self.checkpoint is not None:
                self.checkpoint.stop()  # closing revokes the partitions: the listener must not commit either
            self.open_at_stop = self.open_documents()  # closing revokes the partitions and clears the state
            try:
                self.consumer.close(autocommit=False)
            finally:
                if self.sender is not None:  # exactly-once, the revoke at close ends the term and closes it first
                    self.sender.close(flushed=not code)
            self.exit_code = code
        return code

    def start_thread(self, stop_event: threading.Event, **kwargs: Any) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(stop_event,), kwargs=kwargs, name="results-aggregator",
                                  daemon=True)
        thread.start()
        return thread

    # --- checkpoint and ownership terms ---------------------------------------------------------

    def _open_checkpoint(self, producer) -> None:
        self.producer = producer
        self.sender = CheckedProducer(producer, flush_timeout_s=self.settings.kafka.request_timeout_ms / 1000)
        self.checkpoint = Checkpoint(self.consumer, self.sender, name="results")

    def _begin_term(self, assigned: set[TopicPartition]) -> bool:
        """Exactly-once, on becoming the owner: fence every earlier owner, then rebuild from the committed offsets.
        False (to be tried again) when the cluster did not answer in time."""
        producer = None
        try:
            producer = make_producer(self.settings, transactional_id=self.transactional_id,
                                     **bounded_producer_kwargs(self.settings))
            # Aborts the last owner's open transaction, or waits until it has finished; its later commits are refused.
            producer.init_transactions()
            # Read only now: a transaction of the last owner may have committed offsets until the fence.
            committed = {tp: self.consumer.committed(tp) for tp in assigned}
        except Exception as exc:  # noqa: BLE001 - the cluster is away or busy: try again from the next poll
            log.warning("results: could not take over as %s (%r); trying again", self.transactional_id, exc)
            if producer is not None:
                producer.close(timeout=0)
            return False
        self._drop_state()
        for tp, offset in committed.items():
            if offset is None:
                self.consumer.seek_to_beginning(tp)
            else:
                self.consumer.seek(tp, offset)
        self._open_checkpoint(producer)
        self.stats.terms += 1
        log.info("results: owner of %d partition(s), exactly-once as %s", len(assigned), self.transactional_id)
        return True

    def _end_term(self, why: str) -> None:
        """Exactly-once: nothing more goes out under this term; what it did not commit is redone by the next."""
        if self.checkpoint is not None:
            log.info("results: ownership term ends (%s); rebuilding from the committed offsets next term", why)
            self.checkpoint.stop()
            self.sender.close(flushed=False)  # no transaction is left open between commits
            self.stats.terms_ended += 1
        self.producer = self.sender = self.checkpoint = None
        self._drop_state()

    def _drop_state(self) -> None:
        self._docs.clear()
        self._recent.clear()
        self._positions.clear()
        self._committed.clear()
        for doc_id, before in self._emitted_before.items():  # results no transaction committed never went out
            if before is None:
                self._emitted.pop(doc_id, None)
            else:
                self._emitted[doc_id] = before
        self._emitted_before.clear()

    # --- records -----------------------------------------------------------------------------

    def handle(self, tp: TopicPartition, record: Record) -> None:
        self.stats.records += 1
        self._positions[tp] = record.offset + 1
        if isinstance(record, UnreadableRecord):
            self.stats.skipped += 1
            log.warning("skipping %s/%d@%d: %s", tp.topic, tp.partition, record.offset, record.error)
            return
        try:
            if tp.topic == self.settings.topics.descriptions:
                self._on_description(tp, record.offset, Description.decode(record.value))
            else:
                self._on_dead_letter(tp, record.offset, DeadLetter.decode(record.value))
        except SchemaError as exc:
            # Not ours to dead-letter again (a dead letter about a dead letter loops); count and move on.
            self.stats.skipped += 1
            log.warning("skipping %s/%d@%d: %s", tp.topic, tp.partition, record.offset, exc)

    def _doc(self, doc_id: str) -> _Doc:
        doc = self._docs.get(doc_id)
        if doc is None:
            doc = self._recent.pop(doc_id, None) or _Doc(doc_id)
            doc.first, doc.last = {}, {}
            self._docs[doc_id] = doc
        return doc

    def _late(self, doc_id: str, image_count: int | None, image_index: int | None, source_uri: str | None, *,
              success: bool, model: str | None = None) -> bool:
        """Whether a record is of a document emitted and forgotten (not in ``_docs`` or ``_recent``), of the same
        version, and cannot add a success to its result: then it is dropped instead of opening the document."""
        if doc_id in self._docs or doc_id in self._recent:
            return False
        emitted = self._emitted.get(doc_id)
        if emitted is None:
            return False
        uris = {} if image_index is None else {image_index: source_uri}
        if not emitted.same_version(image_count, uris):
            return False
        if success and (image_index not in emitted.succeeded or not emitted.described_by(model)):
            return False  # a redriven image that succeeded, or a replay with another model: it opens the document
        self.stats.late += 1
        log.info("document %s: a late %s for image %s of a result already sent; dropped", doc_id,
                 "description" if success else "dead letter", image_index)
        return True

    def _on_description(self, tp: TopicPartition, offset: int, d: Description) -> None:
        if self._late(d.doc_id, d.image_count, d.image_index, d.source_uri, success=True, model=d.model):
            return
        doc = self._doc(d.doc_id)
        doc.add_position(tp, offset)
        new_version = doc.is_new_version(d.image_count)  # another source URI at an index (below) is one too
        # A PDF page's text layer belongs to its image; the rest of the metadata is the document's.
        shared = {key: value for key, value in d.metadata.items() if key != "page_text"}
        if shared:
            doc.metadata = {**shared, **doc.metadata}
        before = doc.images.get(d.image_index)
        doc.images[d.image_index] = {"image_index": d.image_index, "status": "ok", "source_uri": d.source_uri,
                                     "text": d.text, "model": d.model}
        if isinstance(d.metadata.get("page_text"), str) and d.metadata["page_text"]:
            doc.images[d.image_index]["page_text"] = d.metadata["page_text"]
        # Another model's description of an image is a replay with that model: the result says so, image by image.
        self._maybe_emit(doc, changed=before is None or before.get("status") != "ok" or new_version
                         or before.get("source_uri") != d.source_uri or before.get("model") != d.model)

    def _on_dead_letter(self, tp: TopicPartition, offset: int, letter: DeadLetter) -> None:
        if letter.doc_id is None or letter.stage in DOWNSTREAM_STAGES:
            # Nothing to attribute it to, or a failure after the result (reopening the document would loop through
            # the stage that failed); it still counts as read.
            self.stats.skipped += 1
            return
        if self._late(letter.doc_id, letter.image_count, letter.image_index, letter.source_uri, success=False):
            return
        doc = self._doc(letter.doc_id)
        doc.add_position(tp, offset)
        new_version = doc.is_new_version(letter.image_count)
        failure = {"status": "failed", "source_uri": letter.source_uri, "stage": letter.stage,
                   "error_kind": letter.error_kind, "detail": letter.detail[:1000]}
        if letter.error_kind in NOTES and letter.image_index is not None:
            # The image itself was decoded and is on its way; only the note goes into the result's metadata. The
            # two topics are read in no fixed order: a note after the result has gone out sends it again.
            notes = doc.notes.setdefault(letter.error_kind, {})
            changed = notes.get(letter.image_index) != letter.detail[:1000]
            notes[letter.image_index] = letter.detail[:1000]
            if doc.emitted:
                self._maybe_emit(doc, changed=changed)
            return
        if letter.image_index is None:
            changed = doc.document_error is None
            doc.document_error = {k: failure[k] for k in ("stage", "error_kind", "detail")}
            self._maybe_emit(doc, changed=changed)
            return
        before = doc.images.get(letter.image_index)
        if before is not None and before["status"] == "ok" and letter.source_uri in (None, before.get("source_uri")):
            return  # the image succeeded on another try: its dead letter is history
        doc.images[letter.image_index] = {"image_index": letter.image_index, **failure}
        self._maybe_emit(doc, changed=before is None or new_version or before.get("source_uri") != letter.source_uri)

    def _maybe_emit(self, doc: _Doc, *, changed: bool) -> None:
        if not doc.complete() or (doc.emitted and not changed):
            return
        if doc.emitted:
            self.stats.reemitted += 1
        self._emit(doc)

    def _emit(self, doc: _Doc, missing_kind: str | None = None) -> None:
        count = doc.image_count
        if count is None:
            count = max(doc.images, default=-1) + 1
        images = []
        for index in range(count):
            entry = doc.images.get(index)
            if entry is None:
                error = doc.document_error or {"stage": "results", "error_kind": missing_kind or "missing",
                                               "detail": "no description or dead letter arrived for this image"}
                entry = {"image_index": index, "status": "failed", "source_uri": None, **error}
            images.append(entry)
        emitted = _Emitted.of(images)
        before = self._emitted.get(doc.doc_id)
        if (before is not None and not before.succeeded <= emitted.succeeded
                and before.same_version(count, {i["image_index"]: i.get("source_uri") for i in images})):
            # A late record reopened a document already sent: this result would undo successes of the same version.
            log.warning("document %s: not sending a result with %d of %d images succeeded over one with %d",
                        doc.doc_id, len(emitted.succeeded), count, len(before.succeeded))
            self.stats.stale += 1
            doc.emitted = True
            return
        doc.held = []  # exactly-once: this result replaces one not yet carried by a transaction
        if self.exactly_once and doc.doc_id not in self._emitted_before:
            self._emitted_before[doc.doc_id] = before
        self._emitted[doc.doc_id] = emitted
        self._emitted.move_to_end(doc.doc_id)
        while len(self._emitted) > self.emitted_docs:
            self._emitted.popitem(last=False)
        succeeded = sum(1 for i in images if i["status"] == "ok")
        metadata = dict(doc.metadata)
        if doc.document_error is not None:
            metadata["document_error"] = doc.document_error
        for kind, by_image in doc.notes.items():
            metadata[kind] = {str(index): detail for index, detail in sorted(by_image.items())}
        result = DocumentResult(doc_id=doc.doc_id, image_count=count, succeeded=succeeded,
                                failed=len(images) - succeeded, images=tuple(images), metadata=metadata,
                                completed_at=now())
        try:
            value = self._within_record_limit(result)
        except SchemaError as exc:
            # Raised here it would stop the aggregator on the same document after every restart. The dead letter
            # (stage "results", which this aggregator does not read back) keeps the failure visible.
            self.stats.unwritable += 1
            log.error("document %s: its result cannot be written: %s", doc.doc_id, exc)
            self._send_dead_letter(doc, "result_unwritable", str(exc))
        else:
            self._output(doc, Output(self.settings.topics.results, result.key(), value, result.headers()))
        doc.emitted = True
        self._dirty = True
        self.stats.results += 1

    def _within_record_limit(self, result: DocumentResult) -> bytes:
        """The result's bytes; over the record limit (forty long descriptions can be), the texts are cut to share
        what fits, each marked so. The descriptions topic keeps every text whole."""
        value = result.encode()
        limit = self.settings.kafka.max_message_bytes - 64 * 1024  # headers and the record's own framing
        if len(value) <= limit:
            return value
        marker = " [cut: the whole text is on the descriptions topic]"
        texts = [(i.get("text") or "").encode() for i in result.images]
        share = max(0, (limit - (len(value) - sum(map(len, texts)))) // max(1, len(texts)) - len(marker))
        for _ in range(4):  # bytes of text, not characters; JSON escapes can still add some: shrink and retry
            images = tuple({**i, "text": t[:share].decode(errors="ignore") + marker} if len(t) > share else i
                           for i, t in zip(result.images, texts))
            value = dataclasses.replace(result, images=images).encode()
            if len(value) <= limit or share <= 0:
                break
            share = max(0, int(share * limit / len(value)) - 1)
        if len(value) > limit:
            raise SchemaError("document_result", "(message)", f"{len(value)} bytes even with its texts cut, "
                              f"over kafka.max_message_bytes")
        self.stats.texts_cut += 1
        return value

    def _send_dead_letter(self, doc: _Doc, error_kind: str, detail: str) -> None:
        self.stats.dead_letters_by_kind[error_kind] = self.stats.dead_letters_by_kind.get(error_kind, 0) + 1
        letter = DeadLetter(stage="results", error_kind=error_kind, detail=detail[:4000], doc_id=doc.doc_id,
                            image_count=doc.image_count, created_at=now())
        try:
            value = letter.encode()
        except SchemaError:  # the document's own id or count is what cannot be written: name it in the detail
            letter = DeadLetter(stage="results", error_kind=error_kind, created_at=now(),
                                detail=f"document {doc.doc_id[:200]!r} (count {doc.image_count}): {detail}"[:4000])
            value = letter.encode()
        self._output(doc, Output(self.settings.topics.deadletter, letter.key(), value, letter.headers()))

    def _output(self, doc: _Doc, output: Output) -> None:
        """At-least-once: send now (the next commit flushes it). Exactly-once: hold it for the transaction that
        commits past every record of the document (``commit``); a newer result of it replaces it meanwhile."""
        if self.exactly_once:
            doc.held.append(output)
        else:
            self.sender.send(output)

    def _expire_open_docs(self) -> None:
        """A document open for ``open_timeout_s`` holds its partitions' commits back; emit what is known
        (missing images as failed, error_kind ``result_timeout``) so the pipeline moves on."""
        deadline = time.monotonic() - self.open_timeout_s
        for doc in list(self._docs.values()):
            if not doc.emitted and doc.opened_at < deadline:
                log.warning("document %s open for over %.0f s with %d of %s image outcomes: emitting it",
                            doc.doc_id, self.open_timeout_s, len(doc.images), doc.image_count)
                self.stats.timed_out += 1
                self._emit(doc, missing_kind="result_timeout")

    # --- commits -----------------------------------------------------------------------------

    def commit_points(self) -> dict[TopicPartition, int]:
        """Per partition, the offset from which a restart rebuilds every document it would see in full."""
        points = dict(self._positions)
        for doc in self._docs.values():
            if not doc.emitted:
                for tp, first in doc.first.items():
                    points[tp] = min(points.get(tp, first), first)
        moved = True
        while moved:  # emitted documents that a restart would partly re-read pin all their records
            moved = False
            for doc in self._docs.values():
                if doc.emitted and any(last >= points.get(tp, last + 1) for tp, last in doc.last.items()):
                    for tp, first in doc.first.items():
                        if first < points.get(tp, first + 1):
                            points[tp] = first
                            moved = True
        return points

    def _uncommitted(self, points: dict[TopicPartition, int]) -> tuple[dict[TopicPartition, int], list[_Doc]]:
        """The commit points that moved since the last commit, and the documents no commit point holds back any
        more: they move to the recent ones (kept for late records only); exactly-once, their held outputs go out
        with these points."""
        released = [d for d in self._docs.values()
                    if d.emitted and all(last < points.get(tp, last + 1) for tp, last in d.last.items())]
        for doc in released:
            self._recent[doc.doc_id] = self._docs.pop(doc.doc_id)
            while len(self._recent) > self.recent_docs:
                self._recent.popitem(last=False)
        return {tp: p for tp, p in points.items() if self._committed.get(tp) != p}, released

    def _committed_at(self, changed: dict[TopicPartition, int], outcome: Commit) -> dict[TopicPartition, int]:
        if outcome is not Commit.DONE:
            return {}  # refused: the next owner rebuilds from the last commit (duplicate results at most)
        self._committed.update(changed)
        self.stats.commits += 1
        return changed

    def commit(self) -> dict[TopicPartition, int]:
        """Flush the results, raise on a failed send, commit the points that moved (``Checkpoint.commit``).
        Exactly-once: the released documents' results and the points in one transaction; raises
        ``FatalPipelineError`` when it fails (nothing of it is visible)."""
        if self.checkpoint is None:
            return {}  # exactly-once and not the owner: nothing read, nothing to commit
        changed, released = self._uncommitted(self.commit_points())
        if self.exactly_once:
            outputs = [output for doc in released for output in doc.held]
            if not changed and not outputs:
                return {}
            self.checkpoint.commit_transaction(changed, outputs)
            for doc in released:
                doc.held = []
                self._emitted_before.pop(doc.doc_id, None)
            return self._committed_at(changed, Commit.DONE)
        if not changed and not self._dirty:
            return {}
        outcome = self.checkpoint.commit(changed)
        self._dirty = False
        return self._committed_at(changed, outcome)

    def _commit_or_end_term(self) -> None:
        """``commit`` from the run loop. Exactly-once a failed transaction ends the term instead of the run: the
        next term fences it and rebuilds from what did commit (its outcome may be unknown after a timeout)."""
        if not self.exactly_once:
            self.commit()
            return
        try:
            self.commit()
        except FatalPipelineError as exc:
            log.warning("results: %s", exc)
            self._end_term("the transaction failed")

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Commit before the partitions move, from the rebalance listener, then forget every open document.
        Exactly-once: end the term without committing (its successor redoes at most ``commit_interval_s``)."""
        if self.exactly_once:
            self._end_term("partitions revoked")
            return
        points = self.commit_points()
        changed, _ = self._uncommitted(points)
        try:
            self._committed_at(changed, await self.checkpoint.commit_from_listener(changed))
        except FatalPipelineError as exc:
            # Nothing is committed; the run loop's next commit raises the same failure (it stays) and stops.
            log.error("results: not committing on revoke: %s", exc)
        self._forget(revoked, points)

    def _forget(self, partitions: set[TopicPartition], points: dict[TopicPartition, int]) -> None:
        # Documents span partitions; whatever we keep would be rebuilt from the commit points anyway, which is
        # where every partition, also one that comes straight back to us, must then be read from.
        self._docs.clear()
        rewind(self.consumer, {tp: points[tp] for tp in partitions if tp in points})
        for tp in partitions:
            self._positions.pop(tp, None)
            self._committed.pop(tp, None)

    def _rejoin_with_partitions(self) -> None:
        if SingleOwnerAssignor.assigned_without_partitions.is_set():
            log.warning("results: the group was assigned before the topics' partitions were known; rejoining")
        SingleOwnerAssignor.assigned_without_partitions.clear()
        t = self.settings.topics
        self.consumer.unsubscribe()
        subscribe_when_known(self.consumer, [t.descriptions, t.deadletter], listener=_Rebalance(self))

    def open_documents(self) -> int:
        # A copy first (one step under the GIL): the metrics endpoint calls this from its own thread.
        return sum(1 for d in list(self._docs.values()) if not d.emitted)


class AggregatorCollector:
    """Prometheus collector over one ``ResultsAggregator``'s stats, read at scrape time (served by the process it runs
    in: `vlmstream infer`'s endpoint)."""

    def __init__(self, aggregator: ResultsAggregator):
        self.aggregator = aggregator

    def collect(self) -> Iterator[Any]:
        from vlmstream import metrics

        stats = self.aggregator.stats
        yield from metrics.counters((
            ("vlmstream_results_records", "Description and dead-letter records read.", stats.records),
            ("vlmstream_results_documents", "Document results published (a document completed, or timed out).",
             stats.results),
            ("vlmstream_results_reemitted", "Results published again for a document already emitted (a redriven or "
             "late image improved it).", stats.reemitted),
            ("vlmstream_results_timed_out", "Documents published with their missing images failed, after waiting "
             "open too long.", stats.timed_out),
            ("vlmstream_results_late", "Records of a document already emitted and forgotten: dropped.", stats.late),
            ("vlmstream_results_skipped", "Records that could not be read.", stats.skipped),
            ("vlmstream_results_commits", "Offset commits (or transactions) completed.", stats.commits),
        ))
        yield metrics.dead_letters("vlmstream_results_dead_letters", "Results dead-lettered, by error kind.",
                                   stats.dead_letters_by_kind)
        yield from metrics.gauges((
            ("vlmstream_results_open_documents", "Documents not yet published (images still to come).",
             self.aggregator.open_documents()),
            ("vlmstream_results_lag_records", "Description and dead-letter records on this aggregator's "
             "partitions not yet fetched.", self.aggregator.lag.total),
        ))


class _Rebalance(AsyncConsumerRebalanceListener):
    """Commit before the partitions move (kafka-python 3 runs this on its IO thread: ``Checkpoint``
    ``.commit_from_listener``)."""

    def __init__(self, aggregator: ResultsAggregator):
        self.aggregator = aggregator

    async def on_partitions_revoked(self, revoked):
        await self.aggregator.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned):
        log.info("results: assigned %d partition(s)", len(assigned))

    async def on_partitions_lost(self, lost):
        if self.aggregator.exactly_once:
            self.aggregator._end_term("partitions lost")
        else:
            self.aggregator._forget(set(lost), self.aggregator.commit_points())
