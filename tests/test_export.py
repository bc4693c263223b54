"""`vlmstream export` on the real broker: output topics into files, each record once across runs."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from kafka import KafkaProducer
from typer.testing import CliRunner

from schemas import DeadLetter, Description, DocumentResult, Embedding
from tests.kafka_helpers import NotUtf8HeaderKey
from vlmstream.cli.main import app
from vlmstream.cli.export import export

pytestmark = pytest.mark.kafka


def publish(settings, records: list[tuple[str, bytes]]) -> None:
    producer = KafkaProducer(**settings.kafka.client_kwargs())
    for topic, value in records:
        producer.send(topic, key=b"k", value=value)
    producer.flush()
    producer.close()


def description(doc: str, index: int) -> Description:
    return Description(doc_id=doc, image_index=index, image_count=2, text=f"text {doc} {index}", model="tiny",
                       prompt_id="p1", engine="transformers")


def embedding(doc: str, index: int, seed: int) -> Embedding:
    vector = np.random.default_rng(seed).standard_normal(16).astype(np.float16)
    return Embedding.from_vector(vector, doc_id=doc, image_index=index, image_count=2, model="tiny")


def test_export_appends_each_record_once_and_vectors_come_back_exactly(topic_names, unique, tmp_path):
    t = topic_names.topics
    embeddings = [embedding("d1", 0, 1), embedding("d1", 1, 2)]
    publish(topic_names, [(t.descriptions, description("d1", 0).encode()),
                          (t.descriptions, description("d1", 1).encode()), (t.descriptions, b"not json"),
                          *((t.embeddings, e.encode()) for e in embeddings),
                          (t.results, DocumentResult(doc_id="d1", image_count=2, succeeded=2, failed=0,
                                                     images=({"image_index": 0, "status": "ok"},
                                                             {"image_index": 1, "status": "ok"})).encode()),
                          (t.deadletter, DeadLetter(stage="decode", error_kind="decode_truncated", detail="cut",
                                                    doc_id="d2").encode())])
    group = f"export-{unique}"
    first = export(topic_names, tmp_path, group_id=group)
    assert first.written == {"descriptions": 2, "embeddings": 2, "results": 1, "deadletter": 1}
    assert first.unreadable == 1

    lines = [orjson.loads(line) for line in (tmp_path / "descriptions.jsonl").read_bytes().splitlines()]
    assert sorted((d["doc_id"], d["image_index"], d["text"]) for d in lines) == [("d1", 0, "text d1 0"),
                                                                                 ("d1", 1, "text d1 1")]
    index = [orjson.loads(line) for line in (tmp_path / "embeddings.jsonl").read_bytes().splitlines()]
    vectors = np.fromfile(tmp_path / "embeddings.float16", dtype="<f2").reshape(-1, 16)
    for meta in index:
        expected = next(e for e in embeddings if e.image_index == meta["image_index"]).vector()
        np.testing.assert_array_equal(vectors[meta["row"]], expected)
    assert orjson.loads((tmp_path / "results.jsonl").read_bytes())["succeeded"] == 2
    assert orjson.loads((tmp_path / "deadletter.jsonl").read_bytes())["doc_id"] == "d2"

    # Nothing new: nothing appended. One new description: only it.
    assert export(topic_names, tmp_path, group_id=group).written == {k: 0 for k in first.written}
    publish(topic_names, [(t.descriptions, description("d3", 0).encode())])
    env = {f"VLMSTREAM_TOPICS__{name.upper()}": getattr(t, name) for name in ("descriptions", "embeddings",
                                                                            "results", "deadletter")}
    env["VLMSTREAM_BOOTSTRAP_SERVERS"] = topic_names.kafka.bootstrap_servers
    code = CliRunner().invoke(app, ["export", str(tmp_path), "--what", "descriptions", "--group-id", group], env=env)
    assert code.exit_code == 0, code.output
    assert "appended 1 descriptions" in code.output
    assert len((tmp_path / "descriptions.jsonl").read_bytes().splitlines()) == 3


def test_export_names_what_it_cannot_do(topic_names, tmp_path):
    with pytest.raises(ValueError, match="unknown kinds"):
        export(topic_names, tmp_path, ("descriptions", "pixels"))


def test_follow_appends_what_arrives_until_asked_to_stop(topic_names, unique, tmp_path):
    import threading
    import time

    stop = threading.Event()
    reports = []
    follower = threading.Thread(target=lambda: reports.append(
        export(topic_names, tmp_path, ("descriptions",), follow=True, group_id=f"export-{unique}",
               should_stop=stop.is_set)))
    follower.start()
    try:
        time.sleep(1.0)  # running and caught up on an empty topic: it keeps waiting
        assert follower.is_alive()
        publish(topic_names, [(topic_names.topics.descriptions, description("late", 0).encode())])
        path = tmp_path / "descriptions.jsonl"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (path.exists() and path.read_bytes()):
            time.sleep(0.2)
        assert orjson.loads(path.read_bytes())["doc_id"] == "late"
    finally:
        stop.set()
        follower.join(30)
    assert not follower.is_alive() and reports[0].written == {"descriptions": 1}


def test_a_topic_written_in_transactions_is_exported_and_the_export_ends(topic_names, unique, tmp_path):
    """With infer.exactly_once every commit leaves a marker after the records: the export must still see the end."""
    producer = KafkaProducer(**topic_names.kafka.client_kwargs(), transactional_id=f"export-test-{unique}",
                             enable_idempotence=True)
    producer.init_transactions()
    for doc in ("t1", "t2"):
        producer.begin_transaction()
        producer.send(topic_names.topics.descriptions, key=doc.encode(), value=description(doc, 0).encode())
        producer.commit_transaction()
    producer.close()
    report = export(topic_names, tmp_path, ("descriptions",), group_id=f"export-{unique}")
    assert report.written == {"descriptions": 2}


def test_what_a_killed_export_left_half_written_is_cut_before_appending(topic_names, unique, tmp_path):
    """Killed between writing and committing: a partial last line, a vector without its index line. The next run
    writes those records again, so it must first cut the remains, or rows would shift."""
    t = topic_names.topics
    first, second = embedding("k", 0, 3), embedding("k", 1, 4)
    publish(topic_names, [(t.embeddings, first.encode()), (t.descriptions, description("k", 0).encode())])
    group = f"export-{unique}"
    export(topic_names, tmp_path, group_id=group)
    with open(tmp_path / "descriptions.jsonl", "ab") as fh:
        fh.write(b'{"doc_id": "half-writ')
    with open(tmp_path / "embeddings.float16", "ab") as fh:
        fh.write(second.vector().tobytes()[:10])  # part of a vector whose index line never came
    publish(topic_names, [(t.embeddings, second.encode())])
    export(topic_names, tmp_path, group_id=group)
    assert [orjson.loads(line)["doc_id"] for line in (tmp_path / "descriptions.jsonl").read_bytes().splitlines()] \
        == ["k"]
    vectors = np.fromfile(tmp_path / "embeddings.float16", dtype="<f2").reshape(-1, 16)
    rows = {orjson.loads(line)["image_index"]: orjson.loads(line)["row"]
            for line in (tmp_path / "embeddings.jsonl").read_bytes().splitlines()}
    assert rows == {0: 0, 1: 1}
    np.testing.assert_array_equal(vectors[1], second.vector())


def test_index_lines_ahead_of_their_vectors_are_cut_and_the_other_dtype_is_kept(topic_names, unique, tmp_path):
    """The index and the vector files are buffered apart: a kill can leave index lines whose vectors never reached
    the disk. And a rerun must not cut one dtype's vectors because the last index line is of the other."""
    t = topic_names.topics
    wide = Embedding.from_vector(np.arange(8, dtype=np.float32), doc_id="w", image_index=0, image_count=2,
                                 model="tiny")
    narrow = embedding("n", 0, 5)
    publish(topic_names, [(t.embeddings, wide.encode()), (t.embeddings, narrow.encode())])
    group = f"export-{unique}"
    export(topic_names, tmp_path, kinds=("embeddings",), group_id=group)
    ahead = embedding("n", 1, 6)
    with open(tmp_path / "embeddings.jsonl", "ab") as fh:  # an index line whose vector was lost in the kill
        fh.write(orjson.dumps({"doc_id": "n", "image_index": 1, "model": "tiny", "dim": 16, "dtype": "float16",
                               "row": 1, "offset": 32}) + b"\n")
    publish(topic_names, [(t.embeddings, ahead.encode())])
    export(topic_names, tmp_path, kinds=("embeddings",), group_id=group)
    index = [orjson.loads(line) for line in (tmp_path / "embeddings.jsonl").read_bytes().splitlines()]
    assert [(m["doc_id"], m["image_index"], m["dtype"], m["row"]) for m in index] == [
        ("w", 0, "float32", 0), ("n", 0, "float16", 0), ("n", 1, "float16", 1)]
    np.testing.assert_array_equal(np.fromfile(tmp_path / "embeddings.float32", dtype="<f4"), wide.vector())
    halves = np.fromfile(tmp_path / "embeddings.float16", dtype="<f2").reshape(-1, 16)
    np.testing.assert_array_equal(halves[1], ahead.vector())


