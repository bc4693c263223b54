"""Input that other tools and other people produce: every manifest line, CSV row and folder ends as a document or
as a rejection that says why, never as an exception that stops the producer or as a document quietly changed.
Pure parsing (no broker): the publisher's dead-letter path for rejections is tested in test_producers.py."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import orjson
import pytest

from producers.folder import scan_folder
from producers.items import IDLE, Rejection, natural_key, resolve_uri
from producers.manifest import read_manifest
from producers.watch import follow_jsonl, watch_folder
from schemas import DocumentRef, SchemaError


def items(path: Path) -> list[DocumentRef | Rejection]:
    return list(read_manifest(path))


def nested(depth: int) -> object:
    value: object = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def test_metadata_nested_too_deep_is_rejected_by_the_producer_and_by_the_topic_reader(tmp_path: Path) -> None:
    # orjson reads 1,024 levels but writes ~254: such a document must not get onto a topic, nor be taken from one.
    too_deep = b"[" * 300 + b"1" + b"]" * 300
    manifest = tmp_path / "m.jsonl"
    manifest.write_bytes(orjson.dumps({"doc_id": "flat", "images": ["y.jpg"], "metadata": {"k": nested(30)}}) + b"\n"
                         + b'{"doc_id":"deep","images":["x.jpg"],"metadata":{"k":' + too_deep + b"}}\n"
                         + b'{"doc_id":"after","images":["z.jpg"]}\n')
    found = items(manifest)
    assert [type(i).__name__ for i in found] == ["DocumentRef", "Rejection", "DocumentRef"]
    assert found[1].doc_id == "deep" and "nests deeper than 32" in found[1].detail
    as_json_list = tmp_path / "m.json"
    as_json_list.write_bytes(b'[{"doc_id":"deep","images":["x.jpg"],"metadata":{"k":' + too_deep + b"}}]")
    [rejected] = items(as_json_list)
    assert isinstance(rejected, Rejection) and rejected.raw  # its text kept for the dead letter, cut
    with pytest.raises(SchemaError, match="metadata"):
        DocumentRef.decode(b'{"doc_id":"d","image_uris":["x.jpg"],"metadata":{"k":' + too_deep + b"}}")


def test_names_that_are_not_utf8(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    folder.mkdir()
    (Path(os.fsdecode(bytes(folder) + b"/sc\xe9n.jpg"))).write_bytes(b"not read here")
    [rejected] = scan_folder(folder)
    assert isinstance(rejected, Rejection) and "not valid UTF-8" in rejected.detail
    assert rejected.raw == b"sc\xe9n.jpg"
    # A manifest whose own name is not UTF-8 still publishes: only its documents' `source` shows the name.
    manifest = Path(os.fsdecode(bytes(tmp_path) + b"/m\xe9.jsonl"))
    manifest.write_text('{"doc_id": "a", "images": ["x.jpg"]}\n')
    [doc] = items(manifest)
    assert isinstance(doc, DocumentRef) and doc.source.endswith("m\ufffd.jsonl:1")
    header = tmp_path / "h.csv"
    header.write_bytes(b"doc_id,image_uri,r\xe9f\na,x.jpg,1\n")
    [rejected] = items(header)
    assert isinstance(rejected, Rejection) and "not valid UTF-8" in rejected.detail


def test_csv_cells_larger_than_the_csv_modules_default_limit(tmp_path: Path) -> None:
    uris = ";".join(f"/data/scans/{i:06d}.jpg" for i in range(9000))  # ~200 KB in one cell
    manifest = tmp_path / "big.csv"
    manifest.write_text(f"doc_id,image_uris\nbig,{uris}\nnext,y.jpg\n")
    big, after = items(manifest)
    assert isinstance(big, DocumentRef) and len(big.image_uris) == 9000
    assert isinstance(after, DocumentRef) and after.doc_id == "next"


def test_csv_rows_that_lost_their_shape_reject_their_document(tmp_path: Path) -> None:
    extra = tmp_path / "extra.csv"
    extra.write_text("doc_id,image_uri\na,data:image/png;base64,AAAA\nb,ok.jpg\n")  # the comma split the cell
    rejected, kept = items(extra)
    assert isinstance(rejected, Rejection) and rejected.doc_id == "a" and "3 cells" in rejected.detail
    assert isinstance(kept, DocumentRef) and kept.doc_id == "b"

    twice = tmp_path / "twice.csv"
    twice.write_text("doc_id,image_uri,image_uri\na,x.jpg,y.jpg\n")
    [rejected] = items(twice)
    assert rejected.reason == "invalid_csv_header" and "image_uri" in rejected.detail

    unclosed = tmp_path / "unclosed.csv"
    unclosed.write_text('doc_id,image_uri\nz,first.jpg\na,"x.jpg\nb,y.jpg\nc,z.jpg\n')
    found = items(unclosed)
    assert all(isinstance(i, Rejection) and i.reason == "invalid_csv_row" for i in found), found
    assert [i.doc_id for i in found] == ["z", None]  # the document it may belong to, then the unread rest
    assert "line 3" in found[1].detail and "not read past it" in found[1].detail
    header = tmp_path / "header.csv"
    header.write_text('doc_id,"image_uri\na,x.jpg\n')
    [rejected] = items(header)
    assert rejected.reason == "invalid_csv_header" and "cannot be read" in rejected.detail


def test_a_uri_with_a_control_character_is_rejected_by_name(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"doc_id": "a", "images": ["x\\n.jpg"]}\n{"doc_id": "b", "images": ["tab\\there.jpg"]}\n')
    found = items(manifest)
    assert all(isinstance(i, Rejection) and "control character" in i.detail for i in found)
    with pytest.raises(SchemaError, match="control character"):
        DocumentRef.decode(b'{"doc_id":"d","image_uris":["a\\u0000b.jpg"]}')


def test_natural_order_with_digits_int_cannot_read() -> None:
    assert natural_key("²") == ("²",)  # a digit to str.isdigit, not a number to int()
    assert sorted(["p10", "²", "p2"], key=natural_key) == ["p2", "p10", "²"]


def test_uris_with_any_scheme_pass_through_and_spaces_around_them_go() -> None:
    for uri in ("data:image/png;base64,AAAA", "urn:isbn:1", "javascript:alert(1)", "s3://b/k.jpg", "file:x.jpg"):
        assert resolve_uri(uri, "/base") == uri  # the decode stage fetches or dead-letters it by scheme
    assert resolve_uri(" https://h/c.jpg\t", "/base") == "https://h/c.jpg"
    assert resolve_uri("C:\\scans\\x.jpg", "/base") == "/base/C:\\scans\\x.jpg"  # a drive letter is no scheme
    assert resolve_uri("pages/p1.jpg", "/base") == "/base/pages/p1.jpg"


def test_gzipped_manifests_are_read_and_utf16_ones_rejected_whole(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'{"doc_id": "a", "images": ["x.jpg"]}\n'))
    (tmp_path / "b.csv.gz").write_bytes(gzip.compress(b"doc_id,image_uri\nb,y.jpg\nb,z.jpg\n"))
    (tmp_path / "c.json.gz").write_bytes(gzip.compress(b'[{"doc_id": "c", "images": ["w.jpg"]}]'))
    for name, doc_id, images in (("a.jsonl.gz", "a", 1), ("b.csv.gz", "b", 2), ("c.json.gz", "c", 1)):
        [doc] = items(tmp_path / name)
        assert isinstance(doc, DocumentRef) and doc.doc_id == doc_id and len(doc.image_uris) == images
        assert doc.image_uris[0].startswith(str(tmp_path))
    (tmp_path / "u.jsonl").write_bytes('{"doc_id": "a", "images": ["x.jpg"]}\n'.encode("utf-16"))
    [rejected] = items(tmp_path / "u.jsonl")
    assert rejected.reason == "unsupported_encoding" and "UTF-16" in rejected.detail
    with pytest.raises(ValueError, match="gzip"):
        next(follow_jsonl(tmp_path / "a.jsonl.gz", max_seconds=0.1))


def test_watch_publishes_a_document_whose_link_points_nowhere(tmp_path: Path) -> None:
    book = tmp_path / "book"
    book.mkdir()
    (book / "p1.jpg").write_bytes(b"x")
    (book / "p2.jpg").symlink_to(tmp_path / "gone.jpg")
    old = 1_000_000_000
    os.utime(book / "p1.jpg", (old, old))
    os.utime(book / "p2.jpg", (old, old), follow_symlinks=False)
    found = [i for i in watch_folder(tmp_path, settle_s=0.1, poll_s=0.05, max_seconds=0.5) if i is not IDLE]
    assert [(d.doc_id, len(d.image_uris)) for d in found] == [("book", 2)]  # decode dead-letters p2 as missing


def test_a_folder_that_cannot_be_listed_rejects_its_document(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "book" / "sub").mkdir(parents=True)
    (tmp_path / "book" / "p1.jpg").write_bytes(b"x")
    (tmp_path / "book" / "sub" / "p2.jpg").write_bytes(b"x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "q.jpg").write_bytes(b"x")
    real_scandir = os.scandir

    def scandir(path=".", *args, **kwargs):  # these tests run as root, whom chmod 000 does not stop
        if Path(path) == tmp_path / "book" / "sub":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path, *args, **kwargs)

    monkeypatch.setattr(os, "scandir", scandir)
    book, other = scan_folder(tmp_path)
    assert isinstance(book, Rejection) and book.doc_id == "book" and book.reason == "unreadable_folder"
    assert "Permission denied" in book.detail and "sub" in book.detail
    assert isinstance(other, DocumentRef) and other.doc_id == "other"
    per_file = list(scan_folder(tmp_path, per_file=True))
    assert sorted(getattr(i, "doc_id") for i in per_file) == ["book/p1.jpg", "book/sub/", "other/q.jpg"]
    assert [i.reason for i in per_file if isinstance(i, Rejection)] == ["unreadable_folder"]
    watched = [i for i in watch_folder(tmp_path, settle_s=0.0, poll_s=0.05, max_seconds=0.3) if i is not IDLE]
    assert [i.doc_id for i in watched if isinstance(i, Rejection)] == ["book"]  # once, not every poll


def test_integers_beyond_64_bits_are_refused_not_turned_into_floats(tmp_path: Path) -> None:
    """orjson reads 123456789012345678901234 as 1.2345678901234569e+23: an id in the metadata changed silently."""
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"doc_id": "a", "images": ["x.jpg"], "metadata": {"isbn13": 123456789012345678901234}}\n'
                        '{"doc_id": "b", "images": ["x.jpg"], "metadata": {"max": 18446744073709551615, '
                        '"text": "12345678901234567890123"}}\n')
    rejected, kept = items(manifest)
    assert isinstance(rejected, Rejection) and "beyond 64 bits" in rejected.detail
    assert isinstance(kept, DocumentRef) and kept.metadata["max"] == 2**64 - 1
    with pytest.raises(SchemaError, match="beyond 64 bits"):
        DocumentRef.decode(b'{"doc_id": "d", "image_uris": ["x.jpg"], "metadata": {"n": -99999999999999999999}}')


def test_a_line_written_for_another_schema_version_is_refused(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"doc_id": "a", "images": ["x.jpg"], "schema_version": 2}\n'
                        '{"doc_id": "b", "images": ["x.jpg"], "schema_version": "1"}\n'
                        '{"doc_id": "c", "images": ["x.jpg"], "schema_version": 1}\n')
    found = items(manifest)
    assert [(type(i).__name__, i.doc_id) for i in found] == [("Rejection", "a"), ("Rejection", "b"),
                                                             ("DocumentRef", "c")]
    assert "schema_version 2" in found[0].detail


def test_stdin_json_arrays_are_refused_and_bracketed_paths_kept(tmp_path: Path) -> None:
    from producers.stdin import parse_stdin_line

    rejected = parse_stdin_line(b'[{"doc_id": "a", "images": ["x.jpg"]}]', line=1, base_dir=tmp_path)
    assert isinstance(rejected, Rejection) and rejected.reason == "not_an_object"
    kept = parse_stdin_line(b"[scan] page 1.jpg", line=2, base_dir=tmp_path)
    assert isinstance(kept, DocumentRef) and kept.image_uris == (str(tmp_path / "[scan] page 1.jpg"),)
