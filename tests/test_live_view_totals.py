"""The live view (`vlmstream run`'s stage lines, `vlmstream status --follow`) keeps each stage's total at the images
the documents name while decode is between publishing a document's images and committing past it (it commits in
batches, after its outputs are durable), and when a group is rewound: done + waiting never exceeds the total, and
nothing is counted twice or below zero. No workers: the images and the commits are written here, as decode and
inference would write them."""

from __future__ import annotations

import re

import pytest
from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from schemas import DocumentRef
from vlmstream.cli.backlog import LiveView, StageProbe, _PartitionImages
from vlmstream.kafka.clients import make_admin, make_producer

IMAGES_PER_DOCUMENT = (1, 6, 2, 3, 4, 5)  # 21 images; documents 0-5 on partition 0 at offsets 0-5


def _commit(settings, group_id: str, offsets: dict[TopicPartition, int]) -> None:
    admin = make_admin(settings)
    try:
        admin.alter_group_offsets(group_id, {tp: OffsetAndMetadata(o, "", -1) for tp, o in offsets.items()})
    finally:
        admin.close()


def _stage_lines(view: LiveView) -> dict[str, tuple[int, int]]:
    """stage -> (done, total) as the view prints them."""
    found = {}
    for line in view.lines():
        if match := re.match(r"(\w+)\s+(\d+)/(\d+) images", line):
            found[match[1]] = (int(match[2]), int(match[3]))
    return found


@pytest.mark.kafka
def test_stage_totals_stay_the_documents_images_while_decode_commits_behind_and_after_a_rewind(topic_names, unique):
    settings = topic_names.model_copy(update={
        "decode": topic_names.decode.model_copy(update={"group_id": f"live-decode-{unique}"}),
        "infer": topic_names.infer.model_copy(update={"group_id": f"live-infer-{unique}"}),
    })
    t = settings.topics
    documents = TopicPartition(t.documents, 0)
    job = sum(IMAGES_PER_DOCUMENT)
    docs = [DocumentRef(doc_id=f"{unique}-{i}", image_uris=tuple(f"/img/{i}-{k}.jpg" for k in range(n)))
            for i, n in enumerate(IMAGES_PER_DOCUMENT)]
    producer = make_producer(settings)
    for doc in docs:
        producer.send(t.documents, key=doc.doc_id.encode(), value=doc.encode(), headers=doc.headers(), partition=0)
    producer.flush()

    def decode_publishes(*indexes: int) -> None:  # one image record per image, as decode sends them
        for i in indexes:
            for k in range(IMAGES_PER_DOCUMENT[i]):
                producer.send(t.images, key=f"{docs[i].doc_id}/{k}".encode(), value=b"pixels", partition=k % 3)
        producer.flush()

    probe = StageProbe(settings)
    view = LiveView(probe)
    try:
        view.update()
        assert view.totals() == (job, job)

        # Decode published the images of documents 0-3 and has committed past documents 0 and 1 only; inference
        # has already described (committed past) images of documents 2 and 3 too: it runs ahead of decode's commits.
        decode_publishes(0, 1, 2, 3)
        _commit(settings, settings.decode.group_id, {documents: 2})
        _commit(settings, settings.infer.group_id, {TopicPartition(t.images, 0): 5, TopicPartition(t.images, 1): 4})
        snap = view.update()
        assert snap.images_waiting == 3  # partition 2's
        assert snap.document_images_waiting == 4 + 5  # documents 4 and 5: decode has not put their images out yet
        assert view.totals() == (job, job)  # were 12 published + 14 waiting: 26 > 21
        assert _stage_lines(view) == {"decode": (1 + 6 + 2 + 3, job), "inference": (9, job)}, view.lines()

        # Decode publishes the rest and commits past documents 0-4: every image is out.
        decode_publishes(4, 5)
        _commit(settings, settings.decode.group_id, {documents: 5})
        view.update()
        assert view.totals() == (job, job)
        assert _stage_lines(view) == {"decode": (job, job), "inference": (9, job)}, view.lines()

        # Decode commits past the last document: its line stays done; inference's total is unchanged.
        _commit(settings, settings.decode.group_id, {documents: 6})
        view.update()
        assert view.totals() == (job, job)
        assert _stage_lines(view)["decode"] == (job, job)
        assert not probe._documents[documents].offsets  # no per-document count kept for what decode is past

        # A replay rewinds inference to the beginning: its done count restarts at 0, its total stays (no images
        # counted twice, none below zero).
        _commit(settings, settings.infer.group_id, {TopicPartition(t.images, p): 0 for p in range(3)})
        view.update()
        assert view.totals() == (job, job)
        assert _stage_lines(view)["inference"] == (0, job), view.lines()
        assert view.infer.rate() is None  # its rate starts again too (no negative rate from the rewind)

        # A replay rewinds decode to the beginning: its documents wait again, counted once.
        _commit(settings, settings.decode.group_id, {documents: 0})
        snap = view.update()
        assert snap.document_images_waiting == job
        assert view.totals()[0] == job
        assert _stage_lines(view)["decode"] == (0, job), view.lines()
        for done, total in _stage_lines(view).values():
            assert 0 <= done <= total
    finally:
        probe.close()
        producer.close()


def test_documents_decode_is_past_are_kept_as_one_sum_and_the_total_stays():
    """A partition at offsets 10-19 (the view starts at 10): three documents read (2, 3, 1 images), the others at
    2 images each until read. Folding what decode committed past keeps done + waiting where it was, also when decode
    is past documents not read yet (they stay at the estimate; reading goes on from there)."""
    part = _PartitionImages(10)
    part.add([(10, 2), (11, 3), (12, 1)], read_to=13)
    assert part.images(10, 20, per_document=2.0) == 6 + 7 * 2
    part.fold(12, 2.0)
    assert (part.images(10, 12, 2.0), part.images(12, 20, 2.0)) == (5, 1 + 7 * 2)
    assert part.offsets == [12]
    part.fold(16, 2.0)  # past 13-15, not read yet
    assert (part.images(10, 16, 2.0), part.images(16, 20, 2.0)) == (12, 8)
    assert (part.offsets, part.read_to) == ([], 16)
    part.add([(16, 5)], read_to=17)
    assert part.images(16, 20, 2.0) == 5 + 3 * 2
