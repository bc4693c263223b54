"""What a newcomer meets first: the refused-path dead letter names the setting to change, and `vlmstream run`
says what earlier runs left queued ahead of its documents."""

from __future__ import annotations

import re

import pytest

from vlmstream.images.fetch import Fetcher
from vlmstream.config import load_settings
from vlmstream.images.errors import ImageError


def test_a_refused_path_names_the_setting_the_path_and_the_roots_in_force(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "elsewhere" / "photo.jpg"
    outside.parent.mkdir()
    outside.write_bytes(b"\xff\xd8\xff")
    with pytest.raises(ImageError) as info:
        Fetcher(allowed_roots=[str(root)]).fetch(str(outside))
    assert info.value.error_kind == "fetch_forbidden_path"
    detail = str(info.value)
    assert str(outside) in detail and str(root) in detail
    assert "decode.allowed_roots" in detail and "VLMSTREAM_DECODE__ALLOWED_ROOTS" in detail

    # The default root (the current directory) is the one shown when none is set.
    monkeypatch.chdir(root)
    with pytest.raises(ImageError) as info:
        Fetcher().fetch(str(outside))
    assert f"({root.resolve()})" in str(info.value)

    # What the message tells the user to set works as written.
    value = re.search(r"VLMSTREAM_DECODE__ALLOWED_ROOTS='([^']*)'", detail).group(1)
    monkeypatch.setenv("VLMSTREAM_DECODE__ALLOWED_ROOTS", value)
    assert load_settings().decode.allowed_roots == ["/data/images"]


@pytest.mark.kafka
def test_run_counts_what_earlier_runs_left_queued_ahead(topic_names, unique, tmp_path):
    from kafka.structs import OffsetAndMetadata

    from schemas import DocumentRef
    from vlmstream.cli.backlog import RememberedRate, StageProbe, measure_backlog
    from vlmstream.kafka.clients import make_admin, make_producer

    settings = topic_names.model_copy(update={
        "decode": topic_names.decode.model_copy(update={"group_id": f"backlog-decode-{unique}"}),
        "infer": topic_names.infer.model_copy(update={"group_id": f"backlog-infer-{unique}"}),
    })
    t = settings.topics
    assert measure_backlog(settings).notice(None) is None  # nothing queued: nothing said

    producer = make_producer(settings)
    for i in range(7):  # decoded images nobody described (the payload does not matter to the count)
        producer.send(t.images, key=f"old-{i}/0".encode(), value=b"pixels", partition=i % 3)
    for i, uris in enumerate((["/a.jpg", "/b.jpg"], ["/c.png"])):  # documents nobody decoded: 3 images
        doc = DocumentRef(doc_id=f"old-doc-{i}", image_uris=uris)
        producer.send(t.documents, key=doc.doc_id.encode(), value=doc.encode(), partition=i)
    producer.flush()
    producer.close()

    backlog = measure_backlog(settings)
    assert (backlog.images, backlog.documents, backlog.document_images, backlog.images_counted) == (7, 2, 3, True)
    assert backlog.images_ahead == 10
    notice = backlog.notice(None)
    assert notice.startswith("10 images from earlier runs are queued ahead of yours (how long: the progress lines say")
    assert settings.infer.group_id in notice and settings.decode.group_id in notice
    timed = backlog.notice(RememberedRate(images_per_s=2.0, max_pixels=401_408, model="/x/tiny-qwen2.5-vl"))
    assert "about 5 s at 2.00 img/s" in timed

    # The inference group commits past partition 0's images (3 of the 7): they are no longer ahead.
    probe = StageProbe(settings, backlog)
    try:
        assert probe.snapshot().earlier_ahead == 7
        admin = make_admin(settings)
        try:
            admin.alter_group_offsets(settings.infer.group_id,
                                      {tp: OffsetAndMetadata(end, "", -1) for tp, end in backlog.ends.items()
                                       if tp.topic == t.images and tp.partition == 0})
        finally:
            admin.close()
        snap = probe.snapshot()
        assert (snap.earlier_ahead, snap.images_waiting, snap.earlier_documents) == (4, 4, 2)
        assert probe.infer_rate() is not None and probe.infer_rate() > 0
    finally:
        probe.close()
    assert measure_backlog(settings).images == 4


def test_the_tiny_model_gets_a_small_budget_unless_one_is_given(monkeypatch):
    from vlmstream.cli.run_setup import TINY_MODEL_MAX_PIXELS, with_pixel_budget
    from vlmstream.models.qwen2_vl import MAX_PIXELS as QWEN_MAX_PIXELS

    settings, said = with_pixel_budget(load_settings())
    assert settings.decode.max_pixels == TINY_MODEL_MAX_PIXELS and "--max-pixels" in said and "0.4 MP" in said
    assert with_pixel_budget(load_settings(overrides={"decode": {"max_pixels": 1003520}}))[0].decode.max_pixels \
        == 1003520  # the flag
    monkeypatch.setenv("VLMSTREAM_DECODE__MAX_PIXELS", "802816")
    assert with_pixel_budget(load_settings())[0].decode.max_pixels == 802816  # the environment (or a file)
    monkeypatch.delenv("VLMSTREAM_DECODE__MAX_PIXELS")
    real = load_settings(overrides={"infer": {"model": "Qwen/Qwen2.5-VL-7B-Instruct"}})
    assert with_pixel_budget(real)[0].decode.max_pixels == QWEN_MAX_PIXELS  # a real model keeps its budget
