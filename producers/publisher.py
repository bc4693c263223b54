"""The runner of the produce side: owns the Kafka producer and the ledger, turns source items into
records on the documents topic, and bad input lines into dead letters. Sources (producers.manifest,
csv_reader, stdin, folder, watch; what they yield is in producers.items) never touch Kafka.

Per document:
1. skip it when the ledger (or a send still in flight this run) holds the same content hash, unless forced;
2. send it with key doc_id and the schema headers; at most ``max_in_flight_documents`` unacknowledged;
3. once the broker acknowledged it (acks=all, idempotent producer), write it to the ledger.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import orjson
from kafka.errors import KafkaError, KafkaTimeoutError, MessageSizeTooLargeError

from producers.items import IDLE, Rejection, replace_non_utf8
from producers.ledger import Ledger, bootstrap_scope, bytes_hash, document_hash, ledger_path
from schemas import DeadLetter, DocumentRef, b64_or_none, now
from vlmstream.config import Settings
from vlmstream.kafka.checkpoint import bounded_producer_kwargs, unacknowledged
from vlmstream.kafka.clients import make_producer
from vlmstream.kafka.errors import FatalPipelineError

log = logging.getLogger(__name__)

INVALID_LINE = "invalid_manifest_line"
LEDGER_BATCH = 5_000
CHUNK = 500  # items looked up in the ledger together
# DocumentRefs are a few hundred bytes: larger batches mean fewer produce requests per document.
BATCH_BYTES = 256 * 1024
REPORT_LIMIT = 100


@dataclass
class Failure:
    doc_id: str
    where: str | None
    error: str


@dataclass
class PublishSummary:
    """What one run did. ``rejected`` lists every bad input line; they were also dead-lettered
    (``dead_lettered`` counts those sent this run; a re-run does not send the same one again)."""

    sent: int = 0
    images_sent: int = 0  # images named by the documents sent
    skipped: int = 0
    rejected: list[Rejection] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    dead_lettered: int = 0
    elapsed_s: float = 0.0
    # The ids of the documents sent, when asked for (``track_sent``): `vlmstream run` waits for their new results.
    sent_ids: set[str] | None = None
    # Of those, the ids the ledger held with other content (other images or metadata; with ``track_sent``): on the
    # compacted results topic, keyed by doc id, their new results replace the earlier documents'.
    replaced_ids: set[str] | None = None

    @property
    def ok(self) -> bool:
        """Every document was either acknowledged or already published (rejected lines do not count)."""
        return not self.failed

    @property
    def seen(self) -> int:
        return self.sent + self.skipped + len(self.rejected) + len(self.failed)

    def docs_per_s(self) -> float:
        return (self.sent + self.skipped) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self, limit: int = REPORT_LIMIT) -> dict[str, Any]:
        return {
            "sent": self.sent, "skipped": self.skipped, "rejected": len(self.rejected),
            "failed": len(self.failed), "dead_lettered": self.dead_lettered,
            "elapsed_s": round(self.elapsed_s, 3), "docs_per_s": round(self.docs_per_s(), 1),
            "rejections": [{"where": r.origin, "line": r.line, "reason": r.reason, "detail": r.detail}
                           for r in self.rejected[:limit]],
            "failures": [dataclasses.asdict(f) for f in self.failed[:limit]],
        }

    def render(self, limit: int = 50) -> str:
        lines = [f"sent {self.sent}, skipped (already published) {self.skipped}, "
                 f"rejected {len(self.rejected)} (dead-lettered now {self.dead_lettered}), failed {len(self.failed)} "
                 f"in {self.elapsed_s:.1f}s ({self.docs_per_s():.0f} docs/s)"]
        for r in self.rejected[:limit]:
            lines.append(f"  rejected {r.where()}: {r.reason}: {r.detail}")
        for f in self.failed[:limit]:
            lines.append(f"  failed {f.doc_id} ({f.where}): {f.error}")
        hidden = max(0, len(self.rejected) - limit) + max(0, len(self.failed) - limit)
        if hidden:
            lines.append(f"  ... and {hidden} more")
        return "\n".join(lines)


class _InFlight(NamedTuple):
    future: Any
    topic: str
    record_id: str
    content_hash: str
    where: str | None
    is_document: bool
    images: int = 0


class DocumentPublisher:
    """Publishes source items; use as a context manager so the producer and ledger are closed."""

    def __init__(self, settings: Settings, *, force: bool = False, use_ledger: bool = True,
                 stop: threading.Event | None = None,
                 on_progress: Callable[[PublishSummary], None] | None = None, track_sent: bool = False):
        self.settings = settings
        self.force = force
        self.track_sent = track_sent
        self._replacing: set[str] = set()  # ids sent whose ledger row held other content
        self.stop = stop
        self.on_progress = on_progress
        self.documents_topic = settings.topics.documents
        self.deadletter_topic = settings.topics.deadletter
        self.bootstrap = bootstrap_scope(settings)
        self.max_in_flight = max(1, settings.producer.max_in_flight_documents)
        # A send waiting for metadata or buffer space, and the final flush, wait at most kafka.request_timeout_ms.
        self.producer = make_producer(settings, batch_size=BATCH_BYTES, **bounded_producer_kwargs(settings))
        self.flush_timeout_s = settings.kafka.request_timeout_ms / 1000
        self.ledger = Ledger(ledger_path(settings)) if use_ledger else None
        self._in_flight: deque[_InFlight] = deque()
        self._acked: list[tuple[str, str, str, str]] = []
        # Sent this run and not yet in the ledger: a duplicate line must not go out twice either.
        self._unrecorded: dict[tuple[str, str], str] = {}
        self._summary = PublishSummary()

    # --- public ---------------------------------------------------------------------------------

    def publish(self, items: Iterable[Any]) -> PublishSummary:
        summary = self._summary = PublishSummary(sent_ids=set() if self.track_sent else None,
                                                 replaced_ids=set() if self.track_sent else None)
        started = time.monotonic()
        try:
            for chunk in _chunks(items, CHUNK):
                known = self._ledger_hashes(chunk)
                for item in chunk:
                    if item is IDLE:
                        self._settle()
                    elif isinstance(item, Rejection):
                        self._dead_letter(item, summary)
                    else:
                        self._send_document(item, known, summary)
                    if self.stop is not None and self.stop.is_set():
                        break
                if len(self._acked) >= LEDGER_BATCH:
                    self._write_ledger()
                if self.on_progress is not None:
                    summary.elapsed_s = time.monotonic() - started
                    self.on_progress(summary)
                if self.stop is not None and self.stop.is_set():
                    log.info("stop requested: finishing the sends in flight")
                    break
        finally:
            # Whatever happened, documents already acknowledged belong in the ledger.
            try:
                self._settle()
            finally:
                summary.elapsed_s = time.monotonic() - started
                if self.on_progress is not None:
                    self.on_progress(summary)
        return summary

    def close(self) -> None:
        try:
            # At once when sends are still unacknowledged (_settle waited for them already): they are failures,
            # left out of the ledger, and go out on the next run.
            self.producer.close(timeout=0 if self._in_flight else self.flush_timeout_s)
        except KafkaTimeoutError:
            sender = getattr(self.producer, "_sender", None)
            if sender is not None:
                sender.force_close()
        finally:
            if self.ledger is not None:
                self.ledger.close()

    def __enter__(self) -> "DocumentPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- steps ----------------------------------------------------------------------------------

    def _ledger_hashes(self, chunk: list[Any]) -> dict[str, str]:
        if self.force or self.ledger is None:
            return {}
        doc_ids = [item.doc_id for item in chunk if isinstance(item, DocumentRef)]
        return self.ledger.content_hashes(self.documents_topic, self.bootstrap, doc_ids) if doc_ids else {}

    def _already_published(self, topic: str, record_id: str, content_hash: str,
                           known: dict[str, str] | None = None) -> bool:
        if self.force:
            return False
        if self._unrecorded.get((topic, record_id)) == content_hash:
            return True
        if known is not None:
            return known.get(record_id) == content_hash
        return self.ledger is not None and self.ledger.content_hash(topic, self.bootstrap, record_id) == content_hash

    def _send_document(self, doc: DocumentRef, known: dict[str, str], summary: PublishSummary) -> None:
        content_hash = document_hash(doc)
        if self._already_published(self.documents_topic, doc.doc_id, content_hash, known):
            summary.skipped += 1
            return
        # Sources validated the document and published_at is a plain number: no second validation.
        value = orjson.dumps({**doc.to_dict(), "published_at": now()})
        try:
            future = self.producer.send(self.documents_topic, key=doc.key(), value=value, headers=doc.headers())
        except MessageSizeTooLargeError as exc:
            # A per-document problem (too many or too long URIs), not a broker one: dead-letter it.
            where = doc.source or "?"
            origin, _, line = where.rpartition(":")
            rejection = Rejection(origin or where, int(line) if line.isdigit() else None, "document_too_large",
                                  str(exc), value, doc.doc_id)
            self._dead_letter(rejection, summary)
            return
        except KafkaError as exc:
            raise FatalPipelineError(f"cannot send to {self.documents_topic}: {exc!r}") from exc
        if doc.doc_id in known:  # not skipped above, so the ledger held this id with other content
            self._replacing.add(doc.doc_id)
        self._track(_InFlight(future, self.documents_topic, doc.doc_id, content_hash, doc.source, True,
                              len(doc.image_uris)))

    def _dead_letter(self, rejection: Rejection, summary: PublishSummary) -> None:
        summary.rejected.append(rejection)
        # One dead letter per bad line: the same line in a re-run is reported again but not re-sent.
        record_id = f"{rejection.origin}:{rejection.line}" if rejection.line is not None else rejection.origin
        if rejection.line is None and rejection.doc_id:
            record_id = f"{rejection.origin}:{rejection.doc_id}"
        record_id = replace_non_utf8(record_id)  # the ledger stores text: a name that is not UTF-8 would not go in
        content_hash = bytes_hash(rejection.raw, rejection.reason.encode())
        if self._already_published(self.deadletter_topic, record_id, content_hash):
            return
        line = f" line {rejection.line}" if rejection.line is not None else ""
        detail = f"{rejection.origin}{line}: {rejection.reason}: {rejection.detail}"
        # The rejected input's own id or path may be what no record can hold (not UTF-8, too long): then it is
        # named in the detail, and the dead letter itself can always be written.
        doc_id = rejection.doc_id
        if doc_id is not None and (not 0 < len(doc_id) <= 512 or replace_non_utf8(doc_id) != doc_id):
            detail, doc_id = f"document {replace_non_utf8(doc_id)[:600]!r}: {detail}", None
        letter = DeadLetter(
            stage="produce", error_kind=INVALID_LINE, retriable=False, detail=replace_non_utf8(detail)[:4000],
            doc_id=doc_id, source_uri=replace_non_utf8(rejection.origin),
            original_value_b64=b64_or_none(rejection.raw), created_at=now(),
        )
        try:
            future = self.producer.send(self.deadletter_topic, key=letter.key(), value=letter.encode(),
                                        headers=letter.headers())
        except KafkaError as exc:
            raise FatalPipelineError(f"cannot send to {self.deadletter_topic}: {exc!r}") from exc
        summary.dead_lettered += 1  # taken back if the send fails
        self._track(_InFlight(future, self.deadletter_topic, record_id, content_hash, rejection.where(), False))

    def _track(self, entry: _InFlight) -> None:
        self._in_flight.append(entry)
        self._unrecorded[(entry.topic, entry.record_id)] = entry.content_hash
        self._reap(wait=False)
        while len(self._in_flight) >= self.max_in_flight:
            self._reap_one(self._in_flight.popleft())

    def _settle(self) -> None:
        """Flush the producer (for at most kafka.request_timeout_ms), collect every acknowledgement, write the
        ledger. A send not acknowledged by then is a failure: not in the ledger, sent again on the next run."""
        if self._in_flight:
            try:
                self.producer.flush(timeout=self.flush_timeout_s)
            except KafkaTimeoutError:
                log.error("%s", unacknowledged(self.producer, self.flush_timeout_s).replace(
                    "not committing", "they are not in the ledger and go out on the next run"))
                while self._in_flight:
                    self._reap_one(self._in_flight.popleft(), timeout_s=0)
        self._reap(wait=True)
        self._write_ledger()

    def _reap(self, *, wait: bool) -> None:
        while self._in_flight and (wait or self._in_flight[0].future.is_done):
            self._reap_one(self._in_flight.popleft())

    def _reap_one(self, entry: _InFlight, timeout_s: float | None = None) -> None:
        try:
            # Without a timeout: a send kafka-python accepted completes within its delivery_timeout_ms (120 s).
            entry.future.get(timeout=timeout_s)
        except KafkaError as exc:
            # Not acknowledged: leave it out of the ledger so the next run sends it again.
            self._unrecorded.pop((entry.topic, entry.record_id), None)
            log.error("send of %s to %s failed: %r", entry.record_id, entry.topic, exc)
            self._summary.failed.append(Failure(entry.record_id, entry.where, repr(exc)))
            if not entry.is_document:
                self._summary.dead_lettered -= 1
            return
        if entry.is_document:
            self._summary.sent += 1
            self._summary.images_sent += entry.images
            if self._summary.sent_ids is not None:
                self._summary.sent_ids.add(entry.record_id)
                if entry.record_id in self._replacing:
                    self._summary.replaced_ids.add(entry.record_id)
        self._acked.append((entry.topic, self.bootstrap, entry.record_id, entry.content_hash))

    def _write_ledger(self) -> None:
        if not self._acked:
            return
        rows, self._acked = self._acked, []
        if self.ledger is not None:
            self.ledger.record(rows)
        for topic, _, record_id, content_hash in rows:
            if self._unrecorded.get((topic, record_id)) == content_hash:
                del self._unrecorded[(topic, record_id)]


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Groups of up to ``size`` items; IDLE ends a group so a quiet source is never held back."""
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if item is IDLE or len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def publish_documents(settings: Settings, items: Iterable[Any], *, force: bool = False, use_ledger: bool = True,
                      stop: threading.Event | None = None,
                      on_progress: Callable[[PublishSummary], None] | None = None,
                      track_sent: bool = False) -> PublishSummary:
    """Publish every item of a source (see producers.items) and return what happened (with ``track_sent``, also
    which documents were sent)."""
    with DocumentPublisher(settings, force=force, use_ledger=use_ledger, stop=stop,
                           on_progress=on_progress, track_sent=track_sent) as publisher:
        return publisher.publish(items)

