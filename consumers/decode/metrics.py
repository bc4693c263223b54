"""Decode fleet metrics: Prometheus series plus a one-line rate summary in the log.

Multiprocess choice: one endpoint per machine. The supervisor points ``PROMETHEUS_MULTIPROC_DIR`` at a
fresh folder *before* it spawns the workers; each worker's prometheus_client then writes its samples to
files there, and the supervisor serves them all, summed, on ``settings.metrics_port``
(``MultiProcessCollector``). A scrape config therefore names one port per machine however many workers
run, and a restarted worker's counts are not lost (its dead files are still summed).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

IMAGES = Counter("vlmstream_decode_images", "Images decoded and published to the images topic.")
DOCUMENTS = Counter("vlmstream_decode_documents", "Document references consumed.")
BYTES_IN = Counter("vlmstream_decode_bytes_in", "Source bytes fetched.")
BYTES_OUT = Counter("vlmstream_decode_bytes_out", "Encoded payload bytes produced.")
CLAIM_CHECKS = Counter("vlmstream_decode_claim_checks", "Payloads over the message limit, stored aside.")
ERRORS = Counter("vlmstream_decode_errors", "Images or messages sent to the dead-letter topic.", ["error_kind"])
DECODE_SECONDS = Histogram(
    "vlmstream_decode_seconds", "Stage time of one image: fetch + decode + resize + encode.",
    ["source_format", "size_class"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
# Each worker's own partitions; the endpoint sums the live workers' (a dead worker's partitions moved on).
LAG = Gauge("vlmstream_decode_lag_records", "Document records on the workers' partitions not yet fetched.",
            multiprocess_mode="livesum")

log = logging.getLogger(__name__)


@dataclass
class _Window:
    started: float
    images: int = 0
    failed: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class DecodeMetrics:
    """What one worker counts. Prometheus series for scraping; plain totals for the rate log line."""

    def __init__(self, worker: int, log_interval_s: float = 10.0) -> None:
        self.worker = worker
        self.log_interval_s = log_interval_s
        self.documents = 0
        self.images = 0
        self.failed = 0
        self.claim_checks = 0
        self._window = _Window(time.monotonic())

    def document(self) -> None:
        self.documents += 1
        DOCUMENTS.inc()

    def image(self, *, source_format: str, size_class: str, seconds: float, bytes_in: int,
              bytes_out: int) -> None:
        """One image published; ``size_class`` is the stage's label for the source size."""
        self.images += 1
        self._window.images += 1
        self._window.bytes_in += bytes_in
        self._window.bytes_out += bytes_out
        IMAGES.inc()
        BYTES_IN.inc(bytes_in)
        BYTES_OUT.inc(bytes_out)
        DECODE_SECONDS.labels(source_format or "unknown", size_class).observe(seconds)

    def lag(self, records: int) -> None:
        LAG.set(records)

    def claim_check(self) -> None:
        self.claim_checks += 1
        CLAIM_CHECKS.inc()

    def error(self, error_kind: str) -> None:
        self.failed += 1
        self._window.failed += 1
        ERRORS.labels(error_kind).inc()

    def maybe_log(self, force: bool = False) -> None:
        window = self._window
        elapsed = time.monotonic() - window.started
        if not force and elapsed < self.log_interval_s:
            return
        if window.images or window.failed or force:
            mb = 1024 * 1024
            log.info("decode worker %d: %d images in %.1fs (%.1f/s), in %.1f MB/s, out %.1f MB/s, %d failed",
                     self.worker, window.images, elapsed, window.images / max(elapsed, 1e-9),
                     window.bytes_in / mb / max(elapsed, 1e-9), window.bytes_out / mb / max(elapsed, 1e-9),
                     window.failed)
        self._window = _Window(time.monotonic())


# --- the supervisor's side --------------------------------------------------------------------


def prepare_multiprocess_dir() -> str | None:
    """Point ``PROMETHEUS_MULTIPROC_DIR`` at a fresh folder, inherited by the workers spawned next.

    Returns the folder when this call created it (the caller removes it at exit), None when the
    operator already set one (theirs to manage).
    """
    if os.environ.get(MULTIPROC_ENV):
        os.makedirs(os.environ[MULTIPROC_ENV], exist_ok=True)
        return None
    folder = tempfile.mkdtemp(prefix="vlmstream-decode-metrics-")
    os.environ[MULTIPROC_ENV] = folder
    return folder


def serve_multiprocess(port: int) -> None:
    """Serve every worker's samples, summed, on ``port`` (a daemon thread of the supervisor)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    start_http_server(port, registry=registry)
    log.info("decode metrics on http://0.0.0.0:%d/metrics (%d is summed over workers)", port, port)


def mark_worker_dead(pid: int) -> None:
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def remove_multiprocess_dir(folder: str | None) -> None:
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
