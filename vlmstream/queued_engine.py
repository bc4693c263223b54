"""The submit/poll plumbing every engine shares (the inference engines, the condense engines): requests go into an
inbox as capacity frees up, finished ones come out of an outbox in any order. There is no batch barrier, so an
engine with continuous batching (vLLM) stays saturated. Engines never see Kafka.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Sequence


class EngineDeadError(RuntimeError):
    """Unrecoverable: the engine process or device is gone. The runner stops without committing."""


ENGINE_STOP = object()  # put on an engine's inbox to stop its worker thread
log = logging.getLogger(__name__)

ENGINE_DEAD = object()  # put on its outbox when the worker thread dies, to wake a waiting poll


class QueuedEngine:
    """The submit/poll plumbing of an engine served by worker threads: an inbox of (request, submitted_at),
    an outbox of results, and a dead or closed engine reported as EngineDeadError. Subclasses call
    ``_init_queues()`` and ``_start_worker(fn, name)``, whose fn consumes ``_inbox``; whatever it finishes goes on
    ``_outbox``. ``_stop_worker()`` closes."""

    engine_label = "engine"

    def _init_queues(self) -> None:
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._closed = False

    def submit(self, requests: Sequence[Any]) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"{self.engine_label} died: {self._dead!r}") from self._dead
        if self._closed:
            raise EngineDeadError(f"{self.engine_label} is closed")
        now = time.perf_counter()
        with self._lock:
            self._pending += len(requests)
        for request in requests:
            self._inbox.put((request, now))

    def poll(self, timeout_s: float) -> list[Any]:
        finished: list = []
        try:
            item = self._outbox.get(timeout=max(0.0, timeout_s))
            while True:
                if item is not ENGINE_DEAD:
                    finished.append(item)
                item = self._outbox.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            self._pending -= len(finished)
        # Results already finished are handed over first; the death is reported on the next poll.
        if not finished and self._dead is not None:
            raise EngineDeadError(f"{self.engine_label} died: {self._dead!r}") from self._dead
        if not finished and self._closed:
            # Closed under a runner with requests out: they will never come back, which is what dead means.
            raise EngineDeadError(f"{self.engine_label} is closed")
        return finished

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def _next_batch(self, limit: int, block: bool = True) -> tuple[list, bool]:
        """Wait for one request (``block``; else an empty batch when none is queued), then take what is queued
        now, up to ``limit``: a lone request never waits for company. Returns (batch, stop requested)."""
        try:
            first = self._inbox.get(block=block)
        except queue.Empty:
            return [], False
        if first is ENGINE_STOP:
            return [], True
        batch = [first]
        while len(batch) < max(1, limit):
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is ENGINE_STOP:
                return batch, True
            batch.append(item)
        return batch, False

    def _serve_batches(self, process, limit: int) -> None:
        """The worker thread's loop for an engine that runs whole batches: take up to ``limit`` queued requests,
        ``process`` them into results, hand those to ``poll``, until stopped. A failure of ``process`` itself is
        the engine's death: recorded for ``poll`` to raise, with the poller woken."""
        try:
            stopping = False
            while not stopping:
                batch, stopping = self._next_batch(limit)
                for result in (process(batch) if batch else ()):
                    self._outbox.put(result)
        except BaseException as exc:
            log.exception("%s: engine thread died", type(self).__name__)
            self._dead = exc
            self._outbox.put(ENGINE_DEAD)

    def _start_worker(self, target, name: str) -> None:
        """The thread that consumes ``_inbox`` (one per engine)."""
        self._worker = threading.Thread(target=target, name=name, daemon=True)
        self._worker.start()

    def _stop_worker(self, timeout_s: float = 60.0) -> bool:
        """Mark closed, tell the worker to stop and wait for it; False when already closed."""
        if self._closed:
            return False
        self._closed = True
        drop_queued(self._inbox)  # closing abandons work not yet started; the runner has not committed it
        self._inbox.put(ENGINE_STOP)
        self._worker.join(timeout=timeout_s)
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def drop_queued(inbox: queue.Queue) -> None:
    """Empty an inbox: closing abandons work not yet started (the runner has not committed it)."""
    try:
        while True:
            inbox.get_nowait()
    except queue.Empty:
        pass
