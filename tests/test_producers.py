"""Producers: each source publishes what it should (read back from the real broker), bad lines are
reported with line numbers and dead-lettered, re-runs publish nothing twice, watch mode follows."""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest

from producers.folder import folder_groups, scan_folder, skipped_files_line
from producers.items import IDLE, Rejection, natural_key
from producers.json_document import parse_json_line
from producers.manifest import read_manifest
from producers.publisher import PublishSummary, publish_documents
from producers.stdin import read_lines
from producers.watch import follow_jsonl, watch_folder
from schemas import HEADER_DOC_ID, HEADER_SCHEMA, DeadLetter, DocumentRef, header_value
from tests.kafka_helpers import read_topic
from vlmstream.config import Settings

REPO = Path(__file__).resolve().parents[1]
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".tif", ".tiff", ".bmp"}


@pytest.fixture
def settings(topic_names: Settings, tmp_path: Path) -> Settings:
    """uuid topics and a ledger of this test's own."""
    producer = topic_names.producer.model_copy(update={"state_dir": tmp_path / "state"})
    return topic_names.model_copy(update={"producer": producer})


def documents(settings: Settings, expected: int, idle_s: float = 1.0) -> dict[str, DocumentRef]:
    records = read_topic(settings, settings.topics.documents, expected=expected, idle_s=idle_s)
    assert len(records) == expected, [r.key for r in records]
    out = {}
    for record in records:
        doc = DocumentRef.decode(record.value)
        assert record.key == doc.doc_id.encode()
        assert header_value(record.headers, HEADER_SCHEMA) == b"document/1"
        assert header_value(record.headers, HEADER_DOC_ID) == doc.doc_id.encode()
        assert doc.published_at and doc.published_at > 0
        out[doc.doc_id] = doc
    return out


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# --- pure parsing -------------------------------------------------------------------------------


def test_natural_order_and_uri_resolution(tmp_path: Path) -> None:
    assert sorted(["p10.jpg", "p2.jpg", "P1.jpg"], key=natural_key) == ["P1.jpg", "p2.jpg", "p10.jpg"]
    doc = parse_json_line(b'{"doc_id": "d", "images": ["a.jpg", "/abs/b.png", "https://h/c.jpg", "s3://b/k"]}',
                          line=1, origin="m", base_dir=tmp_path)
    assert isinstance(doc, DocumentRef)
    assert doc.image_uris == (str(tmp_path / "a.jpg"), "/abs/b.png", "https://h/c.jpg", "s3://b/k")


def test_bad_lines_become_rejections_naming_the_problem(tmp_path: Path) -> None:
    cases = {
        b"{not json": "invalid_json",
        b"[1, 2]": "not_an_object",
        b'{"image_uris": ["a.jpg"]}': "missing_doc_id",
        b'{"doc_id": "x", "image_uris": []}': "empty_image_list",
        b'{"doc_id": "x"}': "empty_image_list",
        b'{"doc_id": "x", "image_uris": [3]}': "schema_violation",
        b'{"doc_id": "' + b"y" * 600 + b'", "image_uris": ["a"]}': "schema_violation",
    }
    for raw, reason in cases.items():
        result = parse_json_line(raw, line=7, origin="m.jsonl", base_dir=tmp_path)
        assert isinstance(result, Rejection), raw
        assert (result.reason, result.line, result.raw) == (reason, 7, raw)
    too_long = parse_json_line(b'{"doc_id": "' + b"y" * 600 + b'", "image_uris": ["a"]}', line=1, origin="m",
                               base_dir=tmp_path)
    assert "doc_id" in too_long.detail  # the schema error names the field


