"""The condense consumer: results topic in, one DocumentSummary per document out; owns the Kafka clients.

One thread drives everything: fetch results, build each document's prompt (``stage.Condenser``), submit as capacity
frees (no batch barrier), poll finished answers in any order, check them against the answer schema, publish the
summary or the dead letter, commit. The engine never sees Kafka; this module never runs a model.

A record of the results topic is a whole document, so each partition commits below its lowest open document
(``vlmstream.kafka.done_prefix``): at-least-once, a summary is sent as its answer arrives and the checkpoint flushes it
before the offsets; with ``condense.exactly_once`` summaries and dead letters wait for their record to lie inside the
committed prefix and go out in the transaction that commits it, so a crash never publishes one twice.

Versions. The results topic is keyed (and compacted) by doc_id, so one document's results arrive in order on one
partition, newest last; the summaries topic is compacted by doc_id too, so the last summary written is the one that
stays. The runner keeps that the newest version's:

* a result whose document has a newer result fetched already is never published (``stats.superseded``), even when
  its answer finishes later than the newer one's;
* a result older than the one last summarised or still open (its ``completed_at`` earlier: a late copy, a redriven
  record) is dropped (``stats.stale``); one that says exactly what was last summarised (same fingerprint) is not
  summarised again (``stats.unchanged``). Both are remembered for ``recent_docs`` documents and not across a restart: a restart
  re-reads from the commit point in offset order, so the newest version is still summarised last.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

from kafka import TopicPartition
from kafka.consumer.subscription_state import AsyncConsumerRebalanceListener

from consumers.condense.engine import CondenseEngine, CondenseFailure, CondenseOutput, CondenseRequest
from consumers.condense.stage import AnswerViolation, CondensePrompt, CondenseProblem, Condenser, result_fingerprint
from schemas import DocumentResult, DocumentSummary, SchemaError, now
from vlmstream.config import Settings
from vlmstream.kafka.checkpoint import (CheckedProducer, Checkpoint, Output, bounded_client_kwargs,
                                        bounded_producer_kwargs)
from vlmstream.kafka.clients import make_consumer, make_producer, unique_client_id
from vlmstream.kafka.done_prefix import DonePrefix
from vlmstream.kafka.errors import FatalPipelineError
from vlmstream.kafka.group import GroupMembershipWatchdog, rewind, subscribe_when_known
from vlmstream.kafka.lag import FetchLag
from vlmstream.kafka.records import Record, UnreadableRecord, dead_letter_from_record, poll_past_unreadable
from vlmstream.queued_engine import EngineDeadError

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_DEAD = 3
EXIT_PIPELINE_FATAL = 4
REBALANCE_POLL_MS = 200


@dataclass
class CondenseStats:
    records: int = 0
    summaries: int = 0
    dead_lettered: int = 0
    retries: int = 0
    superseded: int = 0  # answers not published: a newer result of the document was fetched meanwhile
    stale: int = 0  # results older than the one last summarised: dropped
    unchanged: int = 0  # results saying exactly what was last summarised: not summarised again
    cut: int = 0  # prompts whose descriptions were cut to the context budget
    commits: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    engine_s: float = 0.0  # summarised documents' time from submission to answer, summed
    dead_letters_by_kind: dict[str, int] = field(default_factory=dict)
    run_s: float = 0.0


@dataclass
class _Doc:
    """A result record on its way: fetched, maybe waiting for a retry, or in the engine."""

    tp: TopicPartition
    record: Record
    result: DocumentResult
    prompt: CondensePrompt
    fingerprint: str
    fetched_at: float = field(default_factory=time.monotonic)
    attempts: int = 0
    not_before: float = 0.0
    request_id: str | None = None
    submitted_at: float = 0.0
    superseded: bool = False

    @property
    def offset(self) -> int:
        return self.record.offset


class CondenseRunner:
    """Consumer group over the results topic feeding one condense engine. ``run()`` returns an exit code."""

    def __init__(self, settings: Settings, engine: CondenseEngine, condenser: Condenser, *,
                 group_id: str | None = None, commit_interval_s: float = 1.0, stop_drain_s: float = 120.0,
                 transactional_id: str | None = None, retry_backoff_s: float = 0.2, recent_docs: int = 100_000):
        self.settings = settings
        self.cfg = settings.condense
        self.engine = engine
        self.condenser = condenser
        self.group_id = group_id or self.cfg.group_id
        self.commit_interval_s = commit_interval_s
        self.stop_drain_s = stop_drain_s
        self.retry_backoff_s = retry_backoff_s
        self.recent_docs = recent_docs
        self.exactly_once = self.cfg.exactly_once
        self.transactional_id = transactional_id or (
            f"{self.group_id}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self.max_in_flight = self.cfg.documents_in_flight(engine.batch_size)
        self.stats = CondenseStats()
        self.lag = FetchLag()
        self._backlog: deque[_Doc] = deque()  # fetched (or to retry), not in the engine
        self._in_engine: dict[str, _Doc] = {}
        self._newest: dict[str, _Doc] = {}  # per document, the newest result fetched and still open
        self._summarised: OrderedDict[str, tuple[float | None, str]] = OrderedDict()  # (completed_at, fingerprint)
        self._rebalancing = True
        self._assigned = False
        self._last_activity = time.monotonic()
        self._fatal: BaseException | None = None
        self.consumer = None
        self.producer = None
        self.sender: CheckedProducer | None = None
        self.checkpoint: Checkpoint | None = None
        self.commits: DonePrefix | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def run(self, stop_event: threading.Event | None = None, max_seconds: float | None = None,
            until_idle_s: float | None = None) -> int:
        stop_event = stop_event or threading.Event()
        if stop_event.is_set():
            return EXIT_OK
        started = self._last_activity = time.monotonic()
        self._assigned, self._rebalancing = False, True  # idle counts from this run's first assignment
        self.producer = make_producer(self.settings, transactional_id=self.transactional_id if self.exactly_once
                                      else None, **({"transaction_timeout_ms": 15_000} if self.exactly_once else {}),
                                      **bounded_producer_kwargs(self.settings))
        if self.exactly_once:
            self.producer.init_transactions()
        client_id = unique_client_id(self.settings, "condense")
        self._membership = GroupMembershipWatchdog(self.settings, self.group_id, client_id)
        self.consumer = make_consumer(self.settings, self.group_id, (), client_id=client_id,
                                      max_poll_records=max(1, min(self.max_in_flight, 500)),
                                      session_timeout_ms=self.cfg.session_timeout_ms,
                                      **bounded_client_kwargs(self.settings))
        self.sender = CheckedProducer(self.producer, flush_timeout_s=self.settings.kafka.request_timeout_ms / 1000)
        self.checkpoint = Checkpoint(self.consumer, self.sender, name="condense runner")
        self.commits = DonePrefix(self.checkpoint, exactly_once=self.exactly_once,
                                  commit_every=max(1, self.max_in_flight), interval_s=self.commit_interval_s)
        code, committed = EXIT_OK, False
        try:
            self._subscribe(stop_event)
            self._loop(stop_event, started, max_seconds, until_idle_s)
            self._drain(time.monotonic() + self.stop_drain_s)
            self._commit()
            committed = True
        except EngineDeadError as exc:
            log.error("condense engine died, stopping without committing: %s", exc)
            code = EXIT_ENGINE_DEAD
            self.checkpoint.stop()
        except FatalPipelineError as exc:
            log.error("condense: stopping without committing: %s", exc)
            code = EXIT_PIPELINE_FATAL
            self.checkpoint.stop()
        finally:
            self.stats.run_s = time.monotonic() - started
            self._close(committed)
        log.info("condense runner stopped: CondenseStats %s", json.dumps(asdict(self.stats)))
        return code

    def _close(self, committed: bool) -> None:
        try:
            self.consumer.close(autocommit=False)
        except Exception:  # noqa: BLE001 - best effort; the broker times the member out
            log.exception("closing the consumer failed")
        try:
            self.sender.close(flushed=committed)
        except Exception:  # noqa: BLE001
            log.exception("closing the producer failed")

    def _subscribe(self, stop_event: threading.Event) -> None:
        subscribe_when_known(self.consumer, [self.settings.topics.results], listener=_Rebalance(self),
                             should_stop=stop_event.is_set)

    # --- the loop ----------------------------------------------------------------------------

    def _loop(self, stop_event: threading.Event, started: float, max_seconds: float | None,
              until_idle_s: float | None) -> None:
        while not stop_event.is_set():
            if self._fatal is not None:
                raise self._fatal
            clock = time.monotonic()
            if max_seconds is not None and clock - started >= max_seconds:
                return
            if (until_idle_s is not None and self._assigned and not self._open()
                    and clock - self._last_activity >= until_idle_s):
                return
            fetched = self._fetch(stop_event)
            self._admit()
            self._poll_engine(0.0 if fetched else 0.05)
            if self.commits.due():
                self._commit()

    def _open(self) -> int:
        return len(self._backlog) + len(self._in_engine)

    @property
    def open_documents(self) -> int:
        """Documents fetched and not yet answered (read from a metrics thread: a count, never the collections)."""
        return self._open()

    def _fetch(self, stop_event: threading.Event) -> int:
        assigned = self.consumer.assignment()
        if self._open() >= self.max_in_flight:
            # Paused partitions keep the member alive (poll still runs the group protocol) without fetching.
            to_pause = [tp for tp in assigned if tp not in self.consumer.paused()]
            if to_pause:
                self.consumer.pause(*to_pause)
            self.consumer.poll(timeout_ms=REBALANCE_POLL_MS if self._rebalancing else 0)
            return 0
        paused = self.consumer.paused()
        if paused:
            self.consumer.resume(*paused)
        timeout_ms = 0 if self.engine.pending() else 100
        if self._rebalancing:
            timeout_ms = max(timeout_ms, REBALANCE_POLL_MS)
        batches = poll_past_unreadable(self.consumer, timeout_ms=timeout_ms,
                                       max_records=max(1, self.max_in_flight - self._open()))
        self.lag.observe(self.consumer, batches)
        if not batches and not assigned and not self._open():
            time.sleep(timeout_ms / 1000)  # without partitions poll returns at once
        fetched = 0
        for tp, records in batches.items():
            for record in records:
                self._accept(tp, record)
                fetched += 1
        if self._membership.left_out(assigned):
            self.consumer.unsubscribe()
            self._subscribe(stop_event)
        return fetched

    def _accept(self, tp: TopicPartition, record: Record) -> None:
        self.stats.records += 1
        self._last_activity = time.monotonic()
        self.commits.track(tp, record.offset)
        if isinstance(record, UnreadableRecord):
            self._dead_letter(tp, record, None, "unreadable_record", record.error)
            return
        try:
            result = DocumentResult.decode(record.value)
        except SchemaError as exc:
            self._dead_letter(tp, record, None, "invalid_message", str(exc))
            return
        fingerprint = result_fingerprint(result)
        known = self._summarised.get(result.doc_id)
        if known is not None:
            completed_at, last_fingerprint = known
            if None not in (completed_at, result.completed_at) and result.completed_at < completed_at:
                self.stats.stale += 1
                log.info("document %s: a result older than the one summarised (%s < %s); dropped", result.doc_id,
                         result.completed_at, completed_at)
                self.commits.done(tp, record.offset, [])
                return
            if last_fingerprint == fingerprint:
                self.stats.unchanged += 1
                self.commits.done(tp, record.offset, [])
                return
        older = self._newest.get(result.doc_id)
        if older is not None and _completed_before(result, older.result):
            self.stats.stale += 1  # a late copy of an older version behind a newer one still open
            self.commits.done(tp, record.offset, [])
            return
        if older is not None:
            older.superseded = True  # its answer, whenever it comes, is not published (even if this one fails)
            del self._newest[result.doc_id]
        prompt = self.condenser.prompt(result)
        if isinstance(prompt, CondenseProblem):
            self._dead_letter(tp, record, result, prompt.error_kind, prompt.detail)
            return
        doc = _Doc(tp, record, result, prompt, fingerprint)
        self._newest[result.doc_id] = doc
        self._backlog.append(doc)

    def _admit(self) -> None:
        requests: list[CondenseRequest] = []
        waiting: deque[_Doc] = deque()
        clock = time.monotonic()
        while self._backlog and len(self._in_engine) + len(requests) < self.max_in_flight:
            doc = self._backlog.popleft()
            if doc.superseded:
                self._finish(doc, [])
                self.stats.superseded += 1
                continue
            if doc.not_before > clock:
                waiting.append(doc)
                continue
            doc.attempts += 1
            doc.request_id = f"{doc.tp.topic}/{doc.tp.partition}/{doc.offset}#{doc.attempts}"
            doc.submitted_at = clock
            self._in_engine[doc.request_id] = doc
            requests.append(CondenseRequest(doc.request_id, doc.prompt.token_ids, self.cfg.max_new_tokens))
        self._backlog.extendleft(reversed(waiting))
        if requests:
            self.engine.submit(requests)

    def _poll_engine(self, timeout_s: float) -> None:
        if self.engine.pending() == 0:
            timeout_s = 0.0  # still asked: a dead engine stops the runner before it fetches more
        for out in self.engine.poll(timeout_s):
            doc = self._in_engine.pop(out.request_id, None)
            if doc is None:
                continue  # its partition left us: the next owner redoes it
            self._last_activity = time.monotonic()
            if isinstance(out, CondenseFailure):
                self._failed(doc, out)
            else:
                self._answered(doc, out)

    # --- outcomes ----------------------------------------------------------------------------

    def _answered(self, doc: _Doc, out: CondenseOutput) -> None:
        if doc.superseded:
            self.stats.superseded += 1
            self._finish(doc, [])
            return
        try:
            answer = self.condenser.answer(out.text)
        except AnswerViolation as exc:
            detail = str(exc)
            if out.finish_reason == "length":
                detail = f"cut at condense.max_new_tokens ({self.cfg.max_new_tokens}): {detail}"
            self._dead_letter(doc.tp, doc.record, doc.result, exc.error_kind, detail, attempts=doc.attempts,
                              doc=doc)
            return
        result = doc.result
        timings = {k: float(v) for k, v in out.timings_ms.items()}
        timings["total_ms"] = round((time.monotonic() - doc.fetched_at) * 1000, 3)
        summary = DocumentSummary(
            doc_id=result.doc_id, answer=answer, answer_schema_id=self.condenser.answer_schema.schema_id,
            result={"topic": doc.tp.topic, "partition": doc.tp.partition, "offset": doc.offset,
                    "completed_at": result.completed_at, "fingerprint": doc.fingerprint,
                    "image_count": result.image_count, "succeeded": result.succeeded},
            model=self.engine.model_id, revision=self.engine.revision, engine=self.engine.name,
            prompt_id=self.cfg.prompt_id, images_used=doc.prompt.images_used, cut=doc.prompt.cut,
            prompt_tokens=out.prompt_tokens, output_tokens=out.output_tokens, timings_ms=timings,
            metadata=dict(result.metadata), created_at=now())
        try:
            value = summary.encode()
        except SchemaError as exc:
            # Raised, it would stop the runner on the same record after every restart.
            self._dead_letter(doc.tp, doc.record, result, "output_invalid", str(exc), doc=doc)
            return
        self.stats.summaries += 1
        self.stats.engine_s += max(0.0, time.monotonic() - doc.submitted_at) if doc.submitted_at else 0.0
        self.stats.cut += doc.prompt.cut is not None
        self.stats.prompt_tokens += out.prompt_tokens
        self.stats.output_tokens += out.output_tokens
        self._summarised[result.doc_id] = (result.completed_at, doc.fingerprint)
        self._summarised.move_to_end(result.doc_id)
        while len(self._summarised) > self.recent_docs:
            self._summarised.popitem(last=False)
        self._finish(doc, [Output(self.settings.topics.summaries, summary.key(), value, summary.headers())])

    def _failed(self, doc: _Doc, failure: CondenseFailure) -> None:
        if failure.retriable and doc.attempts < self.cfg.max_attempts and not doc.superseded:
            self.stats.retries += 1
            doc.not_before = time.monotonic() + self.retry_backoff_s * 2 ** (doc.attempts - 1)
            self._backlog.append(doc)
            log.info("retrying %s (attempt %d of %d): %s: %s", doc.request_id, doc.attempts + 1,
                     self.cfg.max_attempts, failure.error_kind, failure.detail[:200])
            return
        self._dead_letter(doc.tp, doc.record, doc.result, failure.error_kind, failure.detail,
                          attempts=doc.attempts, retriable=failure.retriable, doc=doc)

    def _dead_letter(self, tp: TopicPartition, record: Record, result: DocumentResult | None, error_kind: str,
                     detail: str, *, attempts: int = 1, retriable: bool = False, doc: _Doc | None = None) -> None:
        """The document's dead letter, carrying its result record (``vlmstream redrive --stage condense``)."""
        self.stats.dead_lettered += 1
        self.stats.dead_letters_by_kind[error_kind] = self.stats.dead_letters_by_kind.get(error_kind, 0) + 1
        log.warning("dead letter %s/%d@%d (document %s): %s: %s", tp.topic, tp.partition, record.offset,
                    result.doc_id if result else "?", error_kind, detail[:200])
        letter = dead_letter_from_record(record, stage="condense", error_kind=error_kind, detail=detail,
                                         retriable=retriable, doc_id=result.doc_id if result else None,
                                         image_count=result.image_count if result else None,
                                         attempts=max(1, attempts))
        output = Output(self.settings.topics.deadletter, letter.key(), letter.encode(), letter.headers())
        if doc is not None:
            self._finish(doc, [output])
        else:
            self.commits.done(tp, record.offset, [output])

    def _finish(self, doc: _Doc, outputs: list[Output]) -> None:
        if self._newest.get(doc.result.doc_id) is doc:
            del self._newest[doc.result.doc_id]
        self.commits.done(doc.tp, doc.offset, outputs)

    def _commit(self) -> None:
        if self.commits.commit():
            self.stats.commits += 1

    def _drain(self, deadline: float) -> None:
        """Finish the documents already fetched, without fetching more."""
        while self._open() and time.monotonic() < deadline:
            if self._fatal is not None:
                raise self._fatal
            self._admit()
            if not self._in_engine:
                time.sleep(0.05)  # only retries waiting for their time
                continue
            self._poll_engine(0.05)

    # --- rebalancing (from the listener, on the consumer's IO thread) -----------------------------------------

    async def revoke(self, revoked: set[TopicPartition]) -> None:
        """Commit what is done, then drop the open documents of the revoked partitions: the next owner redoes them."""
        self._rebalancing = True
        if not revoked or self.checkpoint.stopped:
            return
        if await self.commits.commit_from_listener():
            self.stats.commits += 1
        self.drop_partitions(revoked)

    def drop_partitions(self, partitions: set[TopicPartition]) -> None:
        self._backlog = deque(d for d in self._backlog if d.tp not in partitions)
        for request_id in [r for r, d in self._in_engine.items() if d.tp in partitions]:
            del self._in_engine[request_id]  # its answer, when it comes, is ignored
        for doc_id in [k for k, d in self._newest.items() if d.tp in partitions]:
            del self._newest[doc_id]
        rewind(self.consumer, self.commits.forget(partitions))

    def assigned(self) -> None:
        self._rebalancing = False
        if not self._assigned:
            self._assigned = True
            self._last_activity = time.monotonic()


def _completed_before(result: DocumentResult, other: DocumentResult) -> bool:
    return None not in (result.completed_at, other.completed_at) and result.completed_at < other.completed_at


class _Rebalance(AsyncConsumerRebalanceListener):
    """Commit before the partitions move (kafka-python 3 runs this on its IO thread); forget lost ones."""

    def __init__(self, runner: CondenseRunner):
        self.runner = runner

    async def on_partitions_revoked(self, revoked):
        try:
            await self.runner.revoke(set(revoked))
        except FatalPipelineError as exc:
            self.runner._fatal = exc  # kafka-python would only log it; the loop stops without committing

    async def on_partitions_assigned(self, assigned):
        self.runner.assigned()
        log.info("condense: assigned %s", sorted(f"{tp.topic}/{tp.partition}" for tp in assigned))

    async def on_partitions_lost(self, lost):
        self.runner._rebalancing = True
        self.runner.drop_partitions(set(lost))
