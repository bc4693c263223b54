"""The document-result aggregator on the real broker: descriptions (3 partitions) and dead letters
(1 partition) in, one DocumentResult per document out; state rebuilt from the topics after a restart."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from kafka import KafkaProducer

from consumers.results.aggregator import ResultsAggregator
from schemas import DeadLetter, Description, DocumentResult, now
from tests.helpers import wait_for
from tests.kafka_helpers import read_topic


def description(doc_id: str, index: int, count: int) -> Description:
    return Description(doc_id=doc_id, image_index=index, image_count=count, text=f"image {index} of {doc_id}",
                       model="tiny", prompt_id="describe-v1", engine="transformers",
                       source_uri=f"/img/{doc_id}/{index}.jpg", metadata={"batch": "b1"}, created_at=now())


def dead_letter(doc_id: str, index: int | None, count: int | None, kind: str, stage: str = "infer") -> DeadLetter:
    return DeadLetter(stage=stage, error_kind=kind, detail=f"{kind} for {doc_id}", doc_id=doc_id,
                      image_index=index, image_count=count, created_at=now())


def publish(settings, messages) -> None:
    producer = KafkaProducer(**settings.kafka.client_kwargs())
    try:
        for message in messages:
            topic = settings.topics.descriptions if isinstance(message, Description) else settings.topics.deadletter
            producer.send(topic, key=message.key(), value=message.encode(), headers=message.headers())
        producer.flush()
    finally:
        producer.close()


def run_aggregator(settings, group_id: str) -> ResultsAggregator:
    aggregator = ResultsAggregator(settings, group_id=group_id, commit_interval_s=0.3)
    assert aggregator.run(threading.Event(), max_seconds=60, until_idle_s=2.5) == 0
    return aggregator


def results_by_doc(settings, expected: int) -> dict[str, list[DocumentResult]]:
    out: dict[str, list[DocumentResult]] = {}
    for record in read_topic(settings, settings.topics.results, expected=expected, timeout_s=20, idle_s=1.0):
        result = DocumentResult.decode(record.value)
        assert record.key == result.doc_id.encode()
        out.setdefault(result.doc_id, []).append(result)
    return out


@pytest.mark.kafka
def test_one_result_per_document_with_failures_and_document_level_errors(topic_names, unique):
    settings = topic_names
    ok, mixed, redriven, whole, unknown = (f"{name}-{unique}" for name in
                                           ("ok", "mixed", "redriven", "whole", "unknown"))
    publish(settings, [
        # A note from the decode stage on an image that was still decoded: it arrives before the image's
        # description and must neither complete the document nor fail the image.
        dead_letter(ok, 1, 2, "pages_not_described", stage="decode"),
        description(ok, 1, 2), description(ok, 0, 2),
        description(mixed, 0, 3), dead_letter(mixed, 2, 3, "payload_invalid"), description(mixed, 1, 3),
        # A dead letter followed by a later success of the same image (after redrive): the success wins.
        dead_letter(redriven, 0, 1, "claim_check_unavailable"),
        # The decode stage could not read the document at all, but said how many images it has.
        dead_letter(whole, None, 2, "fetch_not_found", stage="decode"),
        # ... and without knowing the count.
        dead_letter(unknown, None, None, "invalid_message", stage="decode"),
        # Not attributable to a document: read and skipped.
        DeadLetter(stage="decode", error_kind="invalid_message", detail="no doc id"),
    ])
    aggregator = run_aggregator(settings, f"test-results-{unique}")
    assert aggregator.stats.skipped == 1

    got = results_by_doc(settings, expected=5)
    # `ok` goes out twice when its note is read after its descriptions (the two topics have no common order).
    assert set(got) == {ok, mixed, redriven, whole, unknown} and all(len(got[d]) == 1 for d in got if d != ok)
    assert len(got[ok]) in (1, 2)
    r = got[ok][-1]
    assert (r.image_count, r.succeeded, r.failed) == (2, 2, 0)
    assert [i["image_index"] for i in r.images] == [0, 1] and r.images[0]["text"] == f"image 0 of {ok}"
    assert r.metadata == {"batch": "b1", "pages_not_described": {"1": f"pages_not_described for {ok}"}}
    r = got[mixed][0]
    assert (r.succeeded, r.failed) == (2, 1)
    assert [(i["image_index"], i["status"], i.get("error_kind")) for i in r.images] == [
        (0, "ok", None), (1, "ok", None), (2, "failed", "payload_invalid")]
    r = got[whole][0]
    assert (r.image_count, r.succeeded, r.failed) == (2, 0, 2)
    assert {i["error_kind"] for i in r.images} == {"fetch_not_found"}
    r = got[unknown][0]
    assert (r.image_count, r.succeeded, r.failed, r.images) == (0, 0, 0, ())
    assert r.metadata["document_error"]["error_kind"] == "invalid_message"
    r = got[redriven][0]
    assert (r.succeeded, r.failed) == (0, 1)

    # The redriven image succeeds: the document's result is published again, now ok (compaction keeps it).
    publish(settings, [description(redriven, 0, 1)])
    run_aggregator(settings, f"test-results-{unique}")
    again = results_by_doc(settings, expected=6)[redriven]
    assert [(x.succeeded, x.failed) for x in again][-1] == (1, 0)


@pytest.mark.kafka
def test_open_documents_survive_a_restart_without_an_external_store(topic_names, unique):
    settings = topic_names
    group = f"test-results-{unique}"
    done, waiting = f"done-{unique}", f"waiting-{unique}"
    # `waiting` has its description on a descriptions partition and a dead letter on the dead-letter topic;
    # its third image arrives only after the aggregator restarted.
    # `done` goes first: were it behind `waiting` in the same partition, a restart would re-read it (by design).
    publish(settings, [description(done, 0, 1), description(waiting, 0, 3),
                       dead_letter(waiting, 1, 3, "out_of_memory")])
    first = run_aggregator(settings, group)
    assert first.open_at_stop == 1
    assert set(results_by_doc(settings, expected=1)) == {done}

    publish(settings, [description(waiting, 2, 3)])
    second = run_aggregator(settings, group)  # a new process: nothing in memory
    got = results_by_doc(settings, expected=2)
    assert len(got[waiting]) == 1
    r = got[waiting][0]
    assert [(i["image_index"], i["status"]) for i in r.images] == [(0, "ok"), (1, "failed"), (2, "ok")]
    assert second.open_at_stop == 0
    # `done` was emitted and released before the restart: it is not rebuilt, so not emitted twice.
    assert len(got[done]) == 1


@pytest.mark.kafka
def test_a_note_read_after_its_documents_result_sends_the_result_again_with_it(topic_names, unique):
    """Descriptions and dead letters are two topics read in no common order, so a decode note
    (pages_not_described) can come after the document's result has gone out."""
    settings = topic_names
    doc_id = f"fax-{unique}"
    aggregator = ResultsAggregator(settings, group_id=f"test-results-{unique}", commit_interval_s=0.3)
    stop = threading.Event()
    thread = aggregator.start_thread(stop, max_seconds=60)
    try:
        publish(settings, [description(doc_id, 0, 1)])
        [first] = results_by_doc(settings, expected=1)[doc_id]
        assert "pages_not_described" not in first.metadata
        publish(settings, [dead_letter(doc_id, 0, 1, "pages_not_described", stage="decode")])
        [_, second] = results_by_doc(settings, expected=2)[doc_id]
    finally:
        stop.set()
        thread.join(30)
    assert second.metadata["pages_not_described"] == {"0": f"pages_not_described for {doc_id}"}
    assert (second.succeeded, second.failed) == (1, 0)


