"""The decode fleet on one machine: a supervisor process (``run_fleet``) starts N worker processes, each running one
``DecodeWorker`` (``runner.py``: the Kafka side of one process), restarts a crashed one with a backoff, and turns a
SIGTERM/SIGINT into a drain. Any number of machines can run a supervisor with the same group id."""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from consumers.decode import metrics
from consumers.decode.runner import EXIT_OK, DecodeWorker
from vlmstream.config import Settings
from vlmstream.stopping import Stop, exit_status

log = logging.getLogger(__name__)

# Backoff of a worker that keeps crashing: 1, 2, 4 ... seconds, never more than this.
MAX_RESTART_BACKOFF_S = 30.0
# How long the supervisor waits for a stopping worker to finish its batch, flush and commit (``drain_timeout_s``).
DRAIN_TIMEOUT_S = 120.0


def _worker_main(settings: Settings, index: int, stop_event: Any, until_idle_s: float | None,
                 deadline_epoch: float | None, supervisor: int | None = None) -> None:
    """A worker process's entry: its logging, threads and niceness, a stop that follows the supervisor, then one
    ``DecodeWorker`` until it stops; its status is the process's exit status."""
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    # Decoding holds this process's CPU (and at times the GIL), so kafka-python's IO loop reports "slow" tasks
    # all the time; heartbeats still go out (they would show as session timeouts, which are logged).
    logging.getLogger("kafka.net.selector").setLevel(logging.ERROR)
    # Parallelism is one process per core; an OpenCV thread pool in each would only oversubscribe the cores.
    import cv2

    cv2.setNumThreads(1)
    if settings.decode.niceness:
        os.nice(settings.decode.niceness)
    # A supervisor killed with SIGKILL cannot tell us: the kernel (or the watchdog) says it is gone.
    stopping = Stop(f"decode worker {index}").install(parent=supervisor)
    deadline = None
    if deadline_epoch is not None:
        deadline = time.monotonic() + max(0.0, deadline_epoch - time.time())

    def should_stop() -> bool:
        return stopping.is_set() or stop_event.is_set()

    worker = DecodeWorker(settings, index, stop=should_stop, until_idle_s=until_idle_s, deadline=deadline)
    raise SystemExit(worker.run())


@dataclass
class _Slot:
    index: int
    process: Any = None
    finished: bool = False
    crashes: deque = field(default_factory=deque)
    restart_at: float = 0.0


class DecodeFleet:
    """Supervisor: starts the workers, restarts a crashed one, forwards SIGTERM/SIGINT as a drain.

    Stopping takes at most ``drain_timeout_s`` (120 s) whether or not the cluster answers: each worker finishes
    the document in hand, then flushes, commits and closes, each step bounded by ``kafka.request_timeout_ms``
    (``runner.worker_drain_bound_s``); an output the cluster did not acknowledge means no commit and exit status 1.
    A worker still running at ``drain_timeout_s`` is killed (its documents repeat from the last commit). A crashed
    worker waiting for its restart is not restarted once stopping."""

    def __init__(self, settings: Settings, *, workers: int | None = None, until_idle_s: float | None = None,
                 max_seconds: float | None = None, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        count = workers if workers is not None else settings.decode.workers
        self.settings = settings
        self.workers = count if count > 0 else (os.cpu_count() or 1)
        self.until_idle_s = until_idle_s
        self.max_seconds = max_seconds
        self.drain_timeout_s = drain_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._stop_event = self._ctx.Event()
        self._stopping = False
        self._slots = [_Slot(i) for i in range(self.workers)]
        self._failed = False
        self._stop_time = 0.0

    def stop(self, *_args: Any) -> None:
        if not self._stopping:
            log.info("decode fleet: stopping; workers finish the document in hand, flush and commit")
            self._stop_time = time.monotonic()
        self._stopping = True
        # The shared event reaches every worker between documents; a signal would kill one that is still
        # importing (its handler not yet installed), which then looks like a crash.
        self._stop_event.set()

    def _stop_now(self, signum: int) -> None:
        """A second signal: the workers are killed (their documents repeat from the last commit), and so is this."""
        for slot in self._slots:
            if slot.process is not None and slot.process.is_alive():
                slot.process.kill()
        logging.shutdown()
        os._exit(exit_status(signum))

    def worker_pids(self) -> dict[int, int]:
        return {s.index: s.process.pid for s in self._slots if s.process is not None and s.process.is_alive()}

    def run(self) -> int:
        metrics_dir = None
        if self.settings.metrics_port > 0:
            metrics_dir = metrics.prepare_multiprocess_dir()
            metrics.serve_multiprocess(self.settings.metrics_port)
        stop = Stop("vlmstream decode", on_first=self.stop, now=self._stop_now).install()
        deadline = time.time() + self.max_seconds if self.max_seconds else None
        try:
            for slot in self._slots:
                self._start(slot, deadline)
            while True:
                if deadline is not None and time.time() >= deadline and not self._stopping:
                    self.stop()
                self._reap(deadline)
                if all(s.finished for s in self._slots):
                    break
                if self._stopping and time.monotonic() - self._stop_time > self.drain_timeout_s:
                    self._kill_stragglers()
                time.sleep(0.2)
        finally:
            stop.restore()
            metrics.remove_multiprocess_dir(metrics_dir)
        return 1 if self._failed else 0

    def _start(self, slot: _Slot, deadline: float | None) -> None:
        slot.process = self._ctx.Process(
            target=_worker_main, name=f"decode-worker-{slot.index}",
            args=(self.settings, slot.index, self._stop_event, self.until_idle_s, deadline, os.getpid()))
        slot.process.start()
        log.info("decode fleet: worker %d started (pid %d)", slot.index, slot.process.pid)

    def _reap(self, deadline: float | None) -> None:
        for slot in self._slots:
            if slot.finished:
                continue
            process = slot.process
            if process is None:
                if not self._stopping and time.monotonic() >= slot.restart_at:
                    self._start(slot, deadline)
                elif self._stopping:
                    slot.finished = True
                continue
            if process.is_alive():
                continue
            process.join()
            metrics.mark_worker_dead(process.pid)
            code = process.exitcode
            if code == EXIT_OK:
                slot.finished = True
                continue
            if self._stopping:
                log.warning("decode fleet: worker %d exited with %s while stopping", slot.index, code)
                self._failed = True
                slot.finished = True
                continue
            now_ = time.monotonic()
            slot.crashes.append(now_)
            while slot.crashes and now_ - slot.crashes[0] > 60:
                slot.crashes.popleft()
            backoff = min(MAX_RESTART_BACKOFF_S, 2.0 ** (len(slot.crashes) - 1))
            log.warning("decode fleet: worker %d (pid %d) exited with %s; restarting in %.0f s",
                        slot.index, process.pid, code, backoff)
            slot.process = None
            slot.restart_at = now_ + backoff

    def _kill_stragglers(self) -> None:
        for slot in self._slots:
            if slot.process is not None and slot.process.is_alive():
                log.error("decode fleet: worker %d did not drain in %.0f s; killing it (its documents "
                          "repeat from the last commit)", slot.index, self.drain_timeout_s)
                slot.process.kill()
                self._failed = True


def run_fleet(settings: Settings, *, workers: int | None = None, until_idle_s: float | None = None,
              max_seconds: float | None = None) -> int:
    """Run the decode workers of this machine until stopped (signal, ``max_seconds``, or idle); exit status."""
    return DecodeFleet(settings, workers=workers, until_idle_s=until_idle_s, max_seconds=max_seconds).run()