def test_manifests_as_other_tools_write_them(tmp_path: Path) -> None:
    """What spreadsheets, editors and databases produce: a byte-order mark, tabs or semicolons, upper-case
    headers, a Latin-1 row among UTF-8 ones, a .json list, numeric ids, one image without a list."""
    def docs(name: str, data: bytes) -> list:
        (tmp_path / name).write_bytes(data)
        return list(read_manifest(tmp_path / name))

    bom_lines = docs("m.jsonl", b'\xef\xbb\xbf{"doc_id": "a", "image_uris": ["x.jpg"]}\r\n\r\n'
                                b'{"doc_id": 17, "image_uris": "y.jpg"}\n')
    assert [(d.doc_id, d.image_uris) for d in bom_lines] == [("a", (str(tmp_path / "x.jpg"),)),
                                                             ("17", (str(tmp_path / "y.jpg"),))]
    for name, text in (("tabs.tsv", "doc_id\timage_uri\tpage\na\tx.jpg\t3\n"),
                       ("semicolons.csv", "Doc_ID;Image_URI;page\na;x.jpg;3\n"),
                       ("pipes.csv", "DOC_ID|IMAGE_URI|page\na|x.jpg|3\n")):
        (doc,) = docs(name, text.encode())
        assert (doc.doc_id, doc.image_uris, doc.metadata) == ("a", (str(tmp_path / "x.jpg"),), {"page": "3"}), name
    latin1 = docs("latin1.csv", "doc_id,image_uri\na,x.jpg\nd\u00e9j\u00e0,y.jpg\nb,z.jpg\nc,1.jpg\nc,\u00e9t\u00e9.jpg\n"
                  .encode("latin-1"))
    published = [d.doc_id for d in latin1 if isinstance(d, DocumentRef)]
    rejected = {r.line: r for r in latin1 if isinstance(r, Rejection)}
    assert published == ["a", "b"] and sorted(rejected) == [3, 6]  # line 6: the row at fault
    assert rejected[3].reason == "invalid_utf8" and rejected[3].doc_id is None
    assert rejected[3].raw == "d\u00e9j\u00e0,y.jpg".encode("latin-1")  # the row's own bytes in the dead letter
    assert (rejected[6].reason, rejected[6].doc_id) == ("invalid_utf8", "c")  # one bad row rejects its whole document
    listed = docs("m.json", b'[{"doc_id": "a", "image_uris": ["x.jpg"]}, 5, {"doc_id": "b", "images": ["y.jpg"]}]')
    assert [getattr(d, "doc_id", None) for d in listed] == ["a", None, "b"]
    assert (listed[1].reason, listed[1].line) == ("not_an_object", 2)
    (wrapped,) = docs("w.json", b'{"documents": [{"doc_id": "c", "image_uris": ["z.jpg"]}]}')
    assert wrapped.doc_id == "c"
    assert docs("bad.json", b"[{")[0].reason == "invalid_json"
    from producers.stdin import parse_stdin_line

    assert parse_stdin_line(b"\xef\xbb\xbfscan.jpg\r\n", line=1, base_dir=tmp_path).doc_id == "scan.jpg"
    assert parse_json_line(b'{"doc_id": true, "image_uris": ["x"]}', line=1, origin="m",
                           base_dir=tmp_path).reason == "schema_violation"  # a boolean is not an id


def test_folder_groups_subfolders_and_loose_files(tmp_path: Path) -> None:
    for name in ("book/p10.jpg", "book/p2.jpg", "book/notes.txt", "book/sub/p1.png", "loose.webp",
                 "empty/readme.md", ".hidden/x.jpg"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"not checked here")
    groups = folder_groups(tmp_path)
    assert list(groups) == ["book", "loose.webp"]
    assert [p.relative_to(tmp_path).as_posix() for p in groups["book"]] == ["book/p2.jpg", "book/p10.jpg",
                                                                           "book/sub/p1.png"]
    assert sorted(folder_groups(tmp_path, per_file=True)) == ["book/p10.jpg", "book/p2.jpg", "book/sub/p1.png",
                                                              "loose.webp"]


def test_a_folder_scan_says_which_files_it_left_out_for_their_type(tmp_path: Path) -> None:
    """Visible files of a type the decode stage does not read are collected for the caller to name, both ways of
    grouping, in subfolders and loose; hidden ones are not (they are skipped on purpose)."""
    for name in ("book/p1.jpg", "book/notes.txt", "drawing.svg", "loose.png", "empty/readme.md", ".hidden/x.pdf",
                 ".DS_Store"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"not checked here")
    for per_file in (False, True):
        skipped: list[Path] = []
        docs = list(scan_folder(tmp_path, per_file=per_file, skipped=skipped))
        assert len(docs) == 2
        assert sorted(p.relative_to(tmp_path).as_posix() for p in skipped) == [
            "book/notes.txt", "drawing.svg", "empty/readme.md"]
        assert skipped_files_line(skipped, tmp_path, shown=2) == (
            "3 files left out, not of an image type vlmstream reads (by name): book/notes.txt, drawing.svg and 1 more")


