"""The inference consumer on the real broker: real corpus images prepared by the real decode stage,
the real TransformersEngine with the tiny model (CPU). One test uses an engine of its own, and only to
control completion order for the offset logic.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaProducer, TopicPartition

from consumers.infer.engine import InferenceOutput
from schemas import DeadLetter, Description, DocumentResult, Embedding, ImagePayload
from tests.helpers import (
    description_counts,
    documents,
    infer_settings,
    payload_record,
    prepared_corpus,
    produce_images,
    real_engine,
    run_until_idle,
    subprocess_env,
    tiny_model_dir,
    wait_for,
)
from tests.kafka_helpers import (
    NotUtf8HeaderKey,
    committed_offsets,
    end_offsets,
    read_topic,
    send_in_aborted_transaction,
)
from vlmstream.config import Settings
from vlmstream.kafka.clients import make_admin

REPO = Path(__file__).resolve().parents[1]


# --- helpers -------------------------------------------------------------------------------------------


def run_in_thread(runner, **kwargs):
    stop = threading.Event()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", runner.run(stop, **kwargs)), daemon=True)
    thread.start()
    return stop, thread, result


def start_infer(settings: Settings, *args: str, log_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vlmstream.cli", "infer", *args], cwd=REPO,
                            env=subprocess_env(settings), stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)


# --- offset logic (own engine: it only controls the completion order) -------------------------------


class HoldFirstEngine:
    """Completes every request at once except the first one submitted, which waits for ``release``."""

    name, model_id, revision, mode = "hold-first", "none", None, None
    batch_size, step_tokens = 4, None

    def __init__(self):
        self.release = threading.Event()
        self.held = None
        self.ready: list = []

    def submit(self, requests):
        for request in requests:
            if self.held is None:
                self.held = request
            else:
                self.ready.append(request)

    def poll(self, timeout_s):
        if self.held not in (None, "released") and self.release.is_set():
            self.ready.append(self.held)
            self.held = "released"
        if not self.ready:
            time.sleep(timeout_s)
            return []
        done, self.ready = self.ready, []
        return [InferenceOutput(r.request_id, text=f"{r.image.shape}", prompt_tokens=1, output_tokens=1,
                                visual_tokens=r.grid_thw[1] * r.grid_thw[2] // 4) for r in done]

    def pending(self):
        return len(self.ready) + (1 if self.held is not None and self.held != "released" else 0)

    def close(self):
        pass


@pytest.mark.kafka
def test_a_record_the_client_cannot_parse_is_dead_lettered_and_the_rest_described(topic_names, corpus_dir, unique,
                                                                                  engine):
    """A header key that is not UTF-8 (librdkafka clients can write one) makes kafka-python's poll raise."""
    settings = infer_settings(topic_names, unique, publish_embeddings=False)
    (meta, value), good = documents(corpus_dir, f"odd-{unique}", [2])
    producer = KafkaProducer(**settings.kafka.client_kwargs(), max_request_size=settings.kafka.max_message_bytes)
    try:
        producer.send(settings.topics.images, key=meta.key(), value=value, partition=0,
                      headers=meta.headers() + [(NotUtf8HeaderKey("trace"), b"1")]).get(timeout=30)
    finally:
        producer.close()
    produce_images(settings, [good], partition=0)
    run_until_idle(settings, engine)
    [letter] = [DeadLetter.decode(r.value) for r in read_topic(settings, settings.topics.deadletter, expected=1)]
    assert letter.error_kind == "unreadable_record" and letter.source["offset"] == 0
    assert description_counts(settings, expected=1) == Counter({(f"odd-{unique}-0", 1): 1})
    assert committed_offsets(settings, settings.infer.group_id, settings.topics.images) == {0: 2}


class DeepJsonForOneEngine:
    """Completes every request at once; the one for offset 0 answers with JSON nested past what orjson writes
    (a model answering a JSON schema can do that)."""

    name, model_id, revision, mode = "deep-json", "none", None, None
    batch_size, step_tokens = 4, None

    def __init__(self):
        self.ready: list = []

    def submit(self, requests):
        self.ready.extend(requests)

    def poll(self, timeout_s):
        done, self.ready = self.ready, []
        if not done:
            time.sleep(timeout_s)
        deep: object = 1
        for _ in range(300):
            deep = [deep]
        return [InferenceOutput(r.request_id, text="{}", prompt_tokens=1, output_tokens=1,
                                visual_tokens=r.grid_thw[1] * r.grid_thw[2] // 4,
                                parsed_json=deep if "/0#" in r.request_id else {"ok": True}) for r in done]

    def pending(self):
        return len(self.ready)

    def close(self):
        pass