@pytest.mark.kafka
def test_a_document_republished_with_other_images_replaces_what_its_result_said(topic_names, unique):
    """The producer sends a changed document again (its ledger notices the change). The new version's image at an
    index it shares with the old one used to leave the old text in the result for good whenever it arrived after
    the rest of the new version: it counted as a repeat of a known success."""
    settings = topic_names
    doc_id = f"edited-{unique}"

    def version(index: int, count: int, uri: str, text: str) -> Description:
        return dataclasses.replace(description(doc_id, index, count), source_uri=uri, text=text)

    aggregator = ResultsAggregator(settings, group_id=f"test-results-{unique}", commit_interval_s=0.3)
    stop = threading.Event()
    thread = aggregator.start_thread(stop, max_seconds=60)
    try:
        publish(settings, [version(0, 2, "/v1/a.jpg", "old a"), version(1, 2, "/v1/b.jpg", "old b")])
        assert len(results_by_doc(settings, expected=1)[doc_id]) == 1
        # Version 2: page 0 replaced, page 1 kept, a page 2 added; its page 0 comes last.
        publish(settings, [version(1, 3, "/v1/b.jpg", "old b"), version(2, 3, "/v2/c.jpg", "new c")])
        assert len(results_by_doc(settings, expected=2)[doc_id]) == 2
        publish(settings, [version(0, 3, "/v2/a.jpg", "new a")])
        final = results_by_doc(settings, expected=3)[doc_id][-1]
    finally:
        stop.set()
        thread.join(30)
    assert [(i["source_uri"], i["text"]) for i in final.images] == [
        ("/v2/a.jpg", "new a"), ("/v1/b.jpg", "old b"), ("/v2/c.jpg", "new c")]


