"""The Grafana dashboard (docker/grafana/vlmstream-dashboard.json) is built only from metrics the code exports: every
metric name in its queries is found in a live scrape of a producer's, a decode fleet's and an inference runner's
endpoints."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from producers.items import Rejection
from producers.publisher import INVALID_LINE, publish_documents
from schemas import DocumentRef
from tests.helpers import Fleet, corpus_images, infer_settings, real_engine, wait_for

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
    from consumers.infer.metrics import serve
    from consumers.infer.runner import InferenceRunner
    from producers import metrics as producer_metrics

    queried = _queried_metrics()
    assert {"vlmstream_decode_images_total", "vlmstream_infer_images_described_total"} <= queried
    decode_port, infer_port, producer_port = _free_port(), _free_port(), _free_port()
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
    serve(runner, infer_port)
    runner.stats.dead_letters_by_kind["output_invalid"] = 1  # a labelled series to scrape before any failure
    import threading

    assert runner.run(threading.Event(), max_seconds=120, until_idle_s=2.5) == 0
    inferred = _scrape(infer_port)
    assert runner.stats.described == 1
    missing = queried - produced - decoded - inferred
    assert not missing, f"dashboard queries name metrics no endpoint exports: {sorted(missing)}"
