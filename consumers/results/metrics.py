"""The results aggregator's stats for Prometheus, read at scrape time (served by the process it runs in:
`vlmstream infer`'s endpoint)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from consumers.results.aggregator import ResultsAggregator


class AggregatorCollector:
    """Prometheus collector over one ``ResultsAggregator``'s stats."""

    def __init__(self, aggregator: ResultsAggregator):
        self.aggregator = aggregator

    def collect(self) -> Iterator[Any]:
        from vlmstream import metrics

        stats = self.aggregator.stats
        yield from metrics.counters((
            ("vlmstream_results_records", "Description and dead-letter records read.", stats.records),
            ("vlmstream_results_documents", "Document results published (a document completed, or timed out).",
             stats.results),
            ("vlmstream_results_reemitted", "Results published again for a document already emitted (a redriven or "
             "late image improved it).", stats.reemitted),
            ("vlmstream_results_timed_out", "Documents published with their missing images failed, after waiting "
             "open too long.", stats.timed_out),
            ("vlmstream_results_late", "Records of a document already emitted and forgotten: dropped.", stats.late),
            ("vlmstream_results_skipped", "Records that could not be read.", stats.skipped),
            ("vlmstream_results_commits", "Offset commits (or transactions) completed.", stats.commits),
        ))
        yield metrics.dead_letters("vlmstream_results_dead_letters", "Results dead-lettered, by error kind.",
                                   stats.dead_letters_by_kind)
        yield from metrics.gauges((
            ("vlmstream_results_open_documents", "Documents not yet published (images still to come).",
             self.aggregator.open_documents()),
            ("vlmstream_results_lag_records", "Description and dead-letter records on this aggregator's "
             "partitions not yet fetched.", self.aggregator.lag.total),
        ))