@pytest.mark.kafka
def test_an_output_that_cannot_be_written_is_dead_lettered_and_the_rest_go_on(topic_names, corpus_dir, unique):
    """It used to raise out of the runner with nothing committed: the same record again after every restart."""
    settings = infer_settings(topic_names, unique, publish_embeddings=False)
    produce_images(settings, documents(corpus_dir, f"deep-{unique}", [3]), partition=0)
    run_until_idle(settings, DeepJsonForOneEngine())
    [letter] = [DeadLetter.decode(r.value) for r in read_topic(settings, settings.topics.deadletter, expected=1)]
    assert (letter.error_kind, letter.image_index, letter.retriable) == ("output_invalid", 0, False)
    assert sum(description_counts(settings, expected=2).values()) == 2
    assert committed_offsets(settings, settings.infer.group_id, settings.topics.images) == {0: 3}


def start_holding_the_first_of_five(topic_names, corpus_dir, doc_id: str, unique: str, max_seconds: float,
                                    **runner_kwargs):
    """A document of five images on partition 0 and a runner whose engine holds the first (offset 0) until
    released; returns once the other four are described: (settings, engine, run_in_thread's triple)."""
    from consumers.infer.runner import InferenceRunner

    settings = infer_settings(topic_names, unique, publish_embeddings=False)
    produce_images(settings, documents(corpus_dir, doc_id, [5]), partition=0)
    engine = HoldFirstEngine()
    running = run_in_thread(InferenceRunner(settings, engine, commit_interval_s=0.2, **runner_kwargs),
                            max_seconds=max_seconds)
    try:
        wait_for(lambda: sum(description_counts(settings, timeout_s=2).values()) >= 4, 30, "4 descriptions")
    except BaseException:
        running[0].set()
        running[1].join(30)
        raise
    return settings, engine, running


def test_in_flight_window_follows_the_engines_batch_unless_set():
    """vLLM on an H200 runs 1024 sequences at once; a fixed 256-image window would keep it three quarters empty."""
    from types import SimpleNamespace

    from consumers.infer.runner import InferenceRunner

    settings = Settings()
    assert InferenceRunner(settings, SimpleNamespace(batch_size=1024, step_tokens=None)).max_images_in_flight == 2048
    assert InferenceRunner(settings, SimpleNamespace(batch_size=8, step_tokens=None)).max_images_in_flight == 256
    pinned = settings.model_copy(update={"infer": settings.infer.model_copy(update={"max_images_in_flight": 100})})
    assert InferenceRunner(pinned, SimpleNamespace(batch_size=1024, step_tokens=None)).max_images_in_flight == 100


def test_token_bound_warning_only_when_the_engine_lacks_work(caplog):
    """Fewer images in flight than vLLM's 1024 sequences is fine at 12.8 MP (~7,000 tokens each fill its prefill
    steps); it is worth a warning only when the queued tokens would not fill two steps either."""
    from types import SimpleNamespace

    from consumers.infer.runner import InferenceRunner

    runner = InferenceRunner(Settings(), SimpleNamespace(batch_size=1024, step_tokens=16384))
    runner.window.backlog.append(object())
    runner.window.in_flight = {f"r{i}": object() for i in range(37)}
    runner.window.tokens = 37 * 7000
    with caplog.at_level("WARNING", logger="consumers.infer.runner"):
        runner._check_saturation()
        assert "holds only" not in caplog.text
        runner.window.tokens = 20000
        runner._check_saturation()
        assert "holds only 37 image(s)" in caplog.text


@pytest.mark.kafka
def test_out_of_order_completion_commits_only_the_done_prefix(topic_names, corpus_dir, unique):
    settings, engine, (stop, thread, result) = start_holding_the_first_of_five(
        topic_names, corpus_dir, f"ooo-{unique}", unique, max_seconds=60)
    try:
        time.sleep(1.0)  # several commit intervals pass with offset 0 still in flight
        assert committed_offsets(settings, settings.infer.group_id, settings.topics.images).get(0, 0) == 0
        engine.release.set()
        wait_for(lambda: committed_offsets(settings, settings.infer.group_id, settings.topics.images).get(0) == 5,
                 30, "commit past the released message")
    finally:
        stop.set()
        thread.join(30)
    assert result["code"] == 0


