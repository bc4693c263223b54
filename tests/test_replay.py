"""`vlmstream replay`, `redrive` and `status` against the real broker, driven through the real CLI."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from kafka import KafkaProducer, TopicPartition
from kafka.structs import OffsetAndMetadata
from typer.testing import CliRunner

from schemas import DocumentRef, decode_image_payload
from tests.helpers import (
    description_counts,
    documents,
    infer_settings,
    payload_record,
    prepared_corpus,
    produce_images,
    run_until_idle,
    subprocess_env,
    wait_for,
)
from tests.kafka_helpers import committed_offsets, end_offsets, read_topic
from vlmstream.cli.main import app
from vlmstream.kafka.clients import make_admin, make_consumer


def cli(settings, *args: str):
    env = subprocess_env(settings) | {"VLMSTREAM_DECODE__GROUP_ID": settings.decode.group_id}
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.output




@pytest.mark.kafka
@pytest.mark.model
@pytest.mark.slow
def test_replay_to_a_timestamp_redoes_exactly_the_later_messages_and_redrive_republishes(
        topic_names, corpus_dir, unique, engine):
    settings = infer_settings(topic_names, unique)
    batch_a = documents(corpus_dir, f"a-{unique}", [2])
    meta, value = payload_record(f"a-{unique}-poison", 0, 1, *prepared_corpus(str(corpus_dir))[2])
    produce_images(settings, batch_a)
    # Headers as another client may add them: binary, and one key twice. Redrive must put back these bytes.
    producer = KafkaProducer(**settings.kafka.client_kwargs(), max_request_size=settings.kafka.max_message_bytes)
    try:
        producer.send(settings.topics.images, key=meta.key(), value=bytes(len(value)),
                      headers=meta.headers() + [("trace", b"\xff\x00\x01"), ("trace", b"second")]).get(timeout=30)
    finally:
        producer.close()
    time.sleep(1.5)
    middle_ms = int(time.time() * 1000)
    time.sleep(1.5)
    batch_b = documents(corpus_dir, f"b-{unique}", [3])
    produce_images(settings, batch_b)
    run_until_idle(settings, engine)
    assert description_counts(settings, expected=5) == Counter({(m.doc_id, m.image_index): 1
                                                                for m, _ in batch_a + batch_b})

    code, out = cli(settings, "replay", "--stage", "infer", "--to", f"timestamp:{middle_ms}", "--dry-run")
    assert code == 0, out
    assert "to redo: 3 message(s), 3 image(s)" in out  # batch B only
    assert committed_offsets(settings, settings.infer.group_id, settings.topics.images) == {
        p: e for p, e in end_offsets(settings, settings.topics.images).items() if e}  # dry run changed nothing

    code, out = cli(settings, "replay", "--stage", "infer", "--to", f"timestamp:{middle_ms}")
    assert code == 0, out
    run_until_idle(settings, engine)
    counts = description_counts(settings, expected=8)
    assert counts == Counter({**{(m.doc_id, m.image_index): 1 for m, _ in batch_a},
                              **{(m.doc_id, m.image_index): 2 for m, _ in batch_b}})

    # The poison was dead-lettered once (batch A is not redone); redrive puts the same record back.
    code, out = cli(settings, "redrive", "--stage", "infer", "--error-kind", "payload_invalid")
    assert code == 0 and "republished 1" in out, out
    records = read_topic(settings, settings.topics.images, expected=len(batch_a) + len(batch_b) + 2)
    again = [r for r in records if r.key == meta.key()]
    assert len(again) == 2 and again[1].value == again[0].value
    assert decode_image_payload(again[1].headers) == meta
    assert again[1].headers == again[0].headers  # binary value and the repeated key included, in order

    code, out = cli(settings, "status")
    assert code == 0 and "payload_invalid" in out, out


@pytest.mark.kafka
def test_replay_refuses_while_the_group_has_an_active_member(topic_names, unique):
    settings = infer_settings(topic_names, unique)
    consumer = make_consumer(settings, settings.infer.group_id, [settings.topics.images])
    try:
        wait_for(lambda: consumer.poll(timeout_ms=200) is not None and consumer.assignment(), 30, "an assignment")
        code, out = cli(settings, "replay", "--stage", "infer", "--to", "earliest")
        assert code == 2 and "refusing" in out and "stop the infer workers" in " ".join(out.split()), out
    finally:
        consumer.close()


@pytest.mark.kafka
def test_decode_dry_run_counts_the_images_of_the_documents_to_redo(topic_names, unique):
    decode = topic_names.decode.model_copy(update={"group_id": f"test-decode-{unique}"})
    settings = topic_names.model_copy(update={"decode": decode})
    docs = [DocumentRef(doc_id=f"d{i}-{unique}", image_uris=tuple(f"/img/{i}/{k}.jpg" for k in range(n)))
            for i, n in enumerate([2, 3, 1, 4])]
    producer = KafkaProducer(**settings.kafka.client_kwargs())
    for doc in docs:
        producer.send(settings.topics.documents, key=doc.key(), value=doc.encode())
    producer.flush()
    producer.close()
    ends = {TopicPartition(settings.topics.documents, p): e
            for p, e in end_offsets(settings, settings.topics.documents).items()}
    admin = make_admin(settings)
    try:  # the decode group finished everything
        admin.alter_group_offsets(decode.group_id, {tp: OffsetAndMetadata(e, "", -1) for tp, e in ends.items()})
    finally:
        admin.close()
    code, out = cli(settings, "replay", "--stage", "decode", "--to", "earliest", "--dry-run")
    assert code == 0, out
    assert "to redo: 4 message(s), 10 image(s)" in out  # 4 documents, 2+3+1+4 images
    assert committed_offsets(settings, decode.group_id, settings.topics.documents) == {
        tp.partition: e for tp, e in ends.items()}  # the dry run changed nothing


@pytest.mark.kafka
def test_status_counts_throughput_by_record_time_and_a_sample_measures_each_stage(topic_names, unique):
    """The throughput table counts what each topic gained in a window by the records' own timestamps; a sample
    turns the stages' commits into consumption rates and the time their backlog takes."""
    import threading

    from vlmstream.cli.status import StageStatus, pipeline_status, pipeline_throughput

    decode = topic_names.decode.model_copy(update={"group_id": f"test-decode-{unique}"})
    settings = topic_names.model_copy(update={"decode": decode})
    topic = settings.topics.documents
    now_ms = int(time.time() * 1000)
    producer = KafkaProducer(**settings.kafka.client_kwargs())
    for i in range(8):  # three from two hours ago, then five now
        doc = DocumentRef(doc_id=f"t{i}-{unique}", image_uris=("/img/a.jpg",))
        producer.send(topic, key=doc.key(), value=doc.encode(), timestamp_ms=now_ms - (7_200_000 if i < 3 else 0))
    producer.flush()
    producer.close()

    rows = {r.topic: r for r in pipeline_throughput(settings, (300, 10_800), now_ms=now_ms + 1000)}
    assert rows[topic].records == {300: 5, 10_800: 8} and rows[topic].meaning == "documents published"
    assert rows[settings.topics.images].records == {300: 0, 10_800: 0} and rows[settings.topics.images].exists
    absent = settings.model_copy(update={"topics": settings.topics.model_copy(update={"results": f"gone-{unique}"})})
    assert not {r.topic: r for r in pipeline_throughput(absent, (300,))}[f"gone-{unique}"].exists

    ends = {TopicPartition(topic, p): e for p, e in end_offsets(settings, topic).items() if e}
    admin = make_admin(settings)

    def workers_commit_all_but_one_record_per_partition():
        time.sleep(1.0)
        admin.alter_group_offsets(decode.group_id, {tp: OffsetAndMetadata(e - 1, "", -1) for tp, e in ends.items()})

    committer = threading.Thread(target=workers_commit_all_but_one_record_per_partition)
    committer.start()
    try:
        stages, _letters = pipeline_status(settings, sample_s=3.0)
    finally:
        committer.join()
        admin.close()
    decode_stage = next(s for s in stages if s.stage == "decode")
    left = len(ends)
    assert decode_stage.lag == {topic: left}
    assert decode_stage.consumed_per_s == pytest.approx((8 - left) / 3.0)
    assert decode_stage.eta_s == pytest.approx(left / ((8 - left) / 3.0))
    assert next(s for s in stages if s.stage == "infer").eta_s == 0.0  # no backlog
    assert StageStatus("infer", "g", "Empty", 0, {"t": 5}, 0.0).eta_s is None  # a backlog and no progress

    code, out = cli(settings, "status", "--sample", "0.5", "--windows", "60,10800")
    assert code == 0, out
    assert "consumed/s" in out and "documents published" in out and "last 3.0 h" in out, out
    code, out = cli(settings, "status", "--windows", "0")
    assert code == 2 and "above 0" in out, out