def test_folder_sources_pick_every_format_the_decode_stage_reads(tmp_path: Path) -> None:
    for name in ("scan.jp2", "phone.HEIC", "page.pgm", "photo.avif", "notes.txt", "data.pdf"):
        (tmp_path / name).write_bytes(b"not checked here")
    assert sorted(folder_groups(tmp_path, per_file=True)) == ["data.pdf", "page.pgm", "phone.HEIC", "photo.avif",
                                                              "scan.jp2"]


def test_a_multi_page_tiff_in_a_folder_is_one_image_per_page(tmp_path: Path) -> None:
    from PIL import Image

    from producers.folder import scan_folder

    book = tmp_path / "book"
    book.mkdir()
    pages = [Image.new("L", (64, 64), shade) for shade in (10, 120, 240)]
    pages[0].save(book / "fax.tiff", save_all=True, append_images=pages[1:])
    Image.new("L", (64, 64), 7).save(book / "single.tif")
    (book / "cover.png").write_bytes(b"not checked here")
    (book / "broken.tif").write_bytes(b"II*\x00 not a tiff")
    [doc] = list(scan_folder(tmp_path))
    assert doc.image_uris == (str(book / "broken.tif"), str(book / "cover.png"), *(f"{book / 'fax.tiff'}#page={n}"
                              for n in (1, 2, 3)), str(book / "single.tif"))


# --- sources on the real broker -----------------------------------------------------------------


@pytest.mark.kafka
def test_jsonl_manifest_publishes_each_document_with_bounded_in_flight(settings: Settings, tmp_path: Path) -> None:
    settings = settings.model_copy(update={"producer": settings.producer.model_copy(
        update={"max_in_flight_documents": 3})})
    lines = [orjson.dumps({"doc_id": f"doc-{i}", "image_uris": [f"img/{i}-a.jpg", f"img/{i}-b.png"],
                           "metadata": {"n": i}}).decode() for i in range(40)]
    lines.append('{"doc_id": "alias", "images": ["https://example.org/x.jpg"], "lang": "de"}')
    manifest = write_lines(tmp_path / "m.jsonl", lines)

    summary = publish_documents(settings, read_manifest(manifest))

    assert (summary.sent, summary.skipped, summary.rejected, summary.failed) == (41, 0, [], [])
    docs = documents(settings, 41)
    assert docs["doc-7"].image_uris == (str(tmp_path / "img/7-a.jpg"), str(tmp_path / "img/7-b.png"))
    assert docs["doc-7"].metadata == {"n": 7}
    assert docs["doc-7"].source == f"{manifest}:8"
    assert docs["alias"].image_uris == ("https://example.org/x.jpg",)
    assert docs["alias"].metadata == {"lang": "de"}


@pytest.mark.kafka
def test_csv_manifest_groups_rows_of_a_document(settings: Settings, tmp_path: Path) -> None:
    manifest = tmp_path / "m.csv"
    manifest.write_text("doc_id,image_uri,image_uris,lang\n"
                        "a,a1.jpg,,en\n"
                        "a,a2.jpg,,en\n"
                        'b,,"[""b1.png"", ""https://h/b2.jpg""]",fr\n'
                        "c,,c1.jpg;c2.jpg;c3.jpg,\n")

    summary = publish_documents(settings, read_manifest(manifest))

    assert (summary.sent, summary.rejected) == (3, [])
    docs = documents(settings, 3)
    assert docs["a"].image_uris == (str(tmp_path / "a1.jpg"), str(tmp_path / "a2.jpg"))
    assert docs["a"].metadata == {"lang": "en"}
    assert docs["b"].image_uris == (str(tmp_path / "b1.png"), "https://h/b2.jpg")
    assert docs["c"].image_uris == tuple(str(tmp_path / f"c{i}.jpg") for i in (1, 2, 3))
    assert docs["c"].metadata == {}