@pytest.mark.kafka
def test_work_dropped_at_a_rebalance_is_redone_when_the_partition_comes_back(topic_names, corpus_dir, unique):
    """kafka-python keeps the fetch position of a partition that returns to the same member: the image the runner
    dropped at the revoke (still in the engine) was skipped for good until the runner rewound to it."""
    from kafka import KafkaConsumer

    # Offset 0 stays in the engine: the revoke has to drop it.
    settings, engine, (stop, thread, result) = start_holding_the_first_of_five(
        topic_names, corpus_dir, f"back-{unique}", unique, max_seconds=120, revoke_drain_s=0.5)
    try:
        # A second member joins and leaves (two rebalances). The range assignor orders members by id, and this
        # one's sorts after the runner's ("vlmstream-infer-..."), so partition 0 stays with the runner throughout.
        other = KafkaConsumer(settings.topics.images, **settings.kafka.client_kwargs(), client_id="zz-visitor",
                              group_id=settings.infer.group_id, enable_auto_commit=False)
        deadline = time.monotonic() + 30
        while not other.assignment() and time.monotonic() < deadline:
            other.poll(timeout_ms=200)
        assert TopicPartition(settings.topics.images, 0) not in other.assignment()
        other.close()
        wait_for(lambda: description_counts(settings, timeout_s=2)[(f"back-{unique}-0", 0)] >= 1, 60,
                 "the dropped image described after the partition came back")
        wait_for(lambda: committed_offsets(settings, settings.infer.group_id, settings.topics.images).get(0) == 5,
                 30, "commit past every image")
    finally:
        stop.set()
        thread.join(30)
    assert result["code"] == 0


# --- end to end with the real engine --------------------------------------------------------------


@pytest.mark.flaky(reruns=2)  # process kills and rebalances on a shared, loaded broker; a real loss fails all three tries
@pytest.mark.kafka
@pytest.mark.model
@pytest.mark.slow
def test_end_to_end_descriptions_embeddings_and_document_results(topic_names, corpus_dir, unique, engine):
    from consumers.results.aggregator import ResultsAggregator

    settings = infer_settings(topic_names, unique, max_attempts=2)
    good = documents(corpus_dir, f"e2e-{unique}", [3, 2])
    meta, value = payload_record(f"e2e-{unique}-poison", 0, 2, "corrupt.jpg", prepared_corpus(str(corpus_dir))[0][1])
    poison = [(meta, bytes(len(value)))]  # right size, not a JPEG: corrupt for good
    meta2, value2 = payload_record(f"e2e-{unique}-poison", 1, 2, *prepared_corpus(str(corpus_dir))[1])
    produce_images(settings, good + poison + [(meta2, value2)])

    aggregator_stop = threading.Event()
    aggregator = ResultsAggregator(settings, group_id=f"test-results-{unique}")
    aggregator_thread = aggregator.start_thread(aggregator_stop, max_seconds=120)
    run_until_idle(settings, engine)
    results = read_topic(settings, settings.topics.results, expected=3, timeout_s=60)
    aggregator_stop.set()
    aggregator_thread.join(30)
    assert len(results) == 3, (aggregator.stats, aggregator.open_at_stop)

    described = [Description.decode(r.value) for r in read_topic(settings, settings.topics.descriptions,
                                                                 expected=6, timeout_s=10)]
    assert Counter((d.doc_id, d.image_index) for d in described) == Counter(
        {(m.doc_id, m.image_index): 1 for m, _ in good + [(meta2, value2)]})
    one = next(d for d in described if d.doc_id == f"e2e-{unique}-0" and d.image_index == 2)
    assert one.image_count == 3 and one.engine == "transformers" and one.prompt_id == settings.infer.prompt_id
    assert one.visual_tokens == good[2][0].visual_tokens and one.output_tokens > 0
    assert {"queue_ms", "engine_ms", "total_ms"} <= set(one.timings_ms)
    assert one.source["topic"] == settings.topics.images and one.metadata == {"case": f"e2e-{unique}-0"}

    import json

    hidden = json.loads((Path(tiny_model_dir()) / "config.json").read_text())
    hidden = hidden.get("text_config", {}).get("hidden_size") or hidden["hidden_size"]
    embeddings = [Embedding.decode(r.value) for r in read_topic(settings, settings.topics.embeddings,
                                                                expected=6, timeout_s=10)]
    assert len(embeddings) == 6
    for e in embeddings:
        vector = e.vector()
        assert vector.shape == (hidden,) and e.dim == hidden and np.isfinite(vector).all()

    letters = [DeadLetter.decode(r.value) for r in read_topic(settings, settings.topics.deadletter,
                                                              expected=1, timeout_s=10)]
    assert [(l.doc_id, l.image_index, l.error_kind, l.attempts, l.stage) for l in letters] == [
        (f"e2e-{unique}-poison", 0, "payload_invalid", 1, "infer")]  # not retriable: dead at once

    by_doc = {r.key.decode(): DocumentResult.decode(r.value) for r in results}
    assert set(by_doc) == {f"e2e-{unique}-0", f"e2e-{unique}-1", f"e2e-{unique}-poison"}
    assert (by_doc[f"e2e-{unique}-0"].succeeded, by_doc[f"e2e-{unique}-0"].failed) == (3, 0)
    poisoned = by_doc[f"e2e-{unique}-poison"]
    assert (poisoned.succeeded, poisoned.failed) == (1, 1)
    assert [i["image_index"] for i in poisoned.images] == [0, 1]
    assert poisoned.images[0]["status"] == "failed" and poisoned.images[0]["error_kind"] == "payload_invalid"
    assert poisoned.images[1]["status"] == "ok" and isinstance(poisoned.images[1]["text"], str)


