"""The commit checkpoint: the one place where a runner's outputs are made durable and its offsets committed.

Every runner commits the same way (ARCHITECTURE.md, rule 3), in numbered steps:

1. flush the producer: every output sent for the offsets about to be committed is acknowledged;
2. raise if any send failed: committing past its input would lose that output for good;
3. commit ``offset + 1`` of the last done record, synchronously.

``CheckedProducer`` wraps the producer so that step 2 cannot be forgotten: every send carries an errback that
keeps the first error and a count, and ``flush()`` raises ``FatalPipelineError`` naming both. ``Checkpoint`` owns
the three ways of committing: at-least-once (``commit``), exactly-once (``commit_transaction``: outputs and
offsets in one transaction) and from inside a rebalance listener (``commit_from_listener``). After a fatal error
it commits nothing more (``stop``): whoever owns the partitions next redoes everything since the last commit.

Every wait on the cluster is bounded by ``kafka.request_timeout_ms`` (30 s by default), so a runner stops whether or
not the cluster answers: a flush (``CheckedProducer.flush``), a send waiting for metadata (the runners make their
producers with ``max_block_ms`` = the same, ``bounded_producer_kwargs``), a commit (kafka-python's default) and a
close (``CheckedProducer.close``). An output not acknowledged in time is a failed send: no commit, and one log line
names the bootstrap servers and the setting.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError, KafkaTimeoutError, RebalanceInProgressError

from vlmstream.config import Settings
from kafka.structs import OffsetAndMetadata

from vlmstream.kafka.errors import GROUP_MOVED_ON, FatalPipelineError

log = logging.getLogger(__name__)


def bounded_client_kwargs(settings: Settings) -> dict[str, int]:
    """``make_consumer`` overrides: the first connection (kafka-python's ``bootstrap_timeout_ms``, 30 s by default,
    checked between attempts) waits at most ``kafka.request_timeout_ms`` plus one reconnect backoff."""
    return {"bootstrap_timeout_ms": settings.kafka.request_timeout_ms}


def bounded_producer_kwargs(settings: Settings) -> dict[str, int]:
    """``make_producer`` overrides that bound a send waiting for metadata or buffer space (kafka-python's
    ``max_block_ms``, 60 s by default, also bounds ``init_transactions``) by ``kafka.request_timeout_ms``, and the
    first connection as ``bounded_client_kwargs`` does."""
    return {"max_block_ms": settings.kafka.request_timeout_ms, **bounded_client_kwargs(settings)}


def unacknowledged(producer: KafkaProducer, waited_s: float | None) -> str:
    """The one line saying that the cluster did not acknowledge outputs: where, and which setting bounds the wait."""
    servers = ",".join(getattr(producer, "config", {}).get("bootstrap_servers") or ()) or "?"
    return (f"outputs not acknowledged by the cluster at {servers} within {waited_s:.0f} s "
            f"(kafka.request_timeout_ms bounds the wait); not committing")


@dataclass(frozen=True)
class Output:
    """One record a runner produces: where it goes and what it carries."""

    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


class CheckedProducer:
    """A ``KafkaProducer`` whose ``flush()`` raises the first failed send.

    kafka-python reports a failed send only to the send's future, on the producer's IO thread. The first error is
    kept, with a count of all, for good: once a send failed, no later flush succeeds, so no commit can pass the
    lost output (the runner stops and its successor redoes the work from the last commit)."""

    def __init__(self, producer: KafkaProducer, *, flush_timeout_s: float | None = None):
        self.producer = producer
        # Never unbounded: kafka-python's flush() without a timeout waits as long as the cluster stays away.
        self.flush_timeout_s = (flush_timeout_s if flush_timeout_s is not None
                                else getattr(producer, "config", {}).get("request_timeout_ms", 30_000) / 1000)
        self._lock = threading.Lock()
        self.failed = 0
        self.first_error: BaseException | None = None

    def send(self, output: Output):
        try:
            future = self.producer.send(output.topic, key=output.key, value=output.value, headers=output.headers)
        except KafkaTimeoutError as exc:  # no metadata or no buffer space within max_block_ms: the cluster is away
            self._on_error(exc)
            waited_s = getattr(self.producer, "config", {}).get("max_block_ms", 60_000) / 1000
            raise FatalPipelineError(f"{unacknowledged(self.producer, waited_s)}"
                                     f": {exc!r}") from exc
        future.add_errback(self._on_error)
        return future

    def _on_error(self, exc: BaseException) -> None:
        with self._lock:
            self.failed += 1
            if self.first_error is None:
                self.first_error = exc

    def flush(self) -> None:
        """Wait for every send to be acknowledged; raise ``FatalPipelineError`` if any failed or timed out."""
        try:
            self.producer.flush(timeout=self.flush_timeout_s)
        except KafkaTimeoutError as exc:
            self._on_error(exc)  # for good: a later flush must not pass these outputs either
            raise FatalPipelineError(unacknowledged(self.producer, self.flush_timeout_s)) from exc
        self.raise_on_failure()

    def close(self, *, flushed: bool) -> None:
        """Close within ``flush_timeout_s`` (``flushed``: the last flush succeeded, so nothing is left to wait for
        but a few late sends) or at once: records still unacknowledged are dropped, none of them committed.
        kafka-python's close() flushes first and, when that times out, raises before stopping its IO thread."""
        try:
            self.producer.close(timeout=self.flush_timeout_s if flushed else 0)
        except KafkaTimeoutError:
            log.warning("%s", unacknowledged(self.producer, self.flush_timeout_s if flushed else 0).replace(
                "not committing", "dropping them at close (none was committed)"))
            sender = getattr(self.producer, "_sender", None)
            if sender is not None:
                sender.force_close()

    def raise_on_failure(self) -> None:
        if self.first_error is not None:
            raise FatalPipelineError(f"{self.failed} send(s) failed, first: {self.first_error!r}; "
                                     "not committing") from self.first_error