@pytest.mark.kafka
def test_folder_source_one_document_per_subfolder_or_per_file(settings: Settings, corpus_dir: Path) -> None:
    # Expected from the file system directly, not from the code under test.
    per_folder: dict[str, list[str]] = {}
    all_images = []
    for dirpath, _, files in os.walk(corpus_dir):
        for f in files:
            if Path(f).suffix.lower() in IMAGE_SUFFIXES:
                path = Path(dirpath, f)
                all_images.append(path)
                rel = path.relative_to(corpus_dir)
                per_folder.setdefault(rel.parts[0] if len(rel.parts) > 1 else rel.as_posix(), []).append(str(path))
    assert all_images, "the corpus has no images"

    summary = publish_documents(settings, scan_folder(corpus_dir))
    assert summary.sent == len(per_folder)
    docs = documents(settings, len(per_folder))
    assert {k: sorted(v.image_uris) for k, v in docs.items()} == {k: sorted(v) for k, v in per_folder.items()}

    summary = publish_documents(settings, scan_folder(corpus_dir, per_file=True))
    # Loose top-level files have the same id in both modes and are skipped the second time.
    loose = sum(1 for p in all_images if p.parent == corpus_dir)
    assert (summary.sent, summary.skipped) == (len(all_images) - loose, loose)
    docs = documents(settings, len(per_folder) + len(all_images) - loose)
    some = all_images[0].relative_to(corpus_dir).as_posix()
    assert docs[some].image_uris == (str(all_images[0]),)


@pytest.mark.kafka
def test_stdin_lines_bare_paths_and_json_objects(settings: Settings, tmp_path: Path) -> None:
    stream = io.BytesIO(b"scan/one.jpg\n"
                        b"/abs/two.png\n"
                        b"\n"
                        b'{"doc_id": "three", "image_uris": ["3a.jpg", "3b.jpg"]}\n'
                        b'{"doc_id": "broken", \n'
                        b"https://example.org/four.webp\n")

    summary = publish_documents(settings, read_lines(stream, base_dir=tmp_path))

    assert summary.sent == 4
    assert [(r.line, r.reason) for r in summary.rejected] == [(5, "invalid_json")]
    docs = documents(settings, 4)
    assert docs["scan/one.jpg"].image_uris == (str(tmp_path / "scan/one.jpg"),)
    assert docs["/abs/two.png"].image_uris == ("/abs/two.png",)
    assert docs["three"].image_uris == (str(tmp_path / "3a.jpg"), str(tmp_path / "3b.jpg"))
    assert docs["https://example.org/four.webp"].image_uris == ("https://example.org/four.webp",)


@pytest.mark.kafka
def test_bad_lines_reported_with_line_numbers_and_dead_lettered(settings: Settings, tmp_path: Path) -> None:
    manifest = write_lines(tmp_path / "m.jsonl", [
        '{"doc_id": "good-1", "image_uris": ["a.jpg"]}',
        "this is not json",
        '{"image_uris": ["b.jpg"]}',
        '{"doc_id": "empty", "image_uris": []}',
        '{"doc_id": "bad-type", "image_uris": {"c.jpg": 1}}',
        '{"doc_id": "good-2", "images": ["d.jpg"]}',
    ])

    summary = publish_documents(settings, read_manifest(manifest))

    assert summary.sent == 2
    assert [(r.line, r.reason) for r in summary.rejected] == [
        (2, "invalid_json"), (3, "missing_doc_id"), (4, "empty_image_list"), (5, "schema_violation")]
    assert "image_uris" in summary.rejected[3].detail
    assert "line 2" in summary.render() or f"{manifest}:2" in summary.render()
    letters = [DeadLetter.decode(r.value) for r in read_topic(settings, settings.topics.deadletter, expected=4,
                                                              idle_s=1.0)]
    assert len(letters) == 4
    by_line = {int(dl.detail.split(" line ")[1].split(":")[0]): dl for dl in letters}
    assert sorted(by_line) == [2, 3, 4, 5]
    raw_lines = manifest.read_text().splitlines()
    for line, letter in by_line.items():
        assert (letter.stage, letter.error_kind) == ("produce", "invalid_manifest_line")
        assert str(manifest) in letter.detail
        assert base64.b64decode(letter.original_value_b64).decode() == raw_lines[line - 1]
    assert by_line[4].doc_id == "empty" and by_line[2].doc_id is None
    assert set(documents(settings, 2)) == {"good-1", "good-2"}