@pytest.mark.kafka
@pytest.mark.model
def test_retriable_failure_dead_letters_after_max_attempts(topic_names, corpus_dir, unique, tmp_path, engine):
    """A claim-check object the store cannot read is retried (store outages pass), then dead-lettered."""

    settings = infer_settings(topic_names, unique, max_attempts=3)
    store = tmp_path / "claim-check"
    store.mkdir()
    settings = settings.model_copy(update={"decode": settings.decode.model_copy(
        update={"claim_check_url": str(store)})})
    uri, prepared = prepared_corpus(str(corpus_dir))[0]
    missing = str(store / unique / "payload.bin")
    (store / "a-folder").mkdir()
    records = [payload_record(f"retry-{unique}", 0, 3, uri, prepared, claim_check=missing),
               payload_record(f"retry-{unique}", 1, 3, uri, prepared),
               # A reference naming a folder names the same nothing next time: dead-lettered at once.
               payload_record(f"retry-{unique}", 2, 3, uri, prepared, claim_check=str(store / "a-folder"))]
    produce_images(settings, records)
    runner = run_until_idle(settings, engine, retry_backoff_s=0.05)
    letters = sorted((DeadLetter.decode(r.value) for r in read_topic(settings, settings.topics.deadletter,
                                                                       expected=2)), key=lambda d: d.image_index)
    assert [(d.error_kind, d.attempts, d.retriable, d.image_index) for d in letters] == [
        ("claim_check_unavailable", 3, True, 0), ("claim_check_unavailable", 1, False, 2)]
    letter = letters[0]
    assert runner.stats.retries == 2
    # The dead letter keeps what redrive needs: the original value and the metadata header.
    assert ImagePayload.decode(letter.original_headers["vlmstream-meta"]).claim_check == missing
    assert description_counts(settings, expected=1) == Counter({(f"retry-{unique}", 1): 1})
    assert committed_offsets(settings, settings.infer.group_id, settings.topics.images) == {
        p: e for p, e in end_offsets(settings, settings.topics.images).items() if e}


# --- processes: SIGKILL, SIGTERM, exactly-once ------------------------------------------------------


@pytest.mark.flaky(reruns=2)  # process kills and rebalances on a shared, loaded broker; a real loss fails all three tries
@pytest.mark.kafka
@pytest.mark.model
@pytest.mark.slow
def test_sigkill_and_restart_loses_nothing_and_duplicates_at_most_the_window(topic_names, corpus_dir, unique,
                                                                             tmp_path, engine):
    window = 3
    settings = infer_settings(topic_names, unique, max_images_in_flight=window, batch_size=2)
    records = documents(corpus_dir, f"kill-{unique}", [3, 3, 3])
    produce_images(settings, records)
    first = start_infer(settings, "--no-results", "--max-seconds", "120", log_path=tmp_path / "first.log")
    try:
        wait_for(lambda: sum(description_counts(settings, timeout_s=2).values()) >= 3, 90, "first descriptions")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    run_until_idle(settings, engine)  # the restart (in this process: the killed one was a real process)
    counts = description_counts(settings, expected=len(records))
    assert set(counts) == {(m.doc_id, m.image_index) for m, _ in records}  # nothing lost
    duplicates = sum(c - 1 for c in counts.values())
    # Redone: what was in flight plus what completed since the last commit (a commit every `window` images).
    assert duplicates <= 2 * window, counts


