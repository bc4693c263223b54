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


# --- Parquet ------------------------------------------------------------------------------------------------


def parquet_rows(folder, kind: str):
    """Every row of a kind's files through DuckDB, as the data tools read them (no extra arguments)."""
    import duckdb

    return duckdb.sql(f"SELECT * FROM '{folder}/{kind}-*.parquet'").fetchall(), \
        duckdb.sql(f"SELECT * FROM '{folder}/{kind}-*.parquet' LIMIT 0").columns


def topic_offsets(settings, topic: str) -> set[tuple[int, int]]:
    from tests.kafka_helpers import read_topic

    return {(r.partition, r.offset) for r in read_topic(settings, topic, timeout_s=30, idle_s=1.0)}


def test_parquet_files_roll_at_the_size_limit_and_read_back_in_duckdb_and_pandas(topic_names, unique, tmp_path):
    import duckdb
    import pandas as pd

    t = topic_names.topics
    embeddings = [embedding(f"e{i}", 0, i) for i in range(6)]
    wide = Embedding.from_vector(np.arange(8, dtype=np.float32), doc_id="w", image_index=0, image_count=1,
                                 model="other")
    letter = DeadLetter(stage="decode", error_kind="decode_truncated", detail="cut", doc_id="d2", image_index=1,
                        source={"topic": t.documents, "partition": 0, "offset": 7}, original_value_b64="AAE=")
    publish(topic_names, [*((t.descriptions, description(f"d{i}", 0).encode()) for i in range(40)),
                          (t.descriptions, b"not json"),
                          *((t.embeddings, e.encode()) for e in embeddings), (t.embeddings, wide.encode()),
                          (t.results, DocumentResult(doc_id="d1", image_count=1, succeeded=1, failed=0,
                                                     images=({"image_index": 0, "status": "ok"},)).encode()),
                          (t.deadletter, letter.encode())])
    settings = topic_names.model_copy(update={"export": topic_names.export.model_copy(
        update={"max_file_bytes": 4096})})
    report = export(settings, tmp_path, format="parquet", group_id=f"export-{unique}")
    assert report.written == {"descriptions": 40, "embeddings": 7, "results": 1, "deadletter": 1}
    assert report.unreadable == 1
    assert not list(tmp_path.glob(".*")), "no temporary file is left"

    descriptions = sorted(tmp_path.glob("descriptions-*.parquet"))
    assert len(descriptions) > 1, "the size limit rolls the files"
    for path in descriptions:
        assert path.stat().st_size <= 4096 + 4096, path  # one record past the limit at most, then compressed
    rows, columns = parquet_rows(tmp_path, "descriptions")
    assert sorted(r[columns.index("doc_id")] for r in rows) == sorted(f"d{i}" for i in range(40))
    offsets = {(r[columns.index("kafka_partition")], r[columns.index("kafka_offset")]) for r in rows}
    on_topic = topic_offsets(topic_names, t.descriptions)
    assert len(offsets) == 40 and offsets < on_topic and len(on_topic - offsets) == 1  # all but "not json"

    # Vectors come back exactly, a fixed-size float16 column beside doc_id and image_index; another model's
    # float32 vectors are a file of their own.
    frame = pd.concat(pd.read_parquet(p) for p in sorted(tmp_path.glob("embeddings-*.parquet"))
                      if pd.read_parquet(p).model.iloc[0] == "tiny")
    assert list(frame.columns[:2]) == ["doc_id", "image_index"]
    for e in embeddings:
        [vector] = frame[frame.doc_id == e.doc_id].vector.tolist()
        assert vector.dtype == np.float16
        np.testing.assert_array_equal(vector, e.vector())
    assert duckdb.sql(f"SELECT vector FROM '{tmp_path}/embeddings-*.parquet' WHERE doc_id = 'w'").fetchall() == \
        [(list(range(8)),)]

    [letter_row] = pd.read_parquet(next(tmp_path.glob("deadletter-*.parquet"))).to_dict("records")
    assert (letter_row["error_kind"], letter_row["source_topic"], letter_row["source_offset"],
            letter_row["original_value"]) == ("decode_truncated", t.documents, 7, b"\x00\x01")
    [result] = duckdb.sql(f"SELECT doc_id, succeeded, images->>'$[0].status' FROM '{tmp_path}/results-*.parquet'"
                          ).fetchall()
    assert result == ("d1", 1, "ok")

    # A second run with nothing new writes nothing; a new record goes into a new file.
    assert export(settings, tmp_path, format="parquet", group_id=f"export-{unique}").written["descriptions"] == 0
    publish(topic_names, [(t.descriptions, description("late", 0).encode())])
    again = export(settings, tmp_path, format="parquet", group_id=f"export-{unique}")
    assert again.written["descriptions"] == 1 and len(again.files) == 1
    assert len(parquet_rows(tmp_path, "descriptions")[0]) == 41


