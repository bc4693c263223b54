"""Inference consumer metrics: the runner's own counts (``RunnerStats``), read at scrape time and served for
Prometheus on ``settings.metrics_port`` (one endpoint per inference process). Nothing is counted twice: the runner
keeps its stats as it always did, and this collector only reads them, so the hot path does not change."""

from __future__ import annotations

from typing import Any, Iterator

from vlmstream import metrics
from vlmstream.metrics import gpu_memory


class RunnerCollector:
    """Prometheus collector over one ``InferenceRunner``'s stats."""

    def __init__(self, runner: Any):
        self.runner = runner

    def collect(self) -> Iterator[Any]:
        stats = self.runner.stats
        yield from metrics.counters((
            ("vlmstream_infer_records", "Image records fetched from the images topic.", stats.records),
            ("vlmstream_infer_images_described", "Images described and published.", stats.described),
            ("vlmstream_infer_visual_tokens", "Visual tokens of the images described.", stats.visual_tokens),
            ("vlmstream_infer_retries", "Images handed to the engine again after a retriable failure.", stats.retries),
            ("vlmstream_infer_commits", "Offset commits (or transactions) completed.", stats.commits),
            ("vlmstream_infer_output_tokens", "Tokens generated for the images described.", stats.output_tokens),
            ("vlmstream_infer_engine_seconds", "Each described image's time in the engine, from its submission to "
             "its result, summed (per image: its rate over images_described's).", stats.engine_s),
        ))
        yield metrics.dead_letters("vlmstream_infer_dead_letters", "Images dead-lettered, by error kind.",
                                   stats.dead_letters_by_kind)
        yield from metrics.gauges((
            ("vlmstream_infer_engine_idle_fraction", "Share of the run with nothing submitted to the engine.",
             stats.engine_idle_fraction),
            ("vlmstream_infer_mean_in_flight", "Images in the engine on average since the first record (below the "
             "batch size: batches run part-empty).", stats.mean_in_flight),
            ("vlmstream_infer_batch_size", "Images the engine runs at once.", self.runner.engine_batch_size),
            ("vlmstream_infer_in_flight", "Images in the engine now.", len(self.runner.window.in_flight)),
            ("vlmstream_infer_lag_records", "Image records on this process's partitions not yet fetched.",
             self.runner.lag.total),
        ))
        yield from gpu_memory("vlmstream_infer")


def serve(runner: Any, port: int, *others: Any) -> None:
    """Serve the runner's metrics on ``port`` (a daemon thread), with ``others``: collectors of what else runs in
    this process (the results aggregator)."""
    metrics.serve(port, [RunnerCollector(runner), *others], "inference")
