"""The decode fleet's Kafka side: DocumentRefs in, one image record (or dead letter) per image out.

Layout: a supervisor process (``fleet.run_fleet``) starts N worker processes per machine; each worker
(``DecodeWorker``) is one ``KafkaConsumer`` in the decode group (cooperative-sticky assignment) and one
``KafkaProducer``, and runs a plain loop: poll a bounded batch -> decode each image with the stage -> send
asynchronously -> flush and commit. Any number of machines can run a supervisor with the same group id.

Delivery:
- at-least-once (default): offsets move only after every record produced for them is acknowledged
  (``_checkpoint``, through ``vlmstream.kafka.checkpoint``: flush, raise on a failed send, commit offset + 1).
  It runs every ``decode.commit_interval_s``, when the bytes not yet flushed pass a cap, when partitions are
  revoked, and at shutdown. A crash between send and commit repeats the uncommitted documents: downstream sees
  duplicates keyed by the same ``doc_id/index``, never a gap.
- exactly-once (``decode.exactly_once``): one transaction per polled batch, the consumed offsets sent
  into it (``send_offsets_to_transaction`` with the group metadata, so a zombie is fenced). Readers of the
  images and dead-letter topics must use ``isolation_level=read_committed``. The transactional id is
  stable per host and worker slot, so a restarted worker aborts its predecessor's open transaction at once.

Failures are values: an unreadable DocumentRef or a failed image becomes a dead letter with the source
coordinates, and the offset moves past it. A failed send or a fenced producer is fatal for the worker: it
exits without committing and the supervisor starts it again from the last commit.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Callable

import orjson
from kafka.consumer.subscription_state import AsyncConsumerRebalanceListener
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor

from consumers.decode.metrics import DecodeMetrics
from vlmstream.images.pages import MAX_PAGES
from consumers.decode.types import ImageFailure, PreparedImage, Stage
from vlmstream.images.claimcheck import claim_check_url
from schemas import DeadLetter, DocumentRef, ImagePayload, SchemaError, now, source_coords
from vlmstream.config import Settings
from vlmstream.kafka.checkpoint import (CheckedProducer, Checkpoint, Commit, Output, bounded_client_kwargs,
                                        bounded_producer_kwargs)
from vlmstream.kafka.clients import make_consumer, make_producer
from vlmstream.kafka.errors import FatalPipelineError
from vlmstream.kafka.group import subscribe_when_known
from vlmstream.kafka.lag import FetchLag
from vlmstream.kafka.records import Record, UnreadableRecord, dead_letter_from_record, poll_past_unreadable

log = logging.getLogger(__name__)

# Exit status of a worker that stopped because it was asked to, or ran out of input.
EXIT_OK = 0
# Exit status of a worker that hit a fatal error; the supervisor restarts it.
EXIT_FATAL = 3

POLL_TIMEOUT_MS = 200


def worker_drain_bound_s(settings: Settings) -> float:
    """How long a worker takes at most to stop once asked, after the document in hand, whether or not the cluster
    answers: a flush, a commit, leaving the group and closing the producer, each bounded by
    ``kafka.request_timeout_ms``. Within the supervisor's ``drain_timeout_s`` with the defaults (4 x 30 s)."""
    return 4 * settings.kafka.request_timeout_ms / 1000


def transactional_id(settings: Settings, worker_index: int) -> str:
    """Stable across restarts of the same worker slot: the new producer fences the old one and aborts its
    open transaction at once, instead of read_committed readers waiting for the transaction timeout."""
    return f"{settings.decode.group_id}-{socket.gethostname()}-{worker_index}"


def max_unflushed_bytes(settings: Settings) -> int:
    # Half the producer's buffer: we flush before send() would block on a full buffer.
    return max(32 * 1024 * 1024, 2 * settings.kafka.max_message_bytes)


