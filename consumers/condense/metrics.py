"""Condense consumer metrics: the runner's own counts (``CondenseStats``), read at scrape time and served for
Prometheus on ``settings.metrics_port`` (one endpoint per condense process)."""

from __future__ import annotations

from typing import Any, Iterator

from vlmstream import metrics
from vlmstream.metrics import gpu_memory


class CondenseCollector:
    """Prometheus collector over one ``CondenseRunner``'s stats."""

    def __init__(self, runner: Any):
        self.runner = runner

    def collect(self) -> Iterator[Any]:
        stats = self.runner.stats
        yield from metrics.counters((
            ("vlmstream_condense_records", "Document results fetched from the results topic.", stats.records),
            ("vlmstream_condense_summaries", "Documents answered and published.", stats.summaries),
            ("vlmstream_condense_retries", "Documents handed to the engine again after a retriable failure.",
             stats.retries),
            ("vlmstream_condense_prompt_tokens", "Prompt tokens of the documents answered.", stats.prompt_tokens),
            ("vlmstream_condense_output_tokens", "Tokens generated for the documents answered.", stats.output_tokens),
            ("vlmstream_condense_engine_seconds", "Each answered document's time in the engine, from its submission "
             "to its answer, summed (per document: its rate over summaries').", stats.engine_s),
            ("vlmstream_condense_commits", "Offset commits (or transactions) completed.", stats.commits),
        ))
        yield metrics.dead_letters("vlmstream_condense_dead_letters", "Documents dead-lettered, by error kind.",
                                   stats.dead_letters_by_kind)
        yield from metrics.gauges((
            ("vlmstream_condense_open_documents", "Documents fetched and not yet answered (waiting or in the "
             "engine).", self.runner.open_documents),
            ("vlmstream_condense_lag_records", "Result records on this process's partitions not yet fetched.",
             self.runner.lag.total),
        ))
        yield from gpu_memory("vlmstream_condense")


def serve(runner: Any, port: int) -> None:
    """Serve the runner's metrics on ``port`` (a daemon thread)."""
    metrics.serve(port, [CondenseCollector(runner)], "condense")
