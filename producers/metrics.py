"""Producer metrics: the publisher's running ``PublishSummary``, read at scrape time and served for Prometheus on
``settings.metrics_port`` (`vlmstream produce`; a watched folder runs for as long as it is watched)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily

from vlmstream import metrics


class SummaryCollector:
    """Prometheus collector over the summary the publisher reports through ``on_progress``."""

    def __init__(self, summary: Callable[[], Any]):
        self.summary = summary

    def collect(self) -> Iterator[Any]:
        summary = self.summary()
        counters = (
            ("vlmstream_producer_documents_sent", "Documents acknowledged by the broker.", "sent"),
            ("vlmstream_producer_images_sent", "Images named by the documents acknowledged.", "images_sent"),
            ("vlmstream_producer_documents_skipped", "Documents already published (the ledger).", "skipped"),
            ("vlmstream_producer_dead_letters", "Bad input lines sent to the dead-letter topic.", "dead_lettered"),
        )
        for name, doc, attr in counters:
            family = CounterMetricFamily(name, doc)
            family.add_metric([], getattr(summary, attr, 0) if summary is not None else 0)
            yield family
        rejected = CounterMetricFamily("vlmstream_producer_rejected", "Input lines rejected, by reason.",
                                       labels=["reason"])
        for reason, count in sorted(Counter(r.reason for r in getattr(summary, "rejected", [])).items()):
            rejected.add_metric([reason], count)
        yield rejected
        failed = CounterMetricFamily("vlmstream_producer_failed", "Sends the broker did not acknowledge.")
        failed.add_metric([], len(getattr(summary, "failed", [])))
        yield failed


def serve(summary: Callable[[], Any], port: int) -> None:
    """Serve the producer's metrics on ``port`` (a daemon thread)."""
    metrics.serve(port, [SummaryCollector(summary)], "producer")
