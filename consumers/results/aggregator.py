"""The results aggregator's runner: reads descriptions and dead letters, keeps each document's state
(``documents.DocumentState``) until its result has gone out and the commit point has passed its records, commits
below the first record of every open document, and exactly-once holds results for the transaction that commits past
them. The package docstring (``consumers/results/__init__.py``) says why each rule is there."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kafka import TopicPartition
from kafka.consumer.subscription_state import AsyncConsumerRebalanceListener

from consumers.results.documents import (DOWNSTREAM_STAGES, DocumentState, EmittedResult, rebuild_points,
                                         within_record_limit)
from consumers.results.ownership import SingleOwnerAssignor, results_group_id, results_transactional_id
from schemas import DeadLetter, Description, SchemaError
from vlmstream.config import Settings
from vlmstream.kafka.checkpoint import (CheckedProducer, Checkpoint, Commit, Output, bounded_client_kwargs,
                                        bounded_producer_kwargs)
from vlmstream.kafka.clients import make_consumer, make_producer, unique_client_id
from vlmstream.kafka.errors import FatalPipelineError
from vlmstream.kafka.group import GroupMembershipWatchdog, rewind, subscribe_when_known
from vlmstream.kafka.lag import FetchLag
from vlmstream.kafka.records import Record, UnreadableRecord, poll_past_unreadable

log = logging.getLogger(__name__)


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
    exit status 4. With ``infer.exactly_once`` results and offsets commit in one transaction (package docstring)."""

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
        self._docs: dict[str, DocumentState] = {}  # open, or emitted but still pinning a commit point
        self._recent: OrderedDict[str, DocumentState] = OrderedDict()  # emitted and released: for late records
        self._emitted: OrderedDict[str, EmittedResult] = OrderedDict()  # what went out, kept longer than _recent
        # Exactly-once: what _emitted said before results no transaction has committed yet, restored if none will.
        self._emitted_before: dict[str, EmittedResult | None] = {}
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

    def _doc(self, doc_id: str) -> DocumentState:
        doc = self._docs.get(doc_id)
        if doc is None:
            doc = self._recent.pop(doc_id, None) or DocumentState(doc_id)
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
        if emitted is None or not emitted.adds_nothing(image_count, image_index, source_uri, success=success,
                                                       model=model):
            return False  # a newer version, a redriven image that succeeded, a replay: it opens the document
        self.stats.late += 1
        log.info("document %s: a late %s for image %s of a result already sent; dropped", doc_id,
                 "description" if success else "dead letter", image_index)
        return True

    def _on_description(self, tp: TopicPartition, offset: int, d: Description) -> None:
        if self._late(d.doc_id, d.image_count, d.image_index, d.source_uri, success=True, model=d.model):
            return
        doc = self._doc(d.doc_id)
        doc.add_position(tp, offset)
        self._maybe_emit(doc, changed=doc.add_description(d))

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
        changed = doc.add_dead_letter(letter)
        if changed is not None:
            self._maybe_emit(doc, changed=changed)

    def _maybe_emit(self, doc: DocumentState, *, changed: bool) -> None:
        if not doc.complete() or (doc.emitted and not changed):
            return
        if doc.emitted:
            self.stats.reemitted += 1
        self._emit(doc)

    def _emit(self, doc: DocumentState, missing_kind: str | None = None) -> None:
        images = doc.outcomes(missing_kind)
        emitted = EmittedResult.of(images)
        before = self._emitted.get(doc.doc_id)
        if (before is not None and not before.succeeded <= emitted.succeeded
                and before.same_version(len(images), {i["image_index"]: i.get("source_uri") for i in images})):
            # A late record reopened a document already sent: this result would undo successes of the same version.
            log.warning("document %s: not sending a result with %d of %d images succeeded over one with %d",
                        doc.doc_id, len(emitted.succeeded), len(images), len(before.succeeded))
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
        result = doc.result(images)
        try:
            value, cut = within_record_limit(result, self.settings.kafka.max_message_bytes)
        except SchemaError as exc:
            # Raised here it would stop the aggregator on the same document after every restart. The dead letter
            # (stage "results", which this aggregator does not read back) keeps the failure visible.
            self.stats.unwritable += 1
            log.error("document %s: its result cannot be written: %s", doc.doc_id, exc)
            self._send_dead_letter(doc, "result_unwritable", str(exc))
        else:
            self.stats.texts_cut += cut
            self._output(doc, Output(self.settings.topics.results, result.key(), value, result.headers()))
        doc.emitted = True
        self._dirty = True
        self.stats.results += 1

    def _send_dead_letter(self, doc: DocumentState, error_kind: str, detail: str) -> None:
        self.stats.dead_letters_by_kind[error_kind] = self.stats.dead_letters_by_kind.get(error_kind, 0) + 1
        letter, value = doc.dead_letter(error_kind, detail)
        self._output(doc, Output(self.settings.topics.deadletter, letter.key(), value, letter.headers()))

    def _output(self, doc: DocumentState, output: Output) -> None:
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
        return rebuild_points(self._positions, self._docs.values())

    def _uncommitted(self, points: dict[TopicPartition, int]) -> tuple[dict[TopicPartition, int],
                                                                       list[DocumentState]]:
        """The commit points that moved since the last commit, and the documents no commit point holds back any
        more: they move to the recent ones (kept for late records only); exactly-once, their held outputs go out
        with these points."""
        released = [d for d in self._docs.values() if d.emitted and d.behind(points)]
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
