"""The small interface every inference engine implements (vLLM, transformers).

A runner submits requests as capacity frees up and polls for finished ones: there is no batch
barrier, so an engine with continuous batching (vLLM) stays saturated. Engines never see Kafka.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np


class EngineDeadError(RuntimeError):
    """Unrecoverable: the engine process or device is gone. The runner stops without committing."""


class EngineCannotLoadModel(RuntimeError):
    """The engine cannot load the configured model: raised at start, naming infer.model, before any record is read
    (never a dead letter per image)."""


@dataclass(frozen=True)
class InferenceRequest:
    request_id: str
    image: np.ndarray  # H x W x 3 uint8 RGB, at the exact model input size (multiples of the family's factor)
    grid_thw: tuple[int, int, int]  # (1, H/patch, W/patch); for the generic path an estimate (generic.py)
    prompt: str
    max_new_tokens: int
    want_embedding: bool = False


@dataclass(frozen=True)
class InferenceOutput:
    request_id: str
    text: str
    prompt_tokens: int
    output_tokens: int
    visual_tokens: int
    embedding: np.ndarray | None = None  # (out_hidden_size,) float16: the main merger's tokens, mean-pooled
    parsed_json: object | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class InferenceFailure:
    """A per-request failure (the engine is fine): the runner retries it or dead-letters it."""

    request_id: str
    error_kind: str
    detail: str
    retriable: bool = True


class Engine(Protocol):
    name: str  # "vllm" or "transformers"
    model_id: str
    revision: str | None
    mode: str | None  # "embeds" / "pixels" for vLLM; None otherwise
    # Sequences the engine runs at once (vLLM: max_num_seqs): the runner sizes its in-flight window by it.
    batch_size: int
    # Tokens the engine computes per step (vLLM: max_num_batched_tokens); None for an engine without such a bound.
    step_tokens: int | None

    def submit(self, requests: Sequence[InferenceRequest]) -> None:
        """Queue requests; returns at once."""

    def poll(self, timeout_s: float) -> list[InferenceOutput | InferenceFailure]:
        """Finished requests (in any order), waiting up to timeout_s for at least one. Raises EngineDeadError."""

    def pending(self) -> int:
        """Requests submitted and not yet returned by poll."""

    def close(self) -> None:
        """Stop the engine and release the device; no process may be left behind."""


ENGINE_STOP = object()  # put on an engine's inbox to stop its worker thread
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

    def submit(self, requests: Sequence[InferenceRequest]) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"{self.engine_label} died: {self._dead!r}") from self._dead
        if self._closed:
            raise EngineDeadError(f"{self.engine_label} is closed")
        now = time.perf_counter()
        with self._lock:
            self._pending += len(requests)
        for request in requests:
            self._inbox.put((request, now))

    def poll(self, timeout_s: float) -> list[InferenceOutput | InferenceFailure]:
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

    def _next_batch(self, limit: int) -> tuple[list, bool]:
        """Wait for one request, then take what is queued now, up to ``limit``: a lone request never waits
        for company. Returns (batch, stop requested)."""
        first = self._inbox.get()
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
