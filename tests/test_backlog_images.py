"""Backlogs counted in images, not documents: documents carry their image count in a header, `status` converts the
documents topic's lag with it (a foreign document without the header is counted from its value), and names the stage
that limits the run: decode while documents wait undecoded, inference once decode has done its part and the images
wait for a model that is not running."""

from __future__ import annotations

import pytest
from kafka import KafkaProducer

from producers.publisher import publish_documents
from schemas import HEADER_IMAGE_COUNT, DocumentRef, header_value
from tests.helpers import Fleet, corpus_images, wait_for
from tests.kafka_helpers import read_topic
from vlmstream.cli.backlog import LiveView, StageProbe
from vlmstream.cli.status import pipeline_status, stage_bottleneck

pytestmark = pytest.mark.kafka


def test_status_counts_the_backlog_in_images_and_names_the_stage_that_limits(topic_names, corpus_dir, tmp_path,
                                                                             unique):
    images = [str(p) for p in corpus_images(corpus_dir, 6)]
    decode = topic_names.decode.model_copy(update={"group_id": f"decode-test-{topic_names.topics.documents}",
                                                   "allowed_roots": [str(corpus_dir)], "max_pixels": 64 * 28 * 28})
    infer = topic_names.infer.model_copy(update={"group_id": f"test-infer-{unique}"})
    settings = topic_names.model_copy(update={"decode": decode, "infer": infer,
                                              "producer": topic_names.producer.model_copy(
                                                  update={"state_dir": str(tmp_path / "ledger")})})
    # Heavy and light documents: 1 + 6 + 2 images, and one from a client that sets no image-count header.
    docs = [DocumentRef(doc_id=f"{unique}-{n}", image_uris=tuple(images[:n])) for n in (1, 6, 2)]
    assert publish_documents(settings, docs).sent == 3
    foreign = DocumentRef(doc_id=f"{unique}-foreign", image_uris=tuple(images[:4]))
    producer = KafkaProducer(**settings.kafka.client_kwargs())
    producer.send(settings.topics.documents, key=foreign.key(), value=foreign.encode()).get(timeout=30)
    producer.close()
    records = read_topic(settings, settings.topics.documents, expected=4)
    counts = {r.key.decode(): header_value(r.headers, HEADER_IMAGE_COUNT) for r in records}
    assert counts == {f"{unique}-1": b"1", f"{unique}-6": b"6", f"{unique}-2": b"2", f"{unique}-foreign": None}

    stages, _ = pipeline_status(settings)
    by = {s.stage: s for s in stages}
    assert by["decode"].lag == {settings.topics.documents: 4}
    assert (by["decode"].images, by["decode"].images_exact) == (13, True)  # 1 + 6 + 2 + 4, not 4 documents
    assert by["infer"].images == 0
    neck = stage_bottleneck(settings, stages)
    assert neck.stage == "decode", neck.why
    probe = StageProbe(settings)  # run's and status --follow's live view: the same count
    view = LiveView(probe)
    try:
        assert view.update().document_images_waiting == 13
        assert view.totals() == (13, 13)
        assert view.bottleneck().stage == "decode"
    finally:
        probe.close()

    # Decode does its part; inference is not running: the 13 images wait for it.
    with Fleet(settings, tmp_path, "--workers", "1", decode=decode.model_dump(mode="json")) as fleet:
        wait_for(lambda: {s.stage: s for s in pipeline_status(settings)[0]}["decode"].images == 0, 90,
                 "decode to commit past every document", fleet)
        fleet.stop()
    stages, _ = pipeline_status(settings)
    by = {s.stage: s for s in stages}
    assert by["decode"].images == 0 and by["infer"].images == 13
    neck = stage_bottleneck(settings, stages)
    assert neck.stage == "inference", neck.why
    probe = StageProbe(settings)
    try:
        snap = LiveView(probe).update()
        assert (snap.document_images_waiting, snap.images_waiting) == (0, 13)
    finally:
        probe.close()