@pytest.mark.kafka
def test_rejections_whose_own_id_or_name_no_record_can_hold_are_still_dead_lettered(settings: Settings,
                                                                                     tmp_path: Path) -> None:
    """A doc id over 512 characters and a file name that is not UTF-8 are rejected; their dead letters must still
    be writable, or the producer stops on them."""
    folder = tmp_path / "f"
    folder.mkdir()
    Path(os.fsdecode(bytes(folder) + b"/sc\xe9n.jpg")).write_bytes(b"x")
    manifest = write_lines(tmp_path / "m.jsonl", ['{"doc_id": "%s", "images": ["a.jpg"]}' % ("x" * 600),
                                                  '{"doc_id": "fine", "images": ["a.jpg"]}'])
    long_id = publish_documents(settings, read_manifest(manifest))
    latin1 = publish_documents(settings, scan_folder(folder))
    assert (long_id.sent, len(long_id.rejected), latin1.sent, len(latin1.rejected)) == (1, 1, 0, 1)
    letters = [DeadLetter.decode(r.value) for r in read_topic(settings, settings.topics.deadletter, expected=2,
                                                              idle_s=1.0)]
    assert sorted(dl.doc_id is None for dl in letters) == [True, True]
    assert any("x" * 100 in dl.detail for dl in letters) and any("sc\ufffdn.jpg" in dl.detail for dl in letters)


@pytest.mark.kafka
def test_rerun_skips_force_republishes_and_changes_go_out(settings: Settings, tmp_path: Path) -> None:
    lines = [orjson.dumps({"doc_id": f"d{i}", "image_uris": [f"{i}.jpg"]}).decode() for i in range(5)]
    manifest = write_lines(tmp_path / "m.jsonl", lines + ["oops"])

    first = publish_documents(settings, read_manifest(manifest))
    assert (first.sent, first.dead_lettered) == (5, 1)

    again = publish_documents(settings, read_manifest(manifest))
    assert (again.sent, again.skipped, again.dead_lettered) == (0, 5, 0)
    assert [r.line for r in again.rejected] == [6]  # still reported, not dead-lettered twice
    documents(settings, 5, idle_s=2.0)  # exactly 5: nothing new arrived
    assert len(read_topic(settings, settings.topics.deadletter, expected=1, idle_s=1.0)) == 1

    # A changed document (new image list) goes out again; a moved line with the same content does not.
    lines[2] = orjson.dumps({"doc_id": "d2", "image_uris": ["2.jpg", "2b.jpg"]}).decode()
    changed = publish_documents(settings, read_manifest(write_lines(manifest, ["", *lines])))
    assert (changed.sent, changed.skipped) == (1, 4)
    docs = read_topic(settings, settings.topics.documents, expected=6, idle_s=2.0)
    assert len(docs) == 6
    versions = sorted(DocumentRef.decode(r.value).image_uris for r in docs if r.key == b"d2")
    assert versions == [(str(tmp_path / "2.jpg"),), (str(tmp_path / "2.jpg"), str(tmp_path / "2b.jpg"))]

    forced = publish_documents(settings, read_manifest(manifest), force=True)
    assert (forced.sent, forced.skipped) == (5, 0)
    documents_after = read_topic(settings, settings.topics.documents, expected=11, idle_s=1.0)
    assert len(documents_after) == 11


