"""What every long-running process's Prometheus endpoint shares: serving a set of collectors on a port, and the
GPU memory of this process where it has CUDA (absent otherwise: never a zero that looks like a reading).

Each stage keeps its own collector over its stats (``consumers/infer/metrics.py``,
``consumers/results/metrics.py``, ``consumers/condense/runner.py``, ``producers/metrics.py``), read at scrape time;
decode's workers write prometheus_client's multiprocess files instead (``consumers/decode/metrics.py``)."""

from __future__ import annotations

import logging
import sys
from typing import Any, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)


def serve(port: int, collectors: Iterable[Any], what: str) -> None:
    """Serve ``collectors`` on ``port`` (a daemon thread); ``what`` names the process in the log line."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    start_http_server(port, registry=registry)
    log.info("%s metrics on http://0.0.0.0:%d/metrics", what, port)


def counters(rows: Iterable[tuple[str, str, float]]) -> Iterator[CounterMetricFamily]:
    """One unlabelled counter per ``(name, help, value)`` row: a collector's running totals."""
    for name, doc, value in rows:
        family = CounterMetricFamily(name, doc)
        family.add_metric([], value)
        yield family


def gauges(rows: Iterable[tuple[str, str, float]]) -> Iterator[GaugeMetricFamily]:
    """One unlabelled gauge per ``(name, help, value)`` row: a collector's readings of now."""
    for name, doc, value in rows:
        family = GaugeMetricFamily(name, doc)
        family.add_metric([], value)
        yield family


def dead_letters(name: str, doc: str, by_kind: dict[str, int]) -> CounterMetricFamily:
    """A counter labelled ``error_kind``: a stage's dead letters by the kind its failures name."""
    family = CounterMetricFamily(name, doc, labels=["error_kind"])
    for kind, count in sorted(by_kind.items()):
        family.add_metric([kind], count)
    return family


def gpu_memory_names(prefix: str) -> tuple[str, str]:
    """The names ``gpu_memory`` exports under ``prefix``: allocated, reserved."""
    return f"{prefix}_gpu_memory_allocated_bytes", f"{prefix}_gpu_memory_reserved_bytes"


def gpu_memory(prefix: str) -> Iterator[GaugeMetricFamily]:
    """``{prefix}_gpu_memory_allocated_bytes`` and ``..._reserved_bytes`` by device: torch's allocator in this
    process. Only where this process has already started CUDA (torch imported and initialised here): a process whose
    model runs elsewhere (vLLM's engine core) has nothing to say, and asking would start a CUDA context on the GPU."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    allocated_name, reserved_name = gpu_memory_names(prefix)
    allocated = GaugeMetricFamily(allocated_name,
                                  "GPU memory held by tensors of this process (torch.cuda.memory_allocated).",
                                  labels=["device"])
    reserved = GaugeMetricFamily(reserved_name,
                                 "GPU memory reserved by this process's caching allocator "
                                 "(torch.cuda.memory_reserved).", labels=["device"])
    for device in range(torch.cuda.device_count()):
        allocated.add_metric([str(device)], torch.cuda.memory_allocated(device))
        reserved.add_metric([str(device)], torch.cuda.memory_reserved(device))
    yield allocated
    yield reserved