def test_records_that_are_not_their_topics_schema_are_counted_not_written(topic_names, unique, tmp_path):
    t = topic_names.topics
    good = description("g", 0)
    pretty = orjson.dumps(orjson.loads(good.encode()), option=orjson.OPT_INDENT_2)  # valid, on several lines
    short = orjson.loads(embedding("s", 0, 7).encode())
    short["vector_b64"] = short["vector_b64"][:8]  # fewer bytes than dim x dtype: would shift later rows
    producer = KafkaProducer(**topic_names.kafka.client_kwargs())
    try:  # a record kafka-python cannot parse at all (a header key that is not UTF-8)
        producer.send(t.descriptions, value=good.encode(), headers=[(NotUtf8HeaderKey("x"), b"1")]).get(timeout=30)
    finally:
        producer.close()
    publish(topic_names, [(t.descriptions, b"123"), (t.descriptions, b'{"schema_version": 99}'),
                          (t.descriptions, pretty), (t.embeddings, orjson.dumps(short)),
                          (t.embeddings, embedding("s", 1, 8).encode())])
    report = export(topic_names, tmp_path, kinds=("descriptions", "embeddings"), group_id=f"export-{unique}")
    assert report.unreadable == 4 and report.written == {"descriptions": 1, "embeddings": 1}
    [line] = (tmp_path / "descriptions.jsonl").read_bytes().splitlines()
    assert Description.decode(line) == good
    assert [orjson.loads(x)["row"] for x in (tmp_path / "embeddings.jsonl").read_bytes().splitlines()] == [0]