@pytest.mark.kafka
def test_duplicate_doc_in_one_run_goes_out_once(settings: Settings, tmp_path: Path) -> None:
    line = '{"doc_id": "same", "image_uris": ["s.jpg"]}'
    summary = publish_documents(settings, read_manifest(write_lines(tmp_path / "m.jsonl", [line, line, line])))
    assert (summary.sent, summary.skipped) == (1, 2)
    documents(settings, 1, idle_s=1.5)


# --- watch mode ---------------------------------------------------------------------------------


def _run_in_thread(target) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["summary"] = target()
        except BaseException as exc:  # noqa: BLE001 - surfaced by the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _wait_for_documents(settings: Settings, count: int, timeout_s: float = 30.0) -> dict[str, DocumentRef]:
    deadline = time.monotonic() + timeout_s
    records = []
    while time.monotonic() < deadline:
        records = read_topic(settings, settings.topics.documents, timeout_s=3.0, idle_s=0.5)
        if len(records) >= count:
            break
    return {DocumentRef.decode(r.value).doc_id: DocumentRef.decode(r.value) for r in records}


@pytest.mark.kafka
def test_watch_folder_publishes_a_new_subfolder_once_it_settles(settings: Settings, tmp_path: Path) -> None:
    root = tmp_path / "inbox"
    (root / "old").mkdir(parents=True)
    (root / "old" / "p1.jpg").write_bytes(b"x")
    old = time.time() - 60
    os.utime(root / "old" / "p1.jpg", (old, old))
    stop = threading.Event()
    thread, box = _run_in_thread(lambda: publish_documents(
        settings, watch_folder(root, settle_s=0.5, poll_s=0.1, stop=stop, max_seconds=60), stop=stop))
    try:
        assert set(_wait_for_documents(settings, 1)) == {"old"}
        (root / "new").mkdir()
        (root / "new" / "p2.jpg").write_bytes(b"x")
        (root / "new" / "p10.jpg").write_bytes(b"x")
        docs = _wait_for_documents(settings, 2)
        assert set(docs) == {"old", "new"}
        assert docs["new"].image_uris == (str(root / "new" / "p2.jpg"), str(root / "new" / "p10.jpg"))
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive() and "error" not in box, box
    summary: PublishSummary = box["summary"]
    assert summary.sent == 2


@pytest.mark.kafka
def test_watch_manifest_publishes_complete_new_lines(settings: Settings, tmp_path: Path) -> None:
    manifest = write_lines(tmp_path / "m.jsonl", ['{"doc_id": "first", "image_uris": ["1.jpg"]}'])
    stop = threading.Event()
    thread, box = _run_in_thread(lambda: publish_documents(
        settings, follow_jsonl(manifest, poll_s=0.1, stop=stop, max_seconds=60), stop=stop))
    try:
        assert set(_wait_for_documents(settings, 1)) == {"first"}
        with open(manifest, "a") as fh:
            fh.write('{"doc_id": "second", "image_uris"')  # half a line: must wait for its newline
            fh.flush()
            time.sleep(0.5)
            fh.write(': ["2.jpg"]}\nnot json\n')
        docs = _wait_for_documents(settings, 2)
        assert set(docs) == {"first", "second"}
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive() and "error" not in box, box
    summary: PublishSummary = box["summary"]
    assert summary.sent == 2
    assert [(r.line, r.reason) for r in summary.rejected] == [(3, "invalid_json")]


