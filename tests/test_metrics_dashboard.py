"""The Grafana dashboard (docker/grafana/vlmstream-dashboard.json) is built only from metrics the code exports: every
metric name in its queries is found in a live scrape of a producer's, a decode fleet's, an inference process's (its
runner and results aggregator) and a condense runner's endpoints; GPU memory only where CUDA is (named by the code).
And a consumer's lag is what the broker holds past what it fetched."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from producers.items import Rejection
from producers.publisher import INVALID_LINE, publish_documents
from schemas import DocumentRef
from tests.helpers import Fleet, corpus_images, infer_settings, real_engine, tiny_model_dir, wait_for
from tests.kafka_helpers import create_summaries_topic

pytestmark = [pytest.mark.kafka, pytest.mark.model]

DASHBOARD = Path(__file__).resolve().parents[1] / "docker" / "grafana" / "vlmstream-dashboard.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> set[str]:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:  # not serving yet
        return set()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def _queried_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    return {name for expr in exprs for name in re.findall(r"\bvlmstream_[a-z0-9_]+", expr)}


def test_every_dashboard_query_names_a_metric_the_pipeline_exports(topic_names, corpus_dir, tmp_path, unique):
    from consumers.condense.metrics import serve as serve_condense
    from consumers.condense.runner import CondenseRunner
    from consumers.condense.stage import AnswerSchema, Condenser
    from consumers.condense.transformers_engine import TransformersCondenseEngine
    from consumers.infer.metrics import serve
    from consumers.infer.runner import InferenceRunner
    from consumers.results.aggregator import ResultsAggregator
    from consumers.results.metrics import AggregatorCollector
    from producers import metrics as producer_metrics
    from vlmstream.metrics import gpu_memory_names

    queried = _queried_metrics()
    assert {"vlmstream_decode_images_total", "vlmstream_infer_images_described_total"} <= queried
    decode_port, infer_port, producer_port, condense_port = _free_port(), _free_port(), _free_port(), _free_port()
    decode = topic_names.decode.model_copy(update={"allowed_roots": [str(corpus_dir), str(tmp_path)],
                                                   "max_pixels": 64 * 28 * 28})
    settings = infer_settings(topic_names.model_copy(update={
        "decode": decode, "producer": topic_names.producer.model_copy(update={"state_dir": str(tmp_path / "l")})}),
        unique)
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 not a JPEG")  # a dead letter of each stage's kind is a labelled series
    image = str(corpus_images(corpus_dir, 1)[0])
    latest = []
    producer_metrics.serve(lambda: latest[-1] if latest else None, producer_port)
    publish_documents(settings, [DocumentRef(doc_id=f"{unique}-ok", image_uris=(image, str(broken))),
                                 Rejection("manifest.jsonl", 2, INVALID_LINE, "not JSON", b"not a document")],
                      on_progress=latest.append)
    produced = _scrape(producer_port)
    text = urllib.request.urlopen(f"http://127.0.0.1:{producer_port}/metrics", timeout=5).read().decode()
    assert "vlmstream_producer_images_sent_total 2.0" in text and "vlmstream_producer_documents_sent_total 1.0" in text

    with Fleet(settings, tmp_path, "--workers", "1", decode=decode.model_dump(mode="json"),
               metrics_port=decode_port) as fleet:
        wait_for(lambda: "vlmstream_decode_errors_total" in _scrape(decode_port), 90, "decode's metrics", fleet)
        decoded = _scrape(decode_port)
        fleet.stop()

    runner = InferenceRunner(settings, real_engine(settings))
    aggregator = ResultsAggregator(settings)
    stop_aggregator = threading.Event()
    aggregator_thread = aggregator.start_thread(stop_aggregator)
    serve(runner, infer_port, AggregatorCollector(aggregator))
    runner.stats.dead_letters_by_kind["output_invalid"] = 1  # a labelled series to scrape before any failure
    aggregator.stats.dead_letters_by_kind["result_unwritable"] = 1

    assert runner.run(threading.Event(), max_seconds=120, until_idle_s=2.5) == 0
    wait_for(lambda: aggregator.stats.results >= 1, 60, "the document's result")
    inferred = _scrape(infer_port)
    text = urllib.request.urlopen(f"http://127.0.0.1:{infer_port}/metrics", timeout=5).read().decode()
    stop_aggregator.set()
    aggregator_thread.join(timeout=60)
    assert runner.stats.described == 1
    assert "vlmstream_results_documents_total 1.0" in text and "vlmstream_infer_lag_records 0.0" in text
    assert "vlmstream_results_open_documents 0.0" in text

    # Condense over the results topic the aggregator wrote.
    create_summaries_topic(settings)
    condense_settings = settings.model_copy(update={"condense": settings.condense.model_copy(
        update={"group_id": f"test-condense-{unique}", "engine": "transformers", "batch_size": 2})})
    engine = TransformersCondenseEngine(tiny_model_dir(), condense_settings.condense, AnswerSchema.load(None))
    try:
        condenser = CondenseRunner(condense_settings, engine,
                                   Condenser(condense_settings.condense, engine.tokenizer, AnswerSchema.load(None)))
        serve_condense(condenser, condense_port)
        condenser.stats.dead_letters_by_kind["output_invalid"] = 1
        assert condenser.run(threading.Event(), max_seconds=120, until_idle_s=2.5) == 0
        condensed = _scrape(condense_port)
        text = urllib.request.urlopen(f"http://127.0.0.1:{condense_port}/metrics", timeout=5).read().decode()
    finally:
        engine.close()
    assert condenser.stats.summaries + condenser.stats.dead_lettered >= 1
    assert f"vlmstream_condense_records_total {float(condenser.stats.records)}" in text

    import torch

    # Exported only by a process with CUDA (a CPU run has no such memory to report): named by the code itself.
    gpu_only = set() if torch.cuda.is_available() else {
        name for prefix in ("vlmstream_infer", "vlmstream_condense") for name in gpu_memory_names(prefix)}
    assert gpu_only.isdisjoint(inferred | condensed)
    missing = queried - produced - decoded - inferred - condensed - gpu_only
    assert not missing, f"dashboard queries name metrics no endpoint exports: {sorted(missing)}"


def test_fetch_lag_is_what_the_broker_holds_past_what_the_consumer_fetched(topic_names, unique):
    from vlmstream.kafka.clients import make_consumer, make_producer
    from vlmstream.kafka.group import topic_partitions
    from vlmstream.kafka.lag import FetchLag
    from vlmstream.kafka.records import poll_past_unreadable

    topic = topic_names.topics.documents
    producer = make_producer(topic_names)
    for n in range(10):
        producer.send(topic, key=b"one-partition", value=f"record {n}".encode())
    producer.flush()
    producer.close()
    consumer = make_consumer(topic_names, None, max_poll_records=3)
    lag = FetchLag()
    try:
        consumer.assign(topic_partitions(consumer, [topic]))
        consumer.seek_to_beginning()
        fetched = 0
        deadline = time.monotonic() + 30
        while fetched == 0 and time.monotonic() < deadline:
            batches = poll_past_unreadable(consumer, timeout_ms=500)
            lag.observe(consumer, batches)
            fetched = sum(len(records) for records in batches.values())
        assert 0 < fetched <= 3 and lag.total == 10 - fetched
        while fetched < 10 and time.monotonic() < deadline:
            batches = poll_past_unreadable(consumer, timeout_ms=500)
            lag.observe(consumer, batches)
            fetched += sum(len(records) for records in batches.values())
        assert fetched == 10 and lag.total == 0
    finally:
        consumer.close()