def test_single_owner_assignment_without_known_partitions_asks_for_a_rejoin():
    from types import SimpleNamespace

    from consumers.results.ownership import SingleOwnerAssignor

    class Cluster:
        def __init__(self, known):
            self.known = known

        def partitions_for_topic(self, topic):
            return self.known.get(topic)

    members = [SimpleNamespace(member_id=m, group_instance_id=None, metadata=SimpleNamespace(topics=["d", "x"]))
               for m in ("b", "a")]
    SingleOwnerAssignor.assigned_without_partitions.clear()
    known = SingleOwnerAssignor.assign(Cluster({"d": {0, 1}, "x": {0}}), members)
    assert known["a"].assigned_partitions == [("d", [0, 1]), ("x", [0])] and known["b"].assigned_partitions == []
    assert not SingleOwnerAssignor.assigned_without_partitions.is_set()
    SingleOwnerAssignor.assign(Cluster({"d": {0, 1}}), members)  # "x" not in this member's metadata yet
    assert SingleOwnerAssignor.assigned_without_partitions.is_set()
    SingleOwnerAssignor.assigned_without_partitions.clear()


@pytest.mark.kafka
def test_an_oversized_result_goes_out_with_texts_cut_and_an_unreadable_record_is_passed(topic_names, unique):
    """Both used to stop the aggregator, on the same record after every restart: a result over the producer's
    limit (MessageSizeTooLargeError), and a record kafka-python cannot parse (CorruptRecordError)."""
    from tests.kafka_helpers import NotUtf8HeaderKey

    limit = 300_000
    settings = topic_names.model_copy(update={"kafka": topic_names.kafka.model_copy(
        update={"max_message_bytes": limit})})
    long_doc, after = f"long-{unique}", f"after-{unique}"
    # Three bytes a character in the middle one: the cut counts bytes, not characters.
    words = ["0" * 300_000, "字" * 100_000, "2" * 300_000]
    long_texts = [dataclasses.replace(description(long_doc, i, 3), text=words[i]) for i in range(3)]
    producer = KafkaProducer(**settings.kafka.client_kwargs())
    try:
        unreadable = description(after, 0, 1)
        producer.send(settings.topics.descriptions, key=b"odd", value=unreadable.encode(), partition=0,
                      headers=[(NotUtf8HeaderKey("trace"), b"1")]).get(timeout=30)
    finally:
        producer.close()
    publish(settings, long_texts + [description(after, 0, 1)])
    aggregator = run_aggregator(settings, f"test-results-{unique}")
    assert aggregator.stats.skipped == 1 and aggregator.stats.texts_cut == 1

    got = results_by_doc(settings, expected=2)
    [long_result] = got[long_doc]
    assert (long_result.image_count, long_result.succeeded) == (3, 3)
    for i, image in enumerate(long_result.images):
        assert image["text"].startswith(words[i][:300]) and image["text"].endswith("descriptions topic]")
        assert len(image["text"]) < len(words[i])
    assert len(long_result.encode()) <= limit
    assert [(r.image_count, r.succeeded) for r in got[after]] == [(1, 1)]


def start_forgetting_aggregator(settings, unique: str) -> tuple[ResultsAggregator, threading.Event, threading.Thread]:
    """An aggregator in a thread that forgets an emitted document as soon as another one is emitted (an LRU of
    one) and times an open document out after 1 s: late records meet forgotten documents at once."""
    aggregator = ResultsAggregator(settings, group_id=f"test-results-{unique}", commit_interval_s=0.3,
                                   open_timeout_s=1.0, recent_docs=1)
    stop = threading.Event()
    return aggregator, stop, aggregator.start_thread(stop, max_seconds=90)


def _forgotten(aggregator: ResultsAggregator, doc_id: str) -> bool:
    return doc_id not in aggregator._docs and doc_id not in aggregator._recent


