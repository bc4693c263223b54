"""Inference consumer metrics: the runner's own counts (``RunnerStats``), read at scrape time and served for
Prometheus on ``settings.metrics_port`` (one endpoint per inference process). Nothing is counted twice: the runner
keeps its stats as it always did, and this collector only reads them, so the hot path does not change."""

from __future__ import annotations

import logging
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)


class RunnerCollector:
    """Prometheus collector over one ``InferenceRunner``'s stats."""

    def __init__(self, runner: Any):
        self.runner = runner

    def collect(self) -> Iterator[Any]:
        stats = self.runner.stats
        counters = (
            ("vlmstream_infer_records", "Image records fetched from the images topic.", stats.records),
            ("vlmstream_infer_images_described", "Images described and published.", stats.described),
            ("vlmstream_infer_visual_tokens", "Visual tokens of the images described.", stats.visual_tokens),
            ("vlmstream_infer_retries", "Images handed to the engine again after a retriable failure.", stats.retries),
            ("vlmstream_infer_commits", "Offset commits (or transactions) completed.", stats.commits),
        )
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family
        letters = CounterMetricFamily("vlmstream_infer_dead_letters", "Images dead-lettered, by error kind.",
                                      labels=["error_kind"])
        for kind, count in sorted(stats.dead_letters_by_kind.items()):
            letters.add_metric([kind], count)
        yield letters
        gauges = (
            ("vlmstream_infer_engine_idle_fraction", "Share of the run with nothing submitted to the engine.",
             stats.engine_idle_fraction),
            ("vlmstream_infer_mean_in_flight", "Images in the engine on average since the first record (below the "
             "batch size: batches run part-empty).", stats.mean_in_flight),
            ("vlmstream_infer_batch_size", "Images the engine runs at once.", self.runner.engine_batch_size),
            ("vlmstream_infer_in_flight", "Images in the engine now.", len(self.runner.window.in_flight)),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


def serve(runner: Any, port: int) -> None:
    """Serve the runner's metrics on ``port`` (a daemon thread)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(RunnerCollector(runner))
    start_http_server(port, registry=registry)
    log.info("inference metrics on http://0.0.0.0:%d/metrics", port)