@pytest.mark.flaky(reruns=2)  # timing of a pipe reader thread on a loaded 2-core machine; a real loss fails all three tries
@pytest.mark.kafka
def test_stdin_stream_publishes_lines_before_eof(settings: Settings, tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    reader, writer = open(read_fd, "rb"), open(write_fd, "wb")
    thread, box = _run_in_thread(lambda: publish_documents(settings, read_lines(reader, base_dir=tmp_path)))
    try:
        writer.write(b"first.jpg\n")
        writer.flush()
        # The pipe stays open: the document must go out (and be acknowledged) without waiting for EOF.
        assert set(_wait_for_documents(settings, 1)) == {"first.jpg"}
        writer.write(b"second.jpg\n")
    finally:
        writer.close()
        thread.join(timeout=60)
        reader.close()
    assert not thread.is_alive(), "the publisher did not finish after EOF"
    assert "error" not in box, box
    assert box["summary"].sent == 2, box["summary"].render()


def test_watch_sources_stop_on_deadline(tmp_path: Path) -> None:
    started = time.monotonic()
    items = list(watch_folder(tmp_path, poll_s=0.05, max_seconds=0.3))
    assert 0.25 <= time.monotonic() - started < 5
    assert items and all(item is IDLE for item in items)


# --- command line -------------------------------------------------------------------------------


@pytest.mark.kafka
def test_cli_produce_manifest_end_to_end(settings: Settings, tmp_path: Path) -> None:
    manifest = write_lines(tmp_path / "m.jsonl", ['{"doc_id": "cli-1", "image_uris": ["a.jpg"]}',
                                                  '{"doc_id": "cli-2", "image_uris": ["b.jpg"]}',
                                                  '{"doc_id": 5}'])
    t = settings.topics
    env = {**os.environ, "VLMSTREAM_BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
           "VLMSTREAM_PRODUCER__STATE_DIR": str(tmp_path / "cli-state"), "VLMSTREAM_TOPICS__PARTITIONS": "3",
           **{f"VLMSTREAM_TOPICS__{name.upper()}": getattr(t, name) for name in
              ("documents", "images", "descriptions", "embeddings", "results", "deadletter")}}
    cli = [str(REPO / ".venv" / "bin" / "vlmstream")] if (REPO / ".venv/bin/vlmstream").exists() else [
        sys.executable, "-m", "vlmstream.cli"]

    run = subprocess.run([*cli, "produce", "--manifest", str(manifest)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    report = orjson.loads(run.stdout.strip().splitlines()[-1])
    assert (report["sent"], report["rejected"]) == (2, 1)
    assert report["rejections"][0]["line"] == 3
    assert "m.jsonl:3" in run.stderr
    assert set(documents(settings, 2)) == {"cli-1", "cli-2"}

    rerun = subprocess.run([*cli, "produce", "--manifest", str(manifest), "--quiet"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert orjson.loads(rerun.stdout.strip().splitlines()[-1])["skipped"] == 2

    usage = subprocess.run([*cli, "produce"], env=env, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2


@pytest.mark.kafka
def test_two_folders_with_the_same_file_names_are_reported_and_kept_apart_by_an_id_prefix(settings: Settings,
                                                                                        corpus_dir: Path,
                                                                                        tmp_path: Path) -> None:
    """A folder's ids are relative paths, so a second folder of the same names replaces the first one's documents:
    the publisher says which ids it sent over other content (``replaced_ids``: `vlmstream run` warns with them).
    ``with_id_prefix`` gives the second folder ids of its own; a prefix the schema refuses is a rejection."""
    from producers.items import with_id_prefix

    source = next(p for p in sorted(corpus_dir.rglob("*")) if p.suffix.lower() in (".jpg", ".png"))
    folders = []
    for name in ("2024", "2025"):
        folder = tmp_path / name
        folder.mkdir()
        for copy in ("IMG_0001" + source.suffix, "IMG_0002" + source.suffix):
            shutil.copyfile(source, folder / copy)
        folders.append(folder)
    first = publish_documents(settings, scan_folder(folders[0]), track_sent=True)
    assert first.sent == 2 and first.replaced_ids == set()
    second = publish_documents(settings, scan_folder(folders[1]), track_sent=True)
    ids = {"IMG_0001" + source.suffix, "IMG_0002" + source.suffix}
    assert second.sent_ids == ids and second.replaced_ids == ids
    prefixed = publish_documents(settings, with_id_prefix(scan_folder(folders[0]), "2024/"), track_sent=True)
    assert prefixed.sent_ids == {"2024/" + i for i in ids} and prefixed.replaced_ids == set()
    docs = documents(settings, 6)
    assert docs["2024/IMG_0001" + source.suffix].image_uris == (str(folders[0] / ("IMG_0001" + source.suffix)),)
    too_long = list(with_id_prefix(scan_folder(folders[0]), "x" * 600))
    assert all(isinstance(r, Rejection) and r.reason == "schema_violation" and "--id-prefix" in r.detail
               for r in too_long)