@pytest.mark.kafka
def test_late_records_of_a_forgotten_document_never_replace_its_result_with_a_partial_one(topic_names, unique):
    """A document's records can come again after its result went out and it left memory (``recent_docs``): a
    duplicate description (at-least-once redelivery), a late dead letter of an image that succeeded. Each used to
    open the document again with that one image, and ``open_timeout_s`` later a partial result replaced the
    complete one in the compacted topic."""
    settings = topic_names
    whole, other, failed = (f"{name}-{unique}" for name in ("whole", "other", "failed"))
    aggregator, stop, thread = start_forgetting_aggregator(settings, unique)
    try:
        publish(settings, [description(whole, 0, 2), description(whole, 1, 2),
                           description(failed, 0, 2), dead_letter(failed, 1, 2, "out_of_memory")])
        results_by_doc(settings, expected=2)
        publish(settings, [description(other, 0, 1)])  # pushes both out of the LRU of one
        results_by_doc(settings, expected=3)
        wait_for(lambda: _forgotten(aggregator, whole) and _forgotten(aggregator, failed), 20, "documents released")
        publish(settings, [
            description(whole, 1, 2),  # redelivered
            dead_letter(whole, 0, 2, "out_of_memory"),  # an earlier try of an image that succeeded
            dead_letter(whole, None, 2, "fetch_timeout", stage="decode"),  # a late document-level failure
            dead_letter(failed, 1, 2, "out_of_memory"),  # redelivered dead letter
        ])
        wait_for(lambda: aggregator.stats.records >= 9, 20, "late records read")
        time.sleep(2.5)  # past open_timeout_s and a few commits: a reopened document would have been emitted
        got = results_by_doc(settings, expected=3)
    finally:
        stop.set()
        thread.join(30)
    assert [(r.succeeded, r.failed) for r in got[whole]] == [(2, 0)]
    assert [(r.succeeded, r.failed) for r in got[failed]] == [(1, 1)]
    assert aggregator.stats.timed_out == 0 and aggregator.open_documents() == 0 and aggregator.stats.late == 4


@pytest.mark.kafka
def test_a_partial_result_of_a_reopened_document_is_not_sent_but_a_newer_version_is(topic_names, unique):
    """A record that can add a success (a redriven image of a document that failed) opens the forgotten document
    again; should it time out with fewer successes than the result already sent, that result stays. A newer
    version of the document (another image count) still replaces it."""
    settings = topic_names
    doc_id, other = f"doc-{unique}", f"other-{unique}"
    aggregator, stop, thread = start_forgetting_aggregator(settings, unique)
    try:
        publish(settings, [description(doc_id, 0, 3), description(doc_id, 1, 3),
                           dead_letter(doc_id, 2, 3, "out_of_memory")])
        results_by_doc(settings, expected=1)
        publish(settings, [description(other, 0, 1)])
        results_by_doc(settings, expected=2)
        wait_for(lambda: _forgotten(aggregator, doc_id), 20, "document released")
        publish(settings, [description(doc_id, 2, 3)])  # redriven: succeeds now, but the others are forgotten
        wait_for(lambda: aggregator.stats.timed_out >= 1, 20, "the reopened document timing out")
        time.sleep(1.0)  # a result it emitted would be on the topic by now
        assert [(r.succeeded, r.failed) for r in results_by_doc(settings, expected=2)[doc_id]] == [(2, 1)]
        # The producer republishes the document with two images: a newer version, emitted over the old one.
        publish(settings, [description(doc_id, 0, 2), description(doc_id, 1, 2)])
        final = results_by_doc(settings, expected=3)[doc_id][-1]
    finally:
        stop.set()
        thread.join(30)
    assert (final.image_count, final.succeeded, final.failed) == (2, 2, 0)
    assert aggregator.stats.stale == 1