def test_parquet_files_written_but_not_committed_are_not_written_again(topic_names, unique, tmp_path):
    """A run stopped after renaming its files but before committing their offsets: the next run finds the files'
    offsets in their footers and skips those records."""
    from kafka import TopicPartition
    from kafka.structs import OffsetAndMetadata

    from vlmstream.kafka.clients import make_consumer

    t = topic_names.topics
    publish(topic_names, [(t.descriptions, description(f"c{i}", 0).encode()) for i in range(30)])
    group = f"export-{unique}"
    first = export(topic_names, tmp_path, ("descriptions",), format="parquet", group_id=group)
    assert first.written == {"descriptions": 30}
    consumer = make_consumer(topic_names, group)  # the group forgets: as if the commit had never happened
    try:
        consumer.commit({TopicPartition(t.descriptions, p): OffsetAndMetadata(0, "", -1) for p in range(3)})
    finally:
        consumer.close()
    (tmp_path / ".descriptions-000099.parquet.tmp").write_bytes(b"PAR1 half a file")  # a kill mid-write
    publish(topic_names, [(t.descriptions, description("new", 0).encode())])
    second = export(topic_names, tmp_path, ("descriptions",), format="parquet", group_id=group)
    assert second.written == {"descriptions": 1}
    assert not (tmp_path / ".descriptions-000099.parquet.tmp").exists()
    rows, columns = parquet_rows(tmp_path, "descriptions")
    ids = [r[columns.index("doc_id")] for r in rows]
    assert sorted(ids) == sorted([f"c{i}" for i in range(30)] + ["new"])


@pytest.mark.slow
def test_parquet_export_killed_mid_run_loses_no_row_and_writes_none_twice(topic_names, unique, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    t = topic_names.topics
    out = tmp_path / "out"
    env = {**os.environ, "VLMSTREAM_BOOTSTRAP_SERVERS": topic_names.kafka.bootstrap_servers,
           "VLMSTREAM_TOPICS__DESCRIPTIONS": t.descriptions, "VLMSTREAM_EXPORT__MAX_FILE_BYTES": "8192",
           "VLMSTREAM_EXPORT__FLUSH_INTERVAL_S": "0.2"}
    command = [sys.executable, "-m", "vlmstream.cli", "export", str(out), "--format", "parquet", "--what",
               "descriptions", "--group-id", f"export-{unique}"]
    total = 3000

    def produce():
        for start in range(0, total, 100):
            publish(topic_names, [(t.descriptions, description(f"k{i}", 0).encode())
                                  for i in range(start, start + 100)])
            time.sleep(0.05)

    producer = threading.Thread(target=produce)
    producer.start()
    follower = subprocess.Popen(command + ["--follow"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list(out.glob("descriptions-*.parquet"))) < 5:
            time.sleep(0.05)
        follower.send_signal(signal.SIGKILL)  # mid-run: files being written, offsets not all committed
        follower.wait(30)
    finally:
        if follower.poll() is None:
            follower.kill()
        producer.join(120)
    killed_at = len(list(out.glob("descriptions-*.parquet")))
    assert 5 <= killed_at, follower.stdout.read().decode()[-3000:]
    # What the kill left is readable as it is: every visible file complete (DuckDB refuses a cut one).
    assert 0 < len(parquet_rows(out, "descriptions")[0]) < total
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list(out.glob(".*")), "no partial file is left"
    rows, columns = parquet_rows(out, "descriptions")
    coords = [(r[columns.index("kafka_partition")], r[columns.index("kafka_offset")]) for r in rows]
    assert len(coords) == len(set(coords)) == total, (len(coords), len(set(coords)))
    assert set(coords) == topic_offsets(topic_names, t.descriptions)
    assert sorted(r[columns.index("doc_id")] for r in rows) == sorted(f"k{i}" for i in range(total))


def test_summaries_are_exported_when_the_cluster_has_their_topic(topic_names, unique, tmp_path):
    from vlmstream.kafka.clients import make_admin
    from vlmstream.kafka.topics import TopicSpec, create_topics

    t = topic_names.topics
    first = export(topic_names, tmp_path / "before", format="parquet", group_id=f"export-{unique}-before")
    assert "summaries" not in first.written  # no topic yet: nothing to export, and no error
    create_topics(topic_names, [TopicSpec(t.summaries, 1, 1, {})])
    try:
        summary = {"schema_version": 1, "doc_id": "s1", "answer": {"type": "invoice", "condition": "good"}}
        publish(topic_names, [(t.summaries, orjson.dumps(summary)), (t.summaries, b"[1, 2]")])
        report = export(topic_names, tmp_path, format="parquet", group_id=f"export-{unique}")
        assert report.written["summaries"] == 1 and report.unreadable == 1
        rows, columns = parquet_rows(tmp_path, "summaries")
        assert [(r[columns.index("doc_id")], orjson.loads(r[columns.index("summary")])) for r in rows] == \
            [("s1", summary)]
    finally:
        admin = make_admin(topic_names)
        admin.delete_topics([t.summaries])
        admin.close()