class DecodeWorker:
    """One process's consumer + producer + decode stage. ``run()`` returns the process exit status."""

    def __init__(self, settings: Settings, index: int = 0, *, stop: Callable[[], bool] = lambda: False,
                 until_idle_s: float | None = None, deadline: float | None = None,
                 stage: Stage | None = None) -> None:
        self.settings = settings
        self.index = index
        self.exactly_once = settings.decode.exactly_once
        self._stop_requested = stop
        self._until_idle_s = until_idle_s
        self._deadline = deadline
        self._stage = stage
        self._claim_checks = None
        # Per partition, the next offset to read once everything sent so far is acknowledged.
        self._done: dict[Any, int] = {}
        self._unflushed_bytes = 0
        self._last_checkpoint = time.monotonic()
        self._last_activity = time.monotonic()
        self._max_unflushed = max_unflushed_bytes(settings)
        self.metrics = DecodeMetrics(index)
        self.lag = FetchLag()
        self.consumer = None
        self.producer = None
        self.sender: CheckedProducer | None = None  # the producer, raising a failed send from flush()
        self.checkpoint: Checkpoint | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def run(self) -> int:
        settings = self.settings
        from consumers.decode.stage import DecodeStage, size_class

        self._size_class = size_class
        if self._stage is None:
            self._stage = DecodeStage(settings.decode, claim_check_url(settings))
        if self._stop_requested():
            return EXIT_OK  # asked to stop before connecting: nothing to drain
        tid = transactional_id(settings, self.index) if self.exactly_once else None
        # A send waiting for metadata, and init_transactions, wait at most kafka.request_timeout_ms.
        self.producer = make_producer(settings, transactional_id=tid, **bounded_producer_kwargs(settings))
        self.sender = CheckedProducer(self.producer)  # flushes wait at most kafka.request_timeout_ms
        if tid:
            # Fences any earlier producer with this id and aborts its open transaction.
            self.producer.init_transactions()
        self.consumer = make_consumer(
            settings, settings.decode.group_id,
            max_poll_records=settings.decode.max_poll_records,
            partition_assignment_strategy=(CooperativeStickyAssignor,),
            session_timeout_ms=settings.decode.session_timeout_ms,
            heartbeat_interval_ms=max(1000, settings.decode.session_timeout_ms // 3),
            **bounded_client_kwargs(settings),
        )
        self.checkpoint = Checkpoint(self.consumer, self.sender, name=f"decode worker {self.index}",
                                     defer_on_rebalance=True)
        status = EXIT_OK
        try:
            subscribe_when_known(self.consumer, [settings.topics.documents], listener=_Rebalance(self),
                                 should_stop=self._stop_requested)
            log.info("decode worker %d (pid %d) joined group %s on %s, %s", self.index, os.getpid(),
                     settings.decode.group_id, settings.topics.documents,
                     f"exactly-once as {tid}" if tid else "at-least-once")
            self._loop()
            if not self.exactly_once:
                self._checkpoint()
        except Exception as exc:  # noqa: BLE001 - fatal for this process: restart from the last commit
            log.error("decode worker %d: %s, exiting without commit", self.index,
                      "fatal" if isinstance(exc, FatalPipelineError) else "unexpected error", exc_info=True)
            status = EXIT_FATAL
            # close() calls the revoke listener: it must not commit what this failure left unsure.
            self.checkpoint.stop()
            self.checkpoint.abort()
        finally:
            self.metrics.maybe_log(force=True)
            log.info("decode worker %d stopped: %d documents, %d images, %d failed, %d claim-checked",
                     self.index, self.metrics.documents, self.metrics.images, self.metrics.failed,
                     self.metrics.claim_checks)
            # Consumer first: close() leaves the group (the partitions move at once) and may call the
            # revoke listener, which needs the producer still open.
            # Each close waits at most kafka.request_timeout_ms; a producer whose outputs were not all flushed closes
            # at once, dropping them (nothing past them was committed).
            _close_quietly(self.consumer.close, "consumer")
            _close_quietly(lambda: self.sender.close(flushed=status == EXIT_OK), "producer")
            _close_quietly(self._stage.close, "decode stage")
        return status

    def _should_stop(self) -> bool:
        if self._stop_requested():
            return True
        now_ = time.monotonic()
        if self._deadline is not None and now_ >= self._deadline:
            return True
        return self._until_idle_s is not None and now_ - self._last_activity >= self._until_idle_s

    def _loop(self) -> None:
        while not self._should_stop():
            batch = poll_past_unreadable(self.consumer, timeout_ms=POLL_TIMEOUT_MS)
            self.lag.observe(self.consumer, batch)
            self.metrics.lag(self.lag.total)
            if batch:
                self._last_activity = time.monotonic()
                if self.exactly_once:
                    self._transactional_batch(batch)
                else:
                    self._process_batch(batch)
            due = time.monotonic() - self._last_checkpoint >= self.settings.decode.commit_interval_s
            if due and not self.exactly_once:
                self._checkpoint()
            self.metrics.maybe_log()

    def _process_batch(self, batch: dict[Any, list[Any]]) -> None:
        """Decode and send the records of ``batch``, stopping early between documents when asked to stop or
        when the group is rebalancing (the rebalance waits for our next poll; a batch can take seconds)."""
        partitions = list(batch.items())
        for position, (tp, records) in enumerate(partitions):
            for index, record in enumerate(records):
                if self._stop_requested() or self._rebalance_pending():
                    self._rewind([(tp, records[index:])] + partitions[position + 1:])
                    return
                self._handle_record(record)
                self._done[tp] = record.offset + 1
                if self._unflushed_bytes >= self._max_unflushed:
                    if self.exactly_once:
                        self.sender.flush()
                        self._unflushed_bytes = 0
                    else:
                        self._checkpoint()

    def _rebalance_pending(self) -> bool:
        # kafka-python's heartbeat thread sets this when the coordinator answers REBALANCE_IN_PROGRESS.
        need_rejoin = getattr(getattr(self.consumer, "_coordinator", None), "need_rejoin", None)
        try:
            return bool(need_rejoin and need_rejoin())
        except Exception:  # noqa: BLE001 - a private API: without it we only rebalance between batches
            return False

    def _rewind(self, unprocessed: list[tuple[Any, list[Any]]]) -> None:
        """The consumer's position is past records we did not handle: fetch them again (if we keep the partition)."""
        for tp, records in unprocessed:
            if records:
                self.consumer.seek(tp, records[0].offset)

    def _transactional_batch(self, batch: dict[Any, list[Any]]) -> None:
        # The batch's images are sent inside the transaction; its offsets commit with them or not at all.
        self.checkpoint.begin()
        self._process_batch(batch)
        self.checkpoint.commit_transaction(self._done)
        self._done.clear()
        self._unflushed_bytes = 0

    # --- one document --------------------------------------------------------------------------

    def _handle_record(self, record: Record) -> None:
        if isinstance(record, UnreadableRecord):
            self._publish_dead_letter(dead_letter_from_record(
                record, stage="decode", error_kind="unreadable_record", detail=record.error))
            return
        try:
            doc = DocumentRef.decode(record.value)
        except SchemaError as exc:
            self._publish_dead_letter(dead_letter_from_record(
                record, stage="decode", error_kind="invalid_message", detail=str(exc)))
            return
        self.metrics.document()
        source = source_coords(record.topic, record.partition, record.offset)
        count = len(doc.image_uris)
        # Every image record carries the metadata in its headers: its size, once per document, decides both.
        metadata_bytes = len(orjson.dumps(doc.metadata)) if doc.metadata else 0
        oversized = self._headers_over_limit(metadata_bytes)
        for image_index, uri in enumerate(doc.image_uris):
            started = time.perf_counter()
            result = ImageFailure("metadata_too_large", oversized, retriable=False) if oversized else self._decode(uri)
            if isinstance(result, PreparedImage):
                self._publish_image(doc, image_index, count, uri, result, source, metadata_bytes)
                self.metrics.image(source_format=result.source_format,
                                   size_class=self._size_class(result.orig_width, result.orig_height),
                                   seconds=time.perf_counter() - started, bytes_in=result.fetch_bytes,
                                   bytes_out=len(result.data))
                if result.pages > 1:
                    # Its first page is described; the others would be lost without a word.
                    self._publish_dead_letter(DeadLetter(
                        stage="decode", error_kind="pages_not_described",
                        detail=(f"{result.pages}{' or more' if result.pages >= MAX_PAGES else ''} pages, only the "
                                f"first described; name each page as URI#page=N to describe the others"),
                        retriable=False, doc_id=doc.doc_id, image_index=image_index, image_count=count,
                        source_uri=uri, source=source, created_at=now()))
            else:
                self._publish_dead_letter(DeadLetter(
                    stage=result.stage or "decode", error_kind=result.error_kind, detail=result.detail[:4000],
                    retriable=result.retriable, doc_id=doc.doc_id, image_index=image_index, image_count=count,
                    source_uri=uri, source=source, created_at=now()))
        self._stage.end_document()

    def _decode(self, uri: str) -> PreparedImage | ImageFailure:
        try:
            return self._stage(uri)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - the stage promises values; a bug on one image stays one image
            log.exception("decode stage raised on %s", uri)
            return ImageFailure("decode_internal_error", f"{type(exc).__name__}: {exc}", retriable=True)

    def _headers_over_limit(self, metadata_bytes: int) -> str | None:
        """Why this document's image records could not be sent at all, or None. Every image record carries the
        document's metadata in its headers; metadata the size of a record would fail the send, and a failed send
        stops the worker, on this document again after each restart."""
        limit = self.settings.kafka.max_message_bytes // 2
        if metadata_bytes <= limit:
            return None
        return (f"the document's metadata is {metadata_bytes} bytes as JSON; each image record carries it, and "
                f"at most {limit} (half of kafka.max_message_bytes) leaves room for the image")

    def _publish_image(self, doc: DocumentRef, image_index: int, count: int, uri: str, image: PreparedImage,
                       source: dict[str, Any], metadata_bytes: int) -> None:
        value = image.data
        ref = None
        metadata = doc.metadata
        if image.page_text:
            # The page's own text layer, for a prompt or the condense stage; bounded by decode.pdf_page_text_chars.
            metadata = {**metadata, "page_text": image.page_text}
            metadata_bytes += len(orjson.dumps(image.page_text))
        # The headers count: a record is its value and its headers (the metadata is in them).
        if len(value) + metadata_bytes + 4096 > self.settings.kafka.max_message_bytes:
            # Never dropped: the pixels go aside and the record carries the reference.
            ref = self._claim_check_store().put(f"{doc.doc_id}/{image_index}", value)
            value = b""
            self.metrics.claim_check()
        payload = ImagePayload(
            doc_id=doc.doc_id, image_index=image_index, image_count=count, source_uri=uri, codec=image.codec,
            width=image.width, height=image.height, grid_thw=tuple(image.grid_thw),
            orig_width=image.orig_width, orig_height=image.orig_height,
            min_pixels=self.settings.decode.min_pixels, max_pixels=self.settings.decode.max_pixels,
            payload_bytes=len(image.data), claim_check=ref, source_format=image.source_format,
            decode_ms=round(image.decode_ms, 3),
            prepare_cpu_ms=round(image.prepare_cpu_ms, 3) if image.prepare_cpu_ms is not None else None,
            metadata=metadata, source=source, created_at=now())
        self._send(self.settings.topics.images, payload.key(), value, payload.headers())

    def _publish_dead_letter(self, letter: DeadLetter) -> None:
        self._send(self.settings.topics.deadletter, letter.key(), letter.encode(), letter.headers())
        self.metrics.error(letter.error_kind)

    def _send(self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        self.sender.send(Output(topic, key, value, headers))
        self._unflushed_bytes += len(value) + sum(len(v) for _, v in headers)

    def _claim_check_store(self):
        if self._claim_checks is None:
            from vlmstream.images.claimcheck import ClaimCheckStore

            self._claim_checks = self._stage.store or ClaimCheckStore(claim_check_url(self.settings))
        return self._claim_checks

    # --- commits (at-least-once) ---------------------------------------------------------------

    def _checkpoint(self) -> None:
        """Flush, raise on a failed send, commit the next offset of every partition handled (``checkpoint.commit``).
        A commit deferred by a rebalance keeps its offsets for the next checkpoint or the revoke listener."""
        self._last_checkpoint = time.monotonic()
        if not self._done:
            return
        self._unflushed_bytes = 0
        if self.checkpoint.commit(self._done) is not Commit.DEFERRED:
            self._done.clear()


def _close_quietly(close: Callable[[], Any], what: str) -> None:
    try:
        close()
    except Exception as exc:  # noqa: BLE001 - shutting down; nothing left to protect
        log.warning("closing the %s failed: %s", what, exc)


class _Rebalance(AsyncConsumerRebalanceListener):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked):
        worker = self.worker
        worker._last_activity = time.monotonic()
        # Exactly-once: each batch's transaction is committed before the next poll, so nothing is pending.
        # At-least-once: every record polled so far has been handled (this runs inside poll()), so what is done
        # is everything sent.
        if not worker.exactly_once:
            try:
                await worker.checkpoint.commit_from_listener(
                    {tp: offset for tp, offset in worker._done.items() if tp in revoked})
            except FatalPipelineError as exc:
                # A send failed: nothing is committed, and the worker stops at its next flush (the failure stays).
                log.error("decode worker %d: not committing on revoke: %s", worker.index, exc)
        for tp in revoked:
            worker._done.pop(tp, None)
        log.info("decode worker %d: revoked %s", worker.index, sorted(f"{tp.topic}[{tp.partition}]" for tp in revoked))

    async def on_partitions_assigned(self, assigned):
        self.worker._last_activity = time.monotonic()
        log.info("decode worker %d: assigned %s", self.worker.index,
                 sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned))

    async def on_partitions_lost(self, lost):
        # Evicted: the commit would be refused, the new owner repeats from the last commit.
        for tp in lost:
            self.worker._done.pop(tp, None)
        log.warning("decode worker %d: lost %s; duplicates may follow", self.worker.index, sorted(map(str, lost)))