@pytest.mark.kafka
@pytest.mark.model
@pytest.mark.slow
def test_sigterm_drains_commits_and_leaves_the_group(topic_names, corpus_dir, unique, tmp_path):
    settings = infer_settings(topic_names, unique, max_images_in_flight=16, batch_size=4)
    records = documents(corpus_dir, f"term-{unique}", [3, 3, 3])
    produce_images(settings, records)
    process = start_infer(settings, "--no-results", "--max-seconds", "120", log_path=tmp_path / "infer.log")
    wait_for(lambda: sum(description_counts(settings, timeout_s=2).values()) >= 1, 90, "a first description")
    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0, (tmp_path / "infer.log").read_text()[-3000:]
    committed = committed_offsets(settings, settings.infer.group_id, settings.topics.images)
    described = [Description.decode(r.value) for r in read_topic(settings, settings.topics.descriptions)]
    done = Counter((d.source["partition"]) for d in described)
    # Everything fetched was drained: committed == end offsets, and each committed message was described once.
    assert committed == {p: e for p, e in end_offsets(settings, settings.topics.images).items() if e}
    assert {p: done[p] for p in committed} == committed
    assert len(described) == len(records)
    from vlmstream.cli.groups import group_state

    admin = make_admin(settings)
    try:
        state, members = group_state(admin, settings.infer.group_id)
    finally:
        admin.close()
    assert members == [] and state in ("Empty", "Dead")


@pytest.mark.kafka
@pytest.mark.model
@pytest.mark.slow
def test_exactly_once_reader_sees_each_image_once_across_a_crash(topic_names, corpus_dir, unique, tmp_path,
                                                                 engine):
    settings = infer_settings(topic_names, unique, max_images_in_flight=3, batch_size=2, exactly_once=True)
    records = documents(corpus_dir, f"eos-{unique}", [3, 3])
    produce_images(settings, records)
    first = start_infer(settings, "--no-results", "--exactly-once", "--max-seconds", "120",
                        log_path=tmp_path / "first.log")
    try:
        wait_for(lambda: sum(description_counts(settings, timeout_s=2, read_committed=True).values()) >= 2, 90,
                 "first committed descriptions")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    run_until_idle(settings, engine)
    # The killed producer's open transaction is aborted by its timeout; read_committed never shows it.
    counts = description_counts(settings, expected=len(records), timeout_s=60, read_committed=True)
    assert counts == Counter({(m.doc_id, m.image_index): 1 for m, _ in records})


@pytest.mark.kafka
@pytest.mark.model
def test_images_of_an_aborted_transaction_are_never_described(topic_names, corpus_dir, unique, engine):
    """A decode worker in exactly-once mode that dies or is fenced leaves an aborted transaction on the images
    topic; the inference consumer used to read uncommitted and describe those images too."""
    settings = infer_settings(topic_names, unique, publish_embeddings=False)
    (aborted_meta, aborted_value), (kept_meta, kept_value) = documents(corpus_dir, f"abort-{unique}", [1, 1])
    send_in_aborted_transaction(settings, settings.topics.images, aborted_meta.key(), aborted_value,
                                aborted_meta.headers(), f"test-abort-{unique}")
    produce_images(settings, [(kept_meta, kept_value)], partition=0)
    run_until_idle(settings, engine)
    assert description_counts(settings, expected=1) == Counter({(kept_meta.doc_id, 0): 1})
    assert committed_offsets(settings, settings.infer.group_id, settings.topics.images) == {0: 3}


@pytest.mark.kafka
@pytest.mark.model
def test_a_dead_engine_stops_the_runner_without_committing(topic_names, corpus_dir, unique):
    from consumers.infer.runner import EXIT_ENGINE_DEAD, InferenceRunner

    settings = infer_settings(topic_names, unique, max_images_in_flight=2, batch_size=1)
    produce_images(settings, documents(corpus_dir, f"dead-{unique}", [6]))
    engine = real_engine(settings)
    # No periodic commit: whatever was described before the death must still not be committed after it.
    runner = InferenceRunner(settings, engine, commit_interval_s=3600, commit_every=10_000)
    stop, thread, result = run_in_thread(runner, max_seconds=120)
    try:
        wait_for(lambda: sum(description_counts(settings, timeout_s=1.5).values()) >= 1, 90, "a description")
        engine.close()  # the engine is gone: submit and poll now raise EngineDeadError
        thread.join(120)
    finally:
        stop.set()
    assert result["code"] == EXIT_ENGINE_DEAD
    assert committed_offsets(settings, settings.infer.group_id, settings.topics.images) == {}