class Commit(enum.Enum):
    DONE = "done"
    DEFERRED = "deferred"  # the group is rebalancing: commit again after the next poll
    REFUSED = "refused"  # the group moved on: the partitions' next owner redoes what was not committed
    SKIPPED = "skipped"  # nothing to commit, or stopped after a fatal error


def offsets_to_commit(points: Mapping[TopicPartition, int]) -> dict[TopicPartition, OffsetAndMetadata]:
    """``points``: per partition, the next offset to read (``offset + 1`` of the last done record)."""
    return {tp: OffsetAndMetadata(point, "", -1) for tp, point in points.items()}


class Checkpoint:
    """Commits a runner's done offsets after its outputs, in one of three ways; see the module docstring.

    ``defer_on_rebalance``: a commit refused because the group is rebalancing is deferred (the runner keeps its
    points and commits them after its next poll, or the revoke listener does) instead of given up.
    """

    def __init__(self, consumer: KafkaConsumer, producer: CheckedProducer, *, name: str = "runner",
                 defer_on_rebalance: bool = False):
        self.consumer = consumer
        self.producer = producer
        self.name = name
        self.defer_on_rebalance = defer_on_rebalance
        self.stopped = False
        self._in_transaction = False

    def stop(self) -> None:
        """After a fatal error: commit nothing more (a close() that revokes the partitions included)."""
        self.stopped = True

    # --- at-least-once -------------------------------------------------------------------------

    def commit(self, points: Mapping[TopicPartition, int]) -> Commit:
        """``points``: per partition, the next offset to read. Flushes even without points (outputs that commit no
        offset of their own are still checked)."""
        if self.stopped:
            return Commit.SKIPPED
        # 1. flush the producer and 2. raise if a send failed (CheckedProducer.flush does both)
        self._flush()
        if not points:
            return Commit.SKIPPED
        # 3. commit offset + 1 synchronously, so a crash after this line never redoes these records
        try:
            self.consumer.commit(offsets_to_commit(points))
        except GROUP_MOVED_ON as exc:
            if self.defer_on_rebalance and isinstance(exc, RebalanceInProgressError):
                # Not an error: the next poll() joins the new generation; the revoke listener then commits what
                # leaves us, and the next checkpoint what stays.
                log.info("%s: commit deferred, the group is rebalancing", self.name)
                return Commit.DEFERRED
            # A rebalance or an eviction: these partitions may be someone else's now. Nothing is lost, their new
            # owner redoes what was not committed.
            log.warning("%s: commit refused, the group moved on; duplicates may follow: %r", self.name, exc)
            return Commit.REFUSED
        except KafkaError as exc:
            # The coordinator did not answer within kafka.request_timeout_ms (kafka-python's bound on a commit): the
            # cluster is away. Whether the commit landed is unknown; the next owner redoes at most these records.
            self.stop()
            servers = ",".join(getattr(self.consumer, "config", {}).get("bootstrap_servers") or ()) or "?"
            raise FatalPipelineError(f"commit not acknowledged by the cluster at {servers} (kafka.request_timeout_ms "
                                     f"bounds the wait): {exc!r}") from exc
        return Commit.DONE

    def _flush(self) -> None:
        try:
            self.producer.flush()
        except FatalPipelineError:
            self.stop()
            raise

    # --- exactly-once --------------------------------------------------------------------------

    def begin(self) -> None:
        """Open the transaction that ``commit_transaction`` commits (it opens one itself when none is open)."""
        if not self._in_transaction:
            self.producer.producer.begin_transaction()
            self._in_transaction = True

    def commit_transaction(self, points: Mapping[TopicPartition, int], outputs: Iterable[Output] = ()) -> None:
        """Outputs and offsets in one transaction: both or neither. Read_committed readers never see the outputs of
        an aborted one. Any failure aborts it and raises ``FatalPipelineError``."""
        if self.stopped:
            self.abort()
            return
        producer = self.producer.producer
        try:
            # 1. send what the transaction carries (the runner may have sent more since begin())
            self.begin()
            for output in outputs:
                self.producer.send(output)
            # 2. the offsets, with the group metadata: the broker refuses them if a rebalance gave these partitions
            #    to someone else meanwhile, and fences a zombie
            if points:
                group = self.consumer.group_metadata()
                self._bounded(lambda: producer.send_offsets_to_transaction(offsets_to_commit(points), group),
                              "sending the offsets into the transaction")
            # 3. commit: commit_transaction flushes the outputs and commits them with the offsets
            self._bounded(producer.commit_transaction, "committing the transaction")
            self._in_transaction = False
            self.producer.raise_on_failure()
        except Exception as exc:
            self.abort()
            self.stop()
            if isinstance(exc, FatalPipelineError):
                raise
            raise FatalPipelineError(f"transaction failed, nothing committed: {exc!r}") from exc

    def _bounded(self, call: Callable[[], object], what: str) -> None:
        """Run a transaction call, waiting at most the flush bound (``kafka.request_timeout_ms``).

        kafka-python 3.0 waits for ``send_offsets_to_transaction``, ``commit_transaction`` and ``abort_transaction``
        without a timeout: with the transaction coordinator's broker gone, a worker would block there for good, still
        heartbeating from its IO thread and so keeping its partitions, never seeing a stop request or its
        supervisor's death. The call runs in a daemon thread instead; past the bound this raises, and the runner
        stops without committing (the broker aborts the open transaction when its timeout passes)."""
        outcome: list[BaseException | None] = []

        def target() -> None:
            try:
                call()
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                outcome.append(exc)

        thread = threading.Thread(target=target, name=f"{self.name}-transaction", daemon=True)
        thread.start()
        thread.join(self.producer.flush_timeout_s)
        if not outcome:
            servers = ",".join(getattr(self.producer.producer, "config", {}).get("bootstrap_servers", []) or [])
            raise FatalPipelineError(f"{what}: no answer from the cluster at {servers or '?'} within "
                                     f"{self.producer.flush_timeout_s:.0f} s (kafka.request_timeout_ms bounds the "
                                     "wait); nothing committed")
        if outcome[0] is not None:
            raise outcome[0]

    def abort(self) -> None:
        if not self._in_transaction:
            return
        self._in_transaction = False
        try:
            self._bounded(self.producer.producer.abort_transaction, "aborting the transaction")
        except Exception as exc:  # noqa: BLE001 - a fenced producer cannot abort; the broker's timeout will
            log.warning("%s: aborting the transaction failed: %r", self.name, exc)

    # --- from a rebalance listener -------------------------------------------------------------

    async def commit_from_listener(self, points: Mapping[TopicPartition, int]) -> Commit:
        """At-least-once commit before partitions leave us, from an ``AsyncConsumerRebalanceListener``.

        kafka-python 3 calls listeners on the consumer's IO thread, where the blocking ``consumer.commit`` is
        refused; the coordinator's own async commit is awaited on that loop instead. It is private API: without
        it the partitions' next owner redoes what was done since the last commit. Raises ``FatalPipelineError``
        when a send failed (kafka-python would only log it: the caller keeps it for its run loop)."""
        if self.stopped or not points:
            return Commit.SKIPPED
        # 1. flush (the producer has its own IO thread: this blocks heartbeats only for the flush)
        # 2. raise if a send failed
        self._flush()
        # 3. commit, awaited on the IO thread's loop
        coordinator = getattr(self.consumer, "_coordinator", None)
        commit = getattr(coordinator, "_commit_offsets_sync_async", None)
        if commit is None:
            log.warning("%s: this kafka-python has no async commit for listeners; the next owner of %d "
                        "partition(s) redoes what was done since the last commit", self.name, len(points))
            return Commit.SKIPPED
        try:
            await commit(offsets_to_commit(points))
        except Exception as exc:  # noqa: BLE001 - the group moved on without us: the new owner redoes them
            log.warning("%s: commit on revoke failed; duplicates may follow: %r", self.name, exc)
            return Commit.REFUSED
        return Commit.DONE

