"""The inference consumer: owns the Kafka clients, keeps the engine saturated, commits what is done.

One thread drives everything: fetch image records, turn them into arrays, submit requests as capacity
frees (no batch barrier), poll finished requests (in any order), publish their outputs, commit.
The engine never sees Kafka; this module never runs a model.

The parts: this module (the loop and the lifecycle), ``work`` (a record on its way and the in-flight window that
bounds admission to the engine, retries included), ``outputs`` (descriptions, embeddings, dead letters),
``vlmstream.kafka.done_prefix`` (the done prefix of each partition, committed through the checkpoint: at-least-once,
or with ``exactly_once`` outputs and offsets in one transaction), ``rebalance`` (the listener) and ``stats``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict
from typing import Any, Callable

import numpy as np
from kafka import TopicPartition

from consumers.infer import outputs
from consumers.infer.engine import Engine, EngineDeadError, InferenceFailure, InferenceOutput, InferenceRequest
from consumers.infer.prompts import instruction_for
from consumers.infer.rebalance import RunnerRebalance
from consumers.infer.stats import RunnerStats, Saturation
from consumers.infer.work import NO_META, InFlightWindow, Work
from schemas import ImagePayload, SchemaError, decode_image_payload
from schemas.messages import HEADER_ATTEMPT
from vlmstream.config import Settings
from vlmstream.kafka.checkpoint import (CheckedProducer, Checkpoint, Output, bounded_client_kwargs,
                                        bounded_producer_kwargs)
from vlmstream.kafka.clients import make_consumer, make_producer, unique_client_id
from vlmstream.kafka.done_prefix import DonePrefix
from vlmstream.kafka.errors import FatalPipelineError
from vlmstream.kafka.group import GroupMembershipWatchdog, rewind, subscribe_when_known
from vlmstream.kafka.lag import FetchLag
from vlmstream.kafka.records import Record, UnreadableRecord, poll_past_unreadable

log = logging.getLogger(__name__)

EXIT_OK = 0
# How long poll() waits while a rebalance is under way (see InferenceRunner.rebalance_started).
REBALANCE_POLL_MS = 200
EXIT_ENGINE_DEAD = 3
EXIT_PIPELINE_FATAL = 4

PayloadDecoder = Callable[[ImagePayload, bytes], np.ndarray]


class InferenceRunner:
    """Consumer group over the image topic feeding one engine. ``run()`` returns an exit code."""

    def __init__(self, settings: Settings, engine: Engine, *, payload_decoder: PayloadDecoder | None = None,
                 group_id: str | None = None, commit_interval_s: float = 1.0, commit_every: int | None = None,
                 revoke_drain_s: float = 3.0, stop_drain_s: float = 120.0, transactional_id: str | None = None,
                 retry_backoff_s: float = 0.2):
        self.settings = settings
        self.cfg = settings.infer
        self.engine = engine
        self.group_id = group_id or self.cfg.group_id
        self.commit_interval_s = commit_interval_s
        self.revoke_drain_s = revoke_drain_s
        self.stop_drain_s = stop_drain_s
        self.retry_backoff_s = retry_backoff_s
        self.exactly_once = self.cfg.exactly_once
        self.transactional_id = transactional_id or (
            f"{self.group_id}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self._payload_decoder = payload_decoder
        self.engine_batch_size = engine.batch_size
        self.max_images_in_flight = self.cfg.images_in_flight(self.engine_batch_size)
        # Committing every in-flight window bounds what a crash redoes to about two windows.
        self.commit_every = commit_every or max(1, self.max_images_in_flight)
        self.stats = RunnerStats()
        self.lag = FetchLag()
        self.window = InFlightWindow(self.max_images_in_flight, self.cfg.max_visual_tokens_in_flight)
        self.saturation = Saturation(self.stats, batch_size=self.engine_batch_size, step_tokens=engine.step_tokens,
                                     max_tokens=self.cfg.max_visual_tokens_in_flight)
        self.commits: DonePrefix | None = None  # made with the clients, in run()
        self.checkpoint: Checkpoint | None = None
        self._last_activity = time.monotonic()
        self._assigned = False
        # From a rebalance's start (revoke) to its end (assignment); the first join counts too. kafka-python 3.0
        # throws away a join that completes while no poll() waits for it and sends a new JoinGroup, so a runner
        # polling with a zero timeout (engine busy, window full) never finished a rebalance: it must wait in poll.
        self._rebalancing = True
        self._fetched_last = 0
        self._liveness_at = time.monotonic()
        self._fatal: BaseException | None = None  # raised in the rebalance listener, re-raised by the loop
        self.consumer = None
        self.producer = None

    # --- lifecycle ---------------------------------------------------------------------------

    def run(self, stop_event: threading.Event | None = None, max_seconds: float | None = None,
            until_idle_s: float | None = None) -> int:
        stop_event = stop_event or threading.Event()
        if stop_event.is_set():
            return EXIT_OK  # asked to stop before connecting (while the engine loaded): nothing to drain
        started = time.monotonic()
        self.saturation.warn_static_settings(self.max_images_in_flight)
        # A send waiting for metadata, and init_transactions, wait at most kafka.request_timeout_ms.
        self.producer = make_producer(self.settings, transactional_id=self.transactional_id if self.exactly_once
                                      else None, **({"transaction_timeout_ms": 15_000} if self.exactly_once else {}),
                                      **bounded_producer_kwargs(self.settings))
        if self.exactly_once:
            self.producer.init_transactions()
        client_id = unique_client_id(self.settings, "infer")
        self._membership = GroupMembershipWatchdog(self.settings, self.group_id, client_id)
        self.consumer = make_consumer(self.settings, self.group_id, (), client_id=client_id,
                                      max_poll_records=max(1, min(self.max_images_in_flight, 500)),
                                      session_timeout_ms=self.cfg.session_timeout_ms,
                                      **bounded_client_kwargs(self.settings))
        self.sender = CheckedProducer(self.producer, flush_timeout_s=self.settings.kafka.request_timeout_ms / 1000)
        self.checkpoint = Checkpoint(self.consumer, self.sender, name="inference runner")
        self.commits = DonePrefix(self.checkpoint, exactly_once=self.exactly_once, commit_every=self.commit_every,
                                  interval_s=self.commit_interval_s)
        exit_code = EXIT_OK
        committed_on_exit = False
        try:
            self._subscribe(stop_event)
            self._loop(stop_event, started, max_seconds, until_idle_s)
            self.stats.run_s_end = time.monotonic()
            self._drain(time.monotonic() + self.stop_drain_s)
            self._commit()
            committed_on_exit = True
        except EngineDeadError as exc:
            # The engine is gone: whatever it had in flight is lost, so nothing may be committed past it.
            log.error("engine died, stopping without committing: %s", exc)
            exit_code = EXIT_ENGINE_DEAD
            self.checkpoint.stop()
        except FatalPipelineError as exc:
            log.error("stopping without committing: %s", exc)
            exit_code = EXIT_PIPELINE_FATAL
            self.checkpoint.stop()
        finally:
            self.stats.run_s = time.monotonic() - started
            self._close(committed_on_exit)
        # One JSON line: benchmarks and operators parse it (gpu_bench.runner_stats) rather than a repr.
        log.info("inference runner stopped: RunnerStats %s", json.dumps(asdict(self.stats)))
        return exit_code

    def _close(self, committed: bool) -> None:
        if self.consumer is not None:
            try:
                # Leaving the group hands our partitions over at once instead of after the session timeout.
                self.consumer.close(autocommit=False)
            except Exception:  # noqa: BLE001 - closing is best effort; the broker times the member out
                log.exception("closing the consumer failed")
        if self.producer is not None:
            try:
                self.sender.close(flushed=committed)
            except Exception:  # noqa: BLE001
                log.exception("closing the producer failed")

    # --- the loop ----------------------------------------------------------------------------

    def _loop(self, stop_event: threading.Event, started: float, max_seconds: float | None,
              until_idle_s: float | None) -> None:
        last = time.monotonic()
        while not stop_event.is_set():
            if self._fatal is not None:
                raise self._fatal
            t = time.monotonic()
            self.saturation.account(t - last, self.window, self.engine.pending())
            last = t
            self.stats.run_s = t - started
            if max_seconds is not None and t - started >= max_seconds:
                break
            if (until_idle_s is not None and self._assigned and not self.window.has_work()
                    and t - self._last_activity >= until_idle_s):
                break  # idle is measured from the first assignment: joining the group takes seconds
            self._admit()
            self._fetch(stop_event)
            self._admit()
            self._poll_engine()
            self._check_saturation()
            if self.commits.due():
                self._commit()

    def _subscribe(self, stop_event: threading.Event) -> None:
        subscribe_when_known(self.consumer, [self.settings.topics.images], listener=RunnerRebalance(self),
                             should_stop=stop_event.is_set)

    def _fetch(self, stop_event: threading.Event) -> None:
        assigned = self.consumer.assignment()
        if self.window.full():
            # Paused partitions keep the member alive (poll still runs the group protocol) without fetching.
            to_pause = [tp for tp in assigned if tp not in self.consumer.paused()]
            if to_pause:
                self.consumer.pause(*to_pause)
            self.consumer.poll(timeout_ms=REBALANCE_POLL_MS if self._rebalancing else 0)
            # Nothing was fetched: the engine wait in _poll_engine is where this thread must sleep. A stale fetch
            # count here would make the loop spin on zero-timeout polls while the in-flight window is full,
            # holding the GIL that the engine's encoder and vLLM's front end need (on an H200, embeds mode then
            # ran at 9 img/s against a 100 img/s language model).
            self._fetched_last = 0
            return
        paused = self.consumer.paused()
        if paused:
            self.consumer.resume(*paused)
        if self.engine.pending() > 0:
            timeout_ms = 0  # the engine wait below is where this thread sleeps
        elif self.window.retries:
            timeout_ms = int(min(0.1, self.window.next_retry_in(time.monotonic())) * 1000)
        else:
            timeout_ms = 100
        if self._rebalancing:
            timeout_ms = max(timeout_ms, REBALANCE_POLL_MS)
        batches = poll_past_unreadable(self.consumer, timeout_ms=timeout_ms, max_records=max(1, self.window.free()))
        self.lag.observe(self.consumer, batches)
        if not batches and not assigned and not self.window.has_work():
            # Without partitions poll returns at once (kafka-python): looping on it would burn half a core.
            time.sleep(timeout_ms / 1000)
        self._fetched_last = 0
        for tp, records in batches.items():
            for record in records:
                self._accept(tp, record)
                self._fetched_last += 1
        if self._membership.left_out(assigned):  # every fetch: an assignment resets its clock
            self.consumer.unsubscribe()
            self._subscribe(stop_event)

    def _accept(self, tp: TopicPartition, record: Record) -> None:
        self.stats.records += 1
        self._last_activity = time.monotonic()
        if self.stats.first_record_at is None:
            self.stats.first_record_at = self._last_activity
        self.commits.track(tp, record.offset)
        if isinstance(record, UnreadableRecord):
            self._dead_letter(Work(record, tp, NO_META), "unreadable_record", record.error, retriable=False)
            return
        try:
            meta = decode_image_payload(record.headers)
        except SchemaError as exc:
            self._dead_letter(Work(record, tp, NO_META), "invalid_message", str(exc), retriable=False)
            return
        self.window.backlog.append(Work(record, tp, meta))

    def _admit(self) -> None:
        requests: list[InferenceRequest] = []
        for work in self.window.admissible(time.monotonic()):
            requests.extend(self._prepare(work))
        if requests:
            self.engine.submit(requests)

    def _prepare(self, work: Work) -> list[InferenceRequest]:
        work.attempts += 1
        try:
            image = self._decode_payload(work.meta, work.record.value)
        except OSError as exc:
            # Only the claim-check store does IO here. A missing or unreadable object may be a store outage or
            # an upload not yet visible (object stores are eventually consistent): worth another try. A reference
            # naming a folder, or a name too long for any file, names the same nothing next time.
            never = isinstance(exc, (IsADirectoryError, NotADirectoryError)) or exc.errno == errno.ENAMETOOLONG
            self._fail(work, "claim_check_unavailable", f"{type(exc).__name__}: {exc}", retriable=not never)
            return []
        except Exception as exc:  # noqa: BLE001 - every payload failure is a value for the dead-letter topic
            # Corrupt bytes or a size that disagrees with the metadata never get better: PayloadError says so.
            kind = getattr(exc, "error_kind", None) or "payload_invalid"
            self._fail(work, kind, f"{type(exc).__name__}: {exc}", retriable=bool(getattr(exc, "retriable", False)))
            return []
        work.request_id = f"{work.tp.topic}/{work.tp.partition}/{work.offset}#{work.attempts}"
        work.submitted_at = time.monotonic()
        self.window.start(work)
        return [InferenceRequest(request_id=work.request_id, image=image, grid_thw=tuple(work.meta.grid_thw),
                                 prompt=instruction_for(self.cfg.prompt, work.meta.metadata),
                                 max_new_tokens=self.cfg.max_new_tokens,
                                 want_embedding=self.cfg.publish_embeddings)]

    def _decode_payload(self, meta: ImagePayload, value: bytes) -> np.ndarray:
        if self._payload_decoder is None:
            self._payload_decoder = default_payload_decoder(self.settings)
        return self._payload_decoder(meta, value)

    def _poll_engine(self, timeout_s: float | None = None) -> None:
        if self.engine.pending() == 0:
            if time.monotonic() - self._liveness_at < 1.0:
                return
            # An idle engine is asked too, so a dead one stops the runner before it fetches more work.
            self._liveness_at = time.monotonic()
            timeout_s = 0.0
        if timeout_s is None:
            # Wait on the engine unless records are arriving: spinning on two zero-timeout polls would take
            # a core from a CPU engine and add nothing on a GPU one.
            timeout_s = 0.0 if self._fetched_last else 0.05
        for result in self.engine.poll(timeout_s):
            work = self.window.finish(result.request_id)
            if work is None:
                continue  # its partition was revoked and dropped: the new owner redoes it
            self._last_activity = time.monotonic()
            if isinstance(result, InferenceFailure):
                self._fail(work, result.error_kind, result.detail, retriable=result.retriable)
            else:
                self._complete(work, result)

    # --- outcomes ----------------------------------------------------------------------------

    def _complete(self, work: Work, out: InferenceOutput) -> None:
        visual_tokens = out.visual_tokens or work.meta.visual_tokens
        try:
            published = outputs.described(self.settings, self.engine, work, out, visual_tokens)
        except SchemaError as exc:
            # An output that cannot be written (a model's JSON nested past what JSON writers take) is this
            # image's failure; raised, it would stop the consumer on the same record after every restart.
            self._fail(work, "output_invalid", str(exc), retriable=False)
            return
        self.stats.described += 1
        self.stats.visual_tokens += visual_tokens
        self.stats.output_tokens += out.output_tokens or 0
        self.stats.engine_s += max(0.0, time.monotonic() - work.submitted_at)
        self._finish(work, published)

    def _fail(self, work: Work, error_kind: str, detail: str, *, retriable: bool) -> None:
        if retriable and work.attempts < self.cfg.max_attempts:
            self.stats.retries += 1
            # Back off so a transient cause (memory pressure, a restarting store) has time to clear.
            self.window.retry(work, time.monotonic() + self.retry_backoff_s * 2 ** (work.attempts - 1))
            log.info("retrying %s (attempt %d of %d): %s: %s", work.request_id, work.attempts + 1,
                     self.cfg.max_attempts, error_kind, detail[:200])
            return
        self._dead_letter(work, error_kind, detail, retriable=retriable)

    def _dead_letter(self, work: Work, error_kind: str, detail: str, *, retriable: bool) -> None:
        self.stats.dead_lettered += 1
        self.stats.dead_letters_by_kind[error_kind] = self.stats.dead_letters_by_kind.get(error_kind, 0) + 1
        log.warning("dead letter %s/%d@%d: %s after %d attempt(s): %s", work.tp.topic, work.tp.partition,
                    work.offset, error_kind, max(1, work.attempts), detail[:200])
        self._finish(work, [outputs.dead_letter(self.settings, work, error_kind, detail, retriable=retriable)])

    def _finish(self, work: Work, published: list[Output]) -> None:
        self.commits.done(work.tp, work.offset, published)
        self.stats.last_done_at = time.monotonic()

    def _commit(self) -> None:
        if self.commits.commit():
            self.stats.commits += 1

    # --- draining and rebalancing ------------------------------------------------------------

    def _drain(self, deadline: float, partitions: set[TopicPartition] | None = None) -> None:
        """Finish the work already fetched (of ``partitions``, or all), without fetching more."""
        while self.window.holds(partitions) and time.monotonic() < deadline:
            self._admit()
            if self.engine.pending() == 0 and self.window.retries:
                time.sleep(min(0.05, self.window.next_retry_in(time.monotonic())))
                continue
            self._poll_engine(0.05)

    def rebalance_started(self) -> None:
        """From the rebalance listener: wait in poll() until the assignment (see ``__init__``)."""
        self._rebalancing = True

    def partitions_assigned(self) -> None:
        self._rebalancing = False
        if not self._assigned:
            self._assigned = True
            self._last_activity = time.monotonic()

    def fail(self, exc: BaseException) -> None:
        """From the rebalance listener: the run loop raises ``exc`` next, and stops without committing."""
        self._fatal = exc

    async def revoke(self, revoked: set[TopicPartition]) -> None:
        """Finish what the revoked partitions have in hand (for up to ``revoke_drain_s``), commit, drop the rest.
        Runs on the consumer's IO thread while ``run``'s thread is blocked inside ``poll`` or ``close``."""
        if not revoked or self.checkpoint.stopped:
            return  # closing after a fatal error: the next owner redoes everything since the last commit
        self._drain(time.monotonic() + self.revoke_drain_s, revoked)
        if await self.commits.commit_from_listener():
            self.stats.commits += 1
        self.drop_partitions(revoked)

    def drop_partitions(self, partitions: set[TopicPartition]) -> None:
        """Forget the work of partitions that left us (lost, or revoked before it finished): their next owner starts
        from the commit point, and so does this runner when one comes straight back (``rewind``)."""
        self.window.drop(partitions)
        rewind(self.consumer, self.commits.forget(partitions))

    def _check_saturation(self) -> None:
        self.saturation.check(self.window)


def default_payload_decoder(settings: Settings) -> PayloadDecoder:
    """The decode stage's own codec and claim-check store, so both sides agree on the payload format.
    The store is opened on the first claim-checked payload only."""
    from vlmstream.images.claimcheck import ClaimCheckStore, claim_check_url
    from vlmstream.images.payload import payload_to_array

    stores: list[Any] = []

    def decoder(meta: ImagePayload, value: bytes) -> np.ndarray:
        if meta.claim_check and not stores:
            stores.append(ClaimCheckStore(claim_check_url(settings)))
        return payload_to_array(meta, value, stores[0] if stores else None)

    return decoder


__all__ = ["InferenceRunner", "RunnerStats", "default_payload_decoder", "EXIT_OK", "EXIT_ENGINE_DEAD",
           "EXIT_PIPELINE_FATAL", "HEADER_ATTEMPT"]
