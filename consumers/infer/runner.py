"""The inference consumer: owns the Kafka clients, keeps the engine saturated, commits what is done.

One thread drives everything: fetch image records, turn them into arrays, submit requests as capacity
frees (no batch barrier), poll finished requests (in any order), publish their outputs, commit.
The engine never sees Kafka; this module never runs a model.

Offsets: completion is out of order, so an ``OffsetTracker`` per partition yields the commit point
(the lowest offset still pending). A commit is three numbered steps: flush the producer, raise if a
send failed, commit synchronously. With ``exactly_once`` the outputs and the offsets go in one
transaction, and an output is published only once its message lies inside the committed prefix
(out-of-order completions wait in memory), so a crash can never publish the same image twice.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
from kafka import TopicPartition
from kafka.consumer.subscription_state import AsyncConsumerRebalanceListener
from kafka.structs import OffsetAndMetadata

from consumers.infer.engine import Engine, EngineDeadError, InferenceFailure, InferenceOutput, InferenceRequest
from schemas import (Description, Embedding, ImagePayload, SchemaError, decode_image_payload, now,
                     source_coords)
from schemas.messages import HEADER_ATTEMPT
from vlmstream.config import Settings
from vlmstream.kafka.clients import make_consumer, make_producer, unique_client_id
from vlmstream.kafka.errors import FatalPipelineError, GROUP_MOVED_ON
from vlmstream.kafka.group import GroupMembershipWatchdog, rewind, subscribe_when_known
from vlmstream.kafka.offsets import OffsetTracker
from vlmstream.kafka.records import UnreadableRecord, dead_letter_from_record, poll_past_unreadable

log = logging.getLogger(__name__)

EXIT_OK = 0
# How long poll() waits while a rebalance is under way (see InferenceRunner._rebalancing).
REBALANCE_POLL_MS = 200
EXIT_ENGINE_DEAD = 3
EXIT_PIPELINE_FATAL = 4

PayloadDecoder = Callable[[ImagePayload, bytes], np.ndarray]


@dataclass
class RunnerStats:
    records: int = 0
    described: int = 0
    dead_lettered: int = 0
    retries: int = 0
    visual_tokens: int = 0
    commits: int = 0
    run_s: float = 0.0
    engine_idle_s: float = 0.0  # wall time with nothing submitted to the engine
    idle_with_work_s: float = 0.0  # ... while records were waiting: the runner, not the input, starved it
    first_record_at: float | None = None  # monotonic
    last_done_at: float | None = None
    idle_after_first_s: float = 0.0
    in_flight_area: float = 0.0  # integral of images in the engine over time, after the first record

    @property
    def engine_idle_fraction(self) -> float:
        return self.engine_idle_s / self.run_s if self.run_s else 0.0

    @property
    def active_s(self) -> float:
        """From the first record fetched to the last one finished: the span where the engine could work."""
        if self.first_record_at is None or self.last_done_at is None:
            return 0.0
        return self.last_done_at - self.first_record_at

    @property
    def active_idle_fraction(self) -> float:
        """Share of ``active_s`` with nothing submitted to the engine (group joins and the idle tail excluded)."""
        if not self.active_s:
            return 0.0
        tail = max(0.0, self.run_s_end - self.last_done_at) if self.last_done_at is not None else 0.0
        return min(1.0, max(0.0, self.idle_after_first_s - tail) / self.active_s)

    run_s_end: float = 0.0

    @property
    def mean_in_flight(self) -> float:
        """Images in the engine on average over the active window: below the batch size, batches run part-empty."""
        return self.in_flight_area / self.active_s if self.active_s else 0.0


@dataclass
class _Work:
    record: Any
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


Output = tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]  # topic, key, value, headers


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
        self.engine_batch_size = int(getattr(engine, "batch_size", None) or self.cfg.batch_size)
        # Tokens the engine computes per step (vLLM: max_num_batched_tokens); None for engines without one.
        self.engine_step_tokens = getattr(engine, "step_tokens", None)
        self.max_images_in_flight = self.cfg.images_in_flight(self.engine_batch_size)
        # Committing every in-flight window bounds what a crash redoes to about two windows.
        self.commit_every = commit_every or max(1, self.max_images_in_flight)
        self.stats = RunnerStats()

        self._tracker = OffsetTracker()
        self._backlog: deque[_Work] = deque()
        self._retries: list[tuple[float, int, _Work]] = []
        self._seq = itertools.count()
        self._in_flight: dict[str, _Work] = {}
        self._tokens_in_flight = 0
        self._send_errors: list[BaseException] = []
        self._held: dict[TopicPartition, dict[int, list[Output]]] = {}  # exactly-once: outputs awaiting their prefix
        self._done_since_commit = 0
        self._last_commit = time.monotonic()
        self._last_activity = time.monotonic()
        self._warned: dict[str, float] = {}
        self._assigned = False
        # From a rebalance's start (revoke) to its end (assignment); the first join counts too. kafka-python 3.0
        # throws away a join that completes while no poll() waits for it and sends a new JoinGroup, so a runner
        # polling with a zero timeout (engine busy, window full) never finished a rebalance: it must wait in poll.
        self._rebalancing = True
        self._fetched_last = 0
        self._liveness_at = time.monotonic()
        self._no_commit = False
        self._fatal: BaseException | None = None  # raised in the rebalance listener, re-raised by the loop
        self._window = [time.monotonic(), 0.0, 0.0]  # start, idle, idle while records waited
        self.consumer = None
        self.producer = None

    # --- lifecycle ---------------------------------------------------------------------------

    def run(self, stop_event: threading.Event | None = None, max_seconds: float | None = None,
            until_idle_s: float | None = None) -> int:
        stop_event = stop_event or threading.Event()
        started = time.monotonic()
        self._warn_static_settings()
        self.producer = make_producer(self.settings, transactional_id=self.transactional_id if self.exactly_once
                                      else None, **({"transaction_timeout_ms": 15_000} if self.exactly_once else {}))
        if self.exactly_once:
            self.producer.init_transactions()
        client_id = unique_client_id(self.settings, "infer")
        self._membership = GroupMembershipWatchdog(self.settings, self.group_id, client_id)
        self.consumer = make_consumer(self.settings, self.group_id, (), client_id=client_id,
                                      max_poll_records=max(1, min(self.max_images_in_flight, 500)),
                                      # A killed worker's images move to the others after this, not after 45 s;
                                      # heartbeats run on kafka-python's IO thread, so a long batch is no risk.
                                      session_timeout_ms=getattr(self.cfg, "session_timeout_ms", 10_000))
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
            self._no_commit = True
        except FatalPipelineError as exc:
            log.error("stopping without committing: %s", exc)
            exit_code = EXIT_PIPELINE_FATAL
            self._no_commit = True
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
                self.producer.close(timeout=10 if committed else 0)
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
            self._account_idle(t - last)
            last = t
            self.stats.run_s = t - started
            if max_seconds is not None and t - started >= max_seconds:
                break
            if (until_idle_s is not None and self._assigned and not self._has_work()
                    and t - self._last_activity >= until_idle_s):
                break  # idle is measured from the first assignment: joining the group takes seconds
            self._admit()
            self._fetch(stop_event)
            self._admit()
            self._poll_engine()
            self._check_saturation()
            if self._commit_due():
                self._commit()

    def _subscribe(self, stop_event: threading.Event) -> None:
        subscribe_when_known(self.consumer, [self.settings.topics.images], listener=_Rebalance(self),
                             should_stop=stop_event.is_set)

    def _has_work(self) -> bool:
        return bool(self._backlog or self._retries or self._in_flight)

    def _account_idle(self, dt: float) -> None:
        if self.stats.first_record_at is not None:
            self.stats.in_flight_area += dt * len(self._in_flight)
        if self.engine.pending() == 0:
            self.stats.engine_idle_s += dt
            if self.stats.first_record_at is not None:
                self.stats.idle_after_first_s += dt
            self._window[1] += dt
            if self._backlog or self._retries:
                self.stats.idle_with_work_s += dt
                self._window[2] += dt

    def _room(self, tokens: int) -> bool:
        if not self._in_flight:
            return True  # one image larger than the token bound must still get through, alone
        return (len(self._in_flight) < self.max_images_in_flight
                and self._tokens_in_flight + tokens <= self.cfg.max_visual_tokens_in_flight)

    def _fetch(self, stop_event: threading.Event) -> None:
        assigned = self.consumer.assignment()
        full = bool(self._backlog) or len(self._in_flight) >= self.max_images_in_flight
        if full:
            # Paused partitions keep the member alive (poll still runs the group protocol) without fetching.
            to_pause = [tp for tp in assigned if tp not in self.consumer.paused()]
            if to_pause:
                self.consumer.pause(*to_pause)
            self.consumer.poll(timeout_ms=REBALANCE_POLL_MS if self._rebalancing else 0)
            # Nothing was fetched: the engine wait in _poll_engine is where this thread must sleep. Leaving
            # the last fetch count here made the loop spin on zero-timeout polls whenever the in-flight window
            # was full, holding the GIL the engine's encoder and vLLM's front end need (measured on the H200:
            # embeds mode 9 img/s against a 100 img/s language model).
            self._fetched_last = 0
            return
        paused = self.consumer.paused()
        if paused:
            self.consumer.resume(*paused)
        if self.engine.pending() > 0:
            timeout_ms = 0  # the engine wait below is where this thread sleeps
        elif self._retries:
            timeout_ms = int(max(0.0, min(0.1, self._retries[0][0] - time.monotonic())) * 1000)
        else:
            timeout_ms = 100
        if self._rebalancing:
            timeout_ms = max(timeout_ms, REBALANCE_POLL_MS)
        free = self.max_images_in_flight - len(self._in_flight)
        batches = poll_past_unreadable(self.consumer, timeout_ms=timeout_ms, max_records=max(1, free))
        if not batches and not assigned and not self._has_work():
            # Without partitions poll returns at once (kafka-python): looping on it burned half a core.
            time.sleep(timeout_ms / 1000)
        self._fetched_last = 0
        for tp, records in batches.items():
            for record in records:
                self._accept(tp, record)
                self._fetched_last += 1
        if self._membership.left_out(assigned):  # every fetch: an assignment resets its clock
            self.consumer.unsubscribe()
            self._subscribe(stop_event)

    def _accept(self, tp: TopicPartition, record: Any) -> None:
        self.stats.records += 1
        self._last_activity = time.monotonic()
        if self.stats.first_record_at is None:
            self.stats.first_record_at = self._last_activity
        self._tracker.track(tp, record.offset)
        if isinstance(record, UnreadableRecord):
            self._dead_letter(_Work(record, tp, _NO_META), "unreadable_record", record.error, retriable=False)
            return
        try:
            meta = decode_image_payload(record.headers)
        except SchemaError as exc:
            self._dead_letter(_Work(record, tp, _NO_META), "invalid_message", str(exc), retriable=False)
            return
        self._backlog.append(_Work(record, tp, meta))

    def _admit(self) -> None:
        requests: list[InferenceRequest] = []
        t = time.monotonic()
        while self._retries and self._retries[0][0] <= t and self._room(self._retries[0][2].tokens):
            requests.extend(self._prepare(heapq.heappop(self._retries)[2]))
        while self._backlog and self._room(self._backlog[0].tokens):
            requests.extend(self._prepare(self._backlog.popleft()))
        if requests:
            self.engine.submit(requests)

    def _prepare(self, work: _Work) -> list[InferenceRequest]:
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
        self._in_flight[work.request_id] = work
        self._tokens_in_flight += work.tokens
        return [InferenceRequest(request_id=work.request_id, image=image, grid_thw=tuple(work.meta.grid_thw),
                                 prompt=self.cfg.prompt, max_new_tokens=self.cfg.max_new_tokens,
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
            work = self._in_flight.pop(result.request_id, None)
            if work is None:
                continue  # its partition was revoked and dropped: the new owner redoes it
            self._tokens_in_flight -= work.tokens
            self._last_activity = time.monotonic()
            if isinstance(result, InferenceFailure):
                self._fail(work, result.error_kind, result.detail, retriable=result.retriable)
            else:
                self._complete(work, result)

    # --- outcomes ----------------------------------------------------------------------------

    def _complete(self, work: _Work, out: InferenceOutput) -> None:
        meta, t = work.meta, time.monotonic()
        timings = {k: float(v) for k, v in (out.timings_ms or {}).items()}
        timings["queue_ms"] = round((work.submitted_at - work.polled_at) * 1000, 3)
        timings["engine_ms"] = round((t - work.submitted_at) * 1000, 3)
        timings["total_ms"] = round((t - work.polled_at) * 1000, 3)
        if work.record.timestamp and work.record.timestamp > 0:
            timings["since_produced_ms"] = round(max(0.0, time.time() * 1000 - work.record.timestamp), 3)
        if meta.decode_ms is not None:
            timings["decode_ms"] = float(meta.decode_ms)
        coords = source_coords(work.tp.topic, work.tp.partition, work.offset)
        visual_tokens = out.visual_tokens or meta.visual_tokens
        try:
            outputs = self._outputs(work, out, timings, coords, visual_tokens)
        except SchemaError as exc:
            # An output that cannot be written (a model's JSON nested past what JSON writers take) is this
            # image's failure; raised, it would stop the consumer on the same record after every restart.
            self._fail(work, "output_invalid", str(exc), retriable=False)
            return
        self.stats.described += 1
        self.stats.visual_tokens += visual_tokens
        self._finish(work, outputs)

    def _outputs(self, work: _Work, out: InferenceOutput, timings: dict, coords: dict,
                 visual_tokens: int) -> list[Output]:
        meta = work.meta
        description = Description(
            doc_id=meta.doc_id, image_index=meta.image_index, image_count=meta.image_count,
            source_uri=meta.source_uri or None, text=out.text, json=out.parsed_json,
            model=self.engine.model_id, revision=self.engine.revision, prompt_id=self.cfg.prompt_id,
            engine=self.engine.name, mode=self.engine.mode, prompt_tokens=out.prompt_tokens,
            output_tokens=out.output_tokens, visual_tokens=visual_tokens, timings_ms=timings,
            metadata=dict(meta.metadata or {}), source=coords, created_at=now())
        outputs: list[Output] = [(self.settings.topics.descriptions, description.key(), description.encode(),
                                  description.headers())]
        if self.cfg.publish_embeddings and out.embedding is not None:
            embedding = Embedding.from_vector(
                out.embedding, doc_id=meta.doc_id, image_index=meta.image_index, image_count=meta.image_count,
                model=self.engine.model_id, grid_thw=tuple(meta.grid_thw), source=coords, created_at=now())
            outputs.append((self.settings.topics.embeddings, embedding.key(), embedding.encode(),
                            embedding.headers()))
        return outputs

    def _fail(self, work: _Work, error_kind: str, detail: str, *, retriable: bool) -> None:
        if retriable and work.attempts < self.cfg.max_attempts:
            self.stats.retries += 1
            # Back off so a transient cause (memory pressure, a restarting store) has time to clear.
            due = time.monotonic() + self.retry_backoff_s * 2 ** (work.attempts - 1)
            heapq.heappush(self._retries, (due, next(self._seq), work))
            log.info("retrying %s (attempt %d of %d): %s: %s", work.request_id, work.attempts + 1,
                     self.cfg.max_attempts, error_kind, detail[:200])
            return
        self._dead_letter(work, error_kind, detail, retriable=retriable)

    def _dead_letter(self, work: _Work, error_kind: str, detail: str, *, retriable: bool) -> None:
        meta = work.meta if work.meta is not _NO_META else None
        letter = dead_letter_from_record(
            work.record, stage="infer", error_kind=error_kind, detail=detail, retriable=retriable,
            doc_id=meta.doc_id if meta else None, image_index=meta.image_index if meta else None,
            image_count=meta.image_count if meta else None, source_uri=meta.source_uri if meta else None,
            attempts=max(1, work.attempts))
        self.stats.dead_lettered += 1
        log.warning("dead letter %s/%d@%d: %s after %d attempt(s): %s", work.tp.topic, work.tp.partition,
                    work.offset, error_kind, max(1, work.attempts), detail[:200])
        self._finish(work, [(self.settings.topics.deadletter, letter.key(), letter.encode(), letter.headers())])

    def _finish(self, work: _Work, outputs: list[Output]) -> None:
        if self.exactly_once:
            # Held until the message is inside the committed prefix (see the module docstring).
            self._held.setdefault(work.tp, {})[work.offset] = outputs
        else:
            for output in outputs:
                self._send(output)
        self._tracker.done(work.tp, work.offset)
        self._done_since_commit += 1
        self.stats.last_done_at = time.monotonic()

    def _send(self, output: Output) -> None:
        topic, key, value, headers = output
        future = self.producer.send(topic, value=value, key=key, headers=headers)
        future.add_errback(self._send_errors.append)

    # --- commits -----------------------------------------------------------------------------

    def _commit_due(self) -> bool:
        return self._done_since_commit > 0 and (
            self._done_since_commit >= self.commit_every
            or time.monotonic() - self._last_commit >= self.commit_interval_s)

    def _commit(self, committer: Callable[[dict], None] | None = None) -> dict[TopicPartition, int]:
        """Commit the done prefix of every partition. ``committer`` replaces ``consumer.commit`` inside
        the rebalance listener, where a blocking consumer call is not allowed."""
        points = self._tracker.commit_point()
        self._done_since_commit = 0
        self._last_commit = time.monotonic()
        if not points:
            return {}
        offsets = {tp: OffsetAndMetadata(point, "", -1) for tp, point in points.items()}
        if self.exactly_once:
            self._commit_transaction(points, offsets)
        else:
            # 1. flush the producer: every output of a message below the commit point is acknowledged
            self.producer.flush(timeout=self.settings.kafka.request_timeout_ms / 1000)
            # 2. raise if a send failed: committing past its message would lose that output for good
            self._raise_on_send_errors()
            # 3. commit synchronously, so a crash after this line never redoes these messages
            (committer or self._commit_sync)(offsets)
        self.stats.commits += 1
        log.debug("committed %s", {f"{tp.topic}/{tp.partition}": p for tp, p in points.items()})
        return points

    def _commit_sync(self, offsets: dict) -> None:
        try:
            self.consumer.commit(offsets)
        except GROUP_MOVED_ON as exc:
            # The group rebalanced under us (a long stall, a new member): these partitions may be someone else's
            # now. Nothing is lost: their new owner redoes what we could not commit (duplicates may follow).
            log.warning("commit refused, the group moved on; duplicates may follow: %r", exc)

    def _commit_transaction(self, points: dict[TopicPartition, int], offsets: dict) -> None:
        self.producer.begin_transaction()
        try:
            for tp, point in points.items():
                held = self._held.get(tp, {})
                for offset in sorted(o for o in held if o < point):
                    for output in held.pop(offset):
                        self._send(output)
            self.producer.send_offsets_to_transaction(offsets, self.consumer.group_metadata())
            # 1.-3. in one step: commit_transaction flushes the outputs and commits them with the offsets
            self.producer.commit_transaction()
            self._raise_on_send_errors()
        except FatalPipelineError:
            raise
        except Exception as exc:
            try:
                self.producer.abort_transaction()
            except Exception:  # noqa: BLE001 - a fenced producer cannot abort; the broker will
                pass
            raise FatalPipelineError(f"transaction failed, nothing committed: {exc!r}") from exc

    def _raise_on_send_errors(self) -> None:
        if self._send_errors:
            errors, self._send_errors = self._send_errors, []
            raise FatalPipelineError(f"{len(errors)} output(s) were not acknowledged, first: {errors[0]!r}")

    # --- draining and rebalancing ------------------------------------------------------------

    def _drain(self, deadline: float, partitions: set[TopicPartition] | None = None) -> None:
        """Finish the work already fetched (of ``partitions``, or all), without fetching more."""
        def left() -> bool:
            pool = list(self._in_flight.values()) + [w for _, _, w in self._retries] + list(self._backlog)
            return any(partitions is None or w.tp in partitions for w in pool)

        while left() and time.monotonic() < deadline:
            self._admit()
            if self.engine.pending() == 0 and self._retries:
                time.sleep(min(0.05, max(0.0, self._retries[0][0] - time.monotonic())))
                continue
            self._poll_engine(0.05)

    def on_revoked(self, revoked: set[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
        """Runs on the consumer's IO thread while ``run``'s thread is blocked inside ``poll`` or ``close``.
        Returns the offsets still to commit (the listener awaits the commit)."""
        revoked = set(revoked)
        if not revoked or self._no_commit:
            return {}  # closing after a fatal error: the next owner redoes everything since the last commit
        self._drain(time.monotonic() + self.revoke_drain_s, revoked)
        resume = self._tracker.resume_points(revoked)
        # What did not finish in time is dropped: the next owner starts again from the commit point.
        for rid in [rid for rid, w in self._in_flight.items() if w.tp in revoked]:
            self._tokens_in_flight -= self._in_flight.pop(rid).tokens
        self._backlog = deque(w for w in self._backlog if w.tp not in revoked)
        self._retries = [r for r in self._retries if r[2].tp not in revoked]
        heapq.heapify(self._retries)
        collected: dict[TopicPartition, OffsetAndMetadata] = {}
        self._commit(committer=collected.update)
        self._tracker.forget(revoked)
        for tp in revoked:
            self._held.pop(tp, None)
        rewind(self.consumer, resume)  # a partition that comes back to us resumes at its dropped work
        return collected

    # --- saturation warnings -----------------------------------------------------------------

    def _warn_static_settings(self) -> None:
        if self.max_images_in_flight < self.engine_batch_size:
            log.warning("max_images_in_flight=%d is below the engine's batch size %d: the engine never gets a "
                        "full batch", self.max_images_in_flight, self.engine_batch_size)

    def _warn(self, key: str, message: str, *args: Any) -> None:
        t = time.monotonic()
        if t - self._warned.get(key, -1e9) >= 30.0:
            self._warned[key] = t
            log.warning(message, *args)

    def _check_saturation(self) -> None:
        # Few large images can still keep an engine busy: with two steps' worth of visual tokens queued (a 12.8 MP
        # image is ~7,000) vLLM has full prefill steps ahead, however many sequences it could decode at once.
        starved_of_tokens = self.engine_step_tokens is None or self._tokens_in_flight < 2 * self.engine_step_tokens
        if (self._backlog and self._in_flight and len(self._in_flight) < self.engine_batch_size
                and len(self._in_flight) < self.max_images_in_flight and starved_of_tokens):
            self._warn("tokens", "max_visual_tokens_in_flight=%d holds only %d image(s), fewer than the engine's "
                       "batch size %d: partitions are paused while the engine could take more",
                       self.cfg.max_visual_tokens_in_flight, len(self._in_flight), self.engine_batch_size)
        start, idle, idle_with_work = self._window
        span = time.monotonic() - start
        if span < 10.0:
            return
        if idle_with_work / span > 0.2:
            self._warn("idle", "the engine was idle %.0f%% of the last %.0f s while records waited: payload "
                       "decoding or the in-flight bounds keep it from being busy", 100 * idle_with_work / span,
                       span)
        self._window = [time.monotonic(), 0.0, 0.0]


class _Rebalance(AsyncConsumerRebalanceListener):
    """Drain, flush and commit revoked partitions before the group hands them to another member.

    kafka-python 3 calls listeners on the consumer's IO thread, where a blocking ``consumer.commit``
    is refused; the async form lets us await the coordinator's commit on that loop instead.
    """

    def __init__(self, runner: InferenceRunner):
        self.runner = runner

    async def on_partitions_revoked(self, revoked):
        self.runner._rebalancing = True  # eager protocol: every rebalance starts here, with or without partitions
        try:
            offsets = self.runner.on_revoked(set(revoked))
        except (EngineDeadError, FatalPipelineError) as exc:
            # kafka-python would only log it; the run loop must stop without committing.
            self.runner._fatal = exc
            return
        if offsets and not self.runner.exactly_once:
            coordinator = self.runner.consumer._coordinator  # noqa: SLF001 - the only non-blocking commit path
            try:
                await coordinator._commit_offsets_sync_async(offsets)  # noqa: SLF001
            except Exception as exc:  # noqa: BLE001
                # The group moved on without us: the new owner redoes these messages (duplicates, no loss).
                log.warning("commit on revoke failed, duplicates may follow: %r", exc)

    async def on_partitions_assigned(self, assigned):
        self.runner._rebalancing = False
        if not self.runner._assigned:
            self.runner._assigned = True
            self.runner._last_activity = time.monotonic()
        log.info("assigned %s", sorted(f"{tp.topic}/{tp.partition}" for tp in assigned))

    async def on_partitions_lost(self, lost):
        # Membership is already gone: committing would be refused; forget the work and let the owner redo it.
        runner = self.runner
        runner._rebalancing = True
        lost = set(lost)
        rewind(runner.consumer, runner._tracker.resume_points(lost))
        for rid in [rid for rid, w in runner._in_flight.items() if w.tp in lost]:
            runner._tokens_in_flight -= runner._in_flight.pop(rid).tokens
        runner._backlog = deque(w for w in runner._backlog if w.tp not in lost)
        runner._retries = [r for r in runner._retries if r[2].tp not in lost]
        heapq.heapify(runner._retries)
        runner._tracker.forget(lost)
        for tp in lost:
            runner._held.pop(tp, None)


_NO_META = ImagePayload(doc_id="-", image_index=0, image_count=1, source_uri="-", codec="raw", width=0, height=0,
                        grid_thw=(1, 0, 0))


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