@pytest.mark.kafka
def test_a_replay_with_another_model_replaces_the_result_in_memory_and_forgotten(topic_names, unique):
    """Topics replayed into an inference group with a new checkpoint describe every image again under another model.
    A description by another model is not a duplicate: the result is sent again with the new texts, whether the
    document is still in memory or was forgotten (then once all its images are described again). A redelivered
    description by the model that described the result is still dropped as late."""
    settings = topic_names
    held, gone = f"held-{unique}", f"gone-{unique}"
    aggregator, stop, thread = start_forgetting_aggregator(settings, unique)

    def by(model: str, doc_id: str, index: int) -> Description:
        return dataclasses.replace(description(doc_id, index, 2), model=model, text=f"{model} on {doc_id}/{index}")

    try:
        publish(settings, [by("old", gone, 0), by("old", gone, 1)])
        results_by_doc(settings, expected=1)
        publish(settings, [by("old", held, 0), by("old", held, 1)])  # pushes `gone` out of the LRU of one
        results_by_doc(settings, expected=2)
        wait_for(lambda: _forgotten(aggregator, gone), 20, "document released")
        publish(settings, [by("old", gone, 1)])  # redelivered: late, dropped
        wait_for(lambda: aggregator.stats.late >= 1, 20, "the redelivered description dropped")
        publish(settings, [by("new", held, 0), by("new", held, 1), by("new", gone, 0), by("new", gone, 1)])
        wait_for(lambda: aggregator.stats.records >= 9, 20, "the replay read")
        time.sleep(2.5)  # past open_timeout_s: a partial result would be out by now
        got = results_by_doc(settings, expected=4)  # `held` is sent again once or twice, as it stays in memory or not
    finally:
        stop.set()
        thread.join(30)
    for doc_id in (held, gone):
        last = got[doc_id][-1]
        assert [(i["model"], i["text"]) for i in last.images] == [("new", f"new on {doc_id}/0"),
                                                                    ("new", f"new on {doc_id}/1")]
        assert (last.succeeded, last.failed) == (2, 0)
    assert len(got[gone]) == 2  # the old result, then the replay's once both images were in
    assert aggregator.stats.late == 1 and aggregator.stats.stale == 0 and aggregator.stats.timed_out == 0


class _Killed(BaseException):
    """The aggregator's process dying: nothing after it runs, not even an abort."""


def _partition(doc_id: str, partitions: int) -> int:
    from kafka.partitioner.default import murmur2

    return (murmur2(doc_id.encode()) & 0x7FFFFFFF) % partitions


@pytest.mark.kafka
def test_exactly_once_a_read_committed_reader_sees_each_result_once_across_a_kill_mid_transaction(
        topic_names, unique, monkeypatch):
    import consumers.results.aggregator as results_module

    settings = topic_names.model_copy(update={"infer": topic_names.infer.model_copy(update={"exactly_once": True})})
    group = f"test-results-eo-{unique}"
    slow = f"slow-{unique}"
    # Finished documents on the same description partition as an open one (so the commit point stays below them and
    # a restart reads them again) and on the others.
    home = _partition(slow, topic_names.topics.partitions)
    names = (f"done{i}-{unique}" for i in range(1000))
    pinned = [n for n in names if _partition(n, topic_names.topics.partitions) == home][:3]
    free = [n for n in (f"free{i}-{unique}" for i in range(1000))
            if _partition(n, topic_names.topics.partitions) != home][:3]
    publish(settings, [description(slow, 0, 2)] + [description(d, i, 2) for d in pinned + free for i in range(2)])

    made = results_module.make_producer

    def producer_killed_in_commit(*args, **kwargs):
        producer = made(*args, **kwargs)

        def killed():
            producer.flush()  # the results and the offsets are on the broker, inside the open transaction
            raise _Killed()

        producer.commit_transaction = killed
        return producer

    monkeypatch.setattr(results_module, "make_producer", producer_killed_in_commit)
    first = ResultsAggregator(settings, group_id=group, commit_interval_s=0.3)
    with pytest.raises(_Killed):
        first.run(threading.Event(), max_seconds=60)
    monkeypatch.setattr(results_module, "make_producer", made)
    # The killed transaction's results are in the log, and no read_committed reader sees them.
    assert len(read_topic(settings, settings.topics.results, expected=3, timeout_s=10, idle_s=0.5)) >= 3
    assert read_topic(settings, settings.topics.results, timeout_s=3, idle_s=1.0, read_committed=True) == []

    # The next owner (same group, so the same transactional id) fences the killed one, aborting its transaction at
    # once (read_committed readers would otherwise wait out the transaction timeout, 60 s), and rebuilds from the
    # committed offsets. The pinned documents' results wait for the open document below them.
    second = run_aggregator(settings, group)
    assert second.transactional_id == first.transactional_id and second.stats.terms == 1
    got = {r.doc_id for r in (DocumentResult.decode(x.value) for x in read_topic(
        settings, settings.topics.results, expected=3, timeout_s=20, idle_s=1.0, read_committed=True))}
    assert got == set(free)

    # A restart rebuilds the open document and the pinned ones; once it completes, all go out, each once.
    publish(settings, [description(slow, 1, 2)])
    run_aggregator(settings, group)
    records = read_topic(settings, settings.topics.results, expected=7, timeout_s=20, idle_s=1.5,
                         read_committed=True)
    seen = [DocumentResult.decode(r.value) for r in records]
    assert sorted(r.doc_id for r in seen) == sorted([slow, *pinned, *free])
    assert all((r.image_count, r.succeeded, r.failed) == (2, 2, 0) for r in seen)
