"""Fetching: local roots, hostile URIs, and HTTP against a real server on 127.0.0.1 (http.server in a thread)."""

from __future__ import annotations

import gzip
import http.server
import os
import threading
import time
import tracemalloc
import zlib

import pytest

from vlmstream.images.fetch import Fetcher
from consumers.decode.stage import DecodeStage
from vlmstream.images.errors import ImageError
from consumers.decode.types import ImageFailure, PreparedImage
from tests import images
from vlmstream.config import DecodeSettings

JPEG = images.supported_formats()["jpeg_baseline"]
MAX_BYTES = 64 * 1024
# 16 MiB of zeros in ~16 KB of gzip: under the byte cap on the wire, 256 times over it once inflated.
GZIP_BOMB = gzip.compress(bytes(16 << 20), compresslevel=9)


class _Handler(http.server.BaseHTTPRequestHandler):
    hits: dict[str, int] = {}

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None):
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up first, as some tests intend
            pass

    def do_GET(self):
        path = self.path
        count = self.hits[path] = self.hits.get(path, 0) + 1
        if path == "/image.jpg":
            self._send(200, JPEG, {"Content-Type": "image/jpeg"})
        elif path == "/missing.jpg":
            self._send(404, b"not here")
        elif path == "/huge-undeclared":
            # No Content-Length: the cap must trip while streaming, not from a header.
            self.send_response(200)
            self.end_headers()
            chunk = b"\xff" * 8192
            try:
                for _ in range(MAX_BYTES // len(chunk) * 4):
                    self.wfile.write(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
        elif path == "/huge-declared":
            self._send(200, b"", {"Content-Length": str(MAX_BYTES * 100)})
        elif path.startswith("/flaky"):
            if count == 1:
                self._send(503, b"busy", {"Retry-After": "0"})
            else:
                self._send(200, JPEG)
        elif path == "/always-503":
            self._send(503, b"busy")
        elif path == "/redirect-ok":
            self._send(302, b"", {"Location": "/image.jpg"})
        elif path == "/redirect-metadata":
            self._send(302, b"", {"Location": "http://169.254.169.254/latest/meta-data/"})
        elif path == "/redirect-ftp":
            self._send(302, b"", {"Location": "ftp://127.0.0.1/x.jpg"})
        elif path == "/redirect-loop":
            self._send(302, b"", {"Location": "/redirect-loop"})
        elif path == "/slow":
            time.sleep(1.0)
            self._send(200, JPEG)
        elif path == "/drip":
            # Every read returns well within the read timeout, so only the overall deadline can stop this one.
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(25):
                    self.wfile.write(b"\xff")
                    self.wfile.flush()
                    time.sleep(0.2)
            except (BrokenPipeError, ConnectionResetError):
                pass
        elif path == "/gzip-image":
            self._send(200, gzip.compress(JPEG), {"Content-Encoding": "gzip"})
        elif path == "/deflate-image":
            self._send(200, zlib.compress(JPEG), {"Content-Encoding": "deflate"})
        elif path == "/gzip-bomb":
            self._send(200, GZIP_BOMB, {"Content-Encoding": "gzip"})
        elif path == "/gzip-gzip":
            self._send(200, gzip.compress(gzip.compress(JPEG)), {"Content-Encoding": "gzip, gzip"})
        elif path == "/brotli":
            self._send(200, JPEG, {"Content-Encoding": "br"})
        elif path == "/not-gzip":
            self._send(200, b"notgzip!!!", {"Content-Encoding": "gzip"})
        else:
            self._send(404)


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def fetcher(tmp_path, **kwargs) -> Fetcher:
    options = dict(allowed_roots=[str(tmp_path)], max_bytes=MAX_BYTES, connect_timeout_s=1.0,
                   read_timeout_s=2.0, retries=2, backoff_s=0.01)
    options.update(kwargs)
    return Fetcher(**options)


def kind_of(call) -> str:
    with pytest.raises(ImageError) as info:
        call()
    return info.value.error_kind


# ---- local files -----------------------------------------------------------------------------------------------

def test_local_paths_inside_the_roots_are_read(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.jpg").write_bytes(JPEG)
    f = fetcher(tmp_path)
    assert f.fetch(str(tmp_path / "sub" / "a.jpg")) == JPEG
    assert f.fetch("sub/a.jpg") == JPEG  # relative to the first root
    assert f.fetch((tmp_path / "sub" / "a.jpg").as_uri()) == JPEG  # file://
    os.symlink(tmp_path / "sub" / "a.jpg", tmp_path / "inside-link.jpg")
    assert f.fetch(str(tmp_path / "inside-link.jpg")) == JPEG


def test_local_paths_that_escape_the_roots_are_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "secret.jpg"
    outside.write_bytes(JPEG)
    os.symlink(outside, root / "escape.jpg")
    f = fetcher(root)
    assert kind_of(lambda: f.fetch(str(outside))) == "fetch_forbidden_path"
    assert kind_of(lambda: f.fetch(str(root / ".." / "secret.jpg"))) == "fetch_forbidden_path"
    assert kind_of(lambda: f.fetch("../secret.jpg")) == "fetch_forbidden_path"
    assert kind_of(lambda: f.fetch(str(root / "escape.jpg"))) == "fetch_forbidden_path"
    os.symlink(root / "loop-b", root / "loop-a")
    os.symlink(root / "loop-a", root / "loop-b")
    assert kind_of(lambda: f.fetch(str(root / "loop-a"))) in ("fetch_not_found", "fetch_forbidden_path")
    assert kind_of(lambda: f.fetch("/etc/passwd")) == "fetch_forbidden_path"
    assert kind_of(lambda: f.fetch("file:///etc/passwd")) == "fetch_forbidden_path"
    assert kind_of(lambda: f.fetch("file://evil.example.com/etc/passwd")) == "fetch_forbidden_host"


def test_missing_and_oversized_local_files(tmp_path):
    f = fetcher(tmp_path)
    assert kind_of(lambda: f.fetch(str(tmp_path / "nope.jpg"))) == "fetch_not_found"
    (tmp_path / "big.bin").write_bytes(b"\0" * (MAX_BYTES + 1))
    assert kind_of(lambda: f.fetch(str(tmp_path / "big.bin"))) == "fetch_too_large"
    with pytest.raises(ImageError, match=r"over decode\.max_image_bytes \(.*VLMSTREAM_DECODE__MAX_IMAGE_BYTES raises"):
        f.fetch(str(tmp_path / "big.bin"))  # the reason names the setting that lets a genuine large file through


def test_fifos_are_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "page.png"
    os.mkfifo(fifo)
    f = fetcher(tmp_path)
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(kind_of(lambda: f.fetch(str(fifo)))), daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # a regression: let the blocked open() return so the thread can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not reader.is_alive(), "opening a FIFO blocked"
    assert outcome == ["fetch_not_found"]


def test_empty_uris_and_unknown_home_directories_are_classified(tmp_path):
    f = fetcher(tmp_path)
    with pytest.raises(ImageError) as info:
        f.fetch("")
    assert info.value.error_kind == "fetch_bad_uri" and "empty URI" in str(info.value)
    assert kind_of(lambda: f.fetch("~vlmstream-no-such-user/x.png")) == "fetch_not_found"


def test_empty_allowed_roots_means_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "a.jpg").write_bytes(JPEG)
    monkeypatch.chdir(tmp_path)
    f = Fetcher(allowed_roots=[])
    assert f.fetch("a.jpg") == JPEG
    assert kind_of(lambda: f.fetch("/etc/hostname")) == "fetch_forbidden_path"


# ---- schemes and hosts -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "uri, kind",
    [
        ("ftp://127.0.0.1/a.jpg", "fetch_forbidden_scheme"),
        ("javascript:alert(1)", "fetch_forbidden_scheme"),
        ("data:image/png;base64,iVBORw0KGgo=", "fetch_forbidden_scheme"),
        ("zip://a.jpg::file:///tmp/x.zip", "fetch_forbidden_scheme"),
        ("simplecache::memory://bucket/a.jpg", "fetch_forbidden_scheme"),
        ("gopher://127.0.0.1/", "fetch_forbidden_scheme"),
        ("http://127.0.0.1:9/a.jpg", "fetch_forbidden_host"),
        ("http://localhost:9/a.jpg", "fetch_forbidden_host"),
        ("http://[::1]:9/a.jpg", "fetch_forbidden_host"),
        ("http://10.1.2.3/a.jpg", "fetch_forbidden_host"),
        ("http://169.254.169.254/latest/meta-data/", "fetch_forbidden_host"),
        ("http://0.0.0.0/a.jpg", "fetch_forbidden_host"),
        ("http://user:pw@example.com/a.jpg", "fetch_forbidden_host"),
        ("http://[::1/a.jpg", "fetch_bad_uri"),
        ("http://example.com:99999/a.jpg", "fetch_bad_uri"),
        ("http://" + "a" * 64 + ".example.com/a.jpg", "fetch_bad_uri"),  # IDNA refuses labels over 63 chars
    ],
)
def test_hostile_uris_are_refused_before_any_connection(tmp_path, uri, kind):
    assert kind_of(lambda: fetcher(tmp_path).fetch(uri)) == kind


def test_link_local_stays_refused_even_with_private_hosts_allowed(tmp_path):
    f = fetcher(tmp_path, allow_private_hosts=True)
    assert kind_of(lambda: f.fetch("http://169.254.169.254/")) == "fetch_forbidden_host"


def test_fsspec_memory_urls(tmp_path):
    import fsspec

    memory = fsspec.filesystem("memory")
    memory.pipe_file("/vlmstream-test/a.jpg", JPEG)
    f = fetcher(tmp_path)
    assert f.fetch("memory://vlmstream-test/a.jpg") == JPEG
    assert kind_of(lambda: f.fetch("memory://vlmstream-test/missing.jpg")) == "fetch_not_found"
    memory.pipe_file("/vlmstream-test/big.bin", b"\0" * (MAX_BYTES + 1))
    assert kind_of(lambda: f.fetch("memory://vlmstream-test/big.bin")) == "fetch_too_large"
    memory.rm("/vlmstream-test", recursive=True)


# ---- http against a real local server --------------------------------------------------------------------------

def test_http_fetch_and_redirects(server, tmp_path):
    f = fetcher(tmp_path, allow_private_hosts=True)
    assert f.fetch(f"{server}/image.jpg") == JPEG
    assert f.fetch(f"{server}/redirect-ok") == JPEG


def test_http_failures_have_the_right_kind(server, tmp_path):
    f = fetcher(tmp_path, allow_private_hosts=True)
    assert kind_of(lambda: f.fetch(f"{server}/missing.jpg")) == "fetch_not_found"
    assert kind_of(lambda: f.fetch(f"{server}/huge-undeclared")) == "fetch_too_large"
    assert kind_of(lambda: f.fetch(f"{server}/huge-declared")) == "fetch_too_large"
    assert kind_of(lambda: f.fetch(f"{server}/redirect-metadata")) == "fetch_forbidden_host"
    assert kind_of(lambda: f.fetch(f"{server}/redirect-ftp")) == "fetch_forbidden_scheme"
    assert kind_of(lambda: f.fetch(f"{server}/redirect-loop")) == "fetch_http_error"


def test_transient_http_errors_are_retried_with_backoff(server, tmp_path):
    f = fetcher(tmp_path, allow_private_hosts=True)
    _Handler.hits.clear()
    assert f.fetch(f"{server}/flaky-1") == JPEG
    assert _Handler.hits["/flaky-1"] == 2
    with pytest.raises(ImageError) as info:
        f.fetch(f"{server}/always-503")
    assert info.value.error_kind == "fetch_http_error" and info.value.retriable
    assert _Handler.hits["/always-503"] == 3  # first try + http_retries (2)


@pytest.mark.parametrize("path,read_timeout_s,retries,deadline_s,within_s", [
    ("/slow", 0.2, 5, 0.6, 1.5),  # silent: each read times out, retries stop at the deadline
    ("/drip", 2.0, 0, 1.0, 2.0),  # a byte now and then: no read ever times out, the deadline still holds
])
def test_slow_servers_are_stopped_at_the_deadline(server, tmp_path, path, read_timeout_s, retries, deadline_s,
                                                  within_s):
    f = fetcher(tmp_path, allow_private_hosts=True, read_timeout_s=read_timeout_s, retries=retries,
                deadline_s=deadline_s)
    started = time.monotonic()
    with pytest.raises(ImageError) as info:
        f.fetch(f"{server}{path}")
    assert info.value.error_kind == "fetch_timeout" and info.value.retriable
    assert time.monotonic() - started < within_s
    assert "decode.http_read_timeout_s" in str(info.value)  # what a user raises for a slow but genuine server


def test_compressed_responses_are_inflated_within_the_byte_cap(server, tmp_path):
    f = fetcher(tmp_path, allow_private_hosts=True)
    assert f.fetch(f"{server}/gzip-image") == JPEG
    assert f.fetch(f"{server}/deflate-image") == JPEG
    tracemalloc.start()
    try:
        assert kind_of(lambda: f.fetch(f"{server}/gzip-bomb")) == "fetch_too_large"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Inflating a whole network read before the cap is checked would hold megabytes here.
    assert peak < 4 << 20


@pytest.mark.parametrize("path, named", [("/gzip-gzip", "gzip, gzip"), ("/brotli", "br"), ("/not-gzip", "gzip")])
def test_encodings_we_cannot_inflate_safely_are_refused(server, tmp_path, path, named):
    f = fetcher(tmp_path, allow_private_hosts=True)
    with pytest.raises(ImageError) as info:
        f.fetch(f"{server}{path}")
    assert info.value.error_kind == "fetch_http_error" and not info.value.retriable
    assert named in str(info.value)


def test_stage_turns_fetch_errors_into_failure_values(server, tmp_path):
    settings = DecodeSettings(allowed_roots=[str(tmp_path)], allow_private_hosts=False, max_image_bytes=MAX_BYTES)
    stage = DecodeStage(settings, "")
    failure = stage(f"{server}/image.jpg")
    assert isinstance(failure, ImageFailure) and failure.error_kind == "fetch_forbidden_host"
    assert "decode.allow_private_hosts" in failure.detail  # the setting that lets a trusted private server in
    assert stage(str(tmp_path / "missing.jpg")).error_kind == "fetch_not_found"
    allowed = DecodeStage(settings.model_copy(update={"allow_private_hosts": True}), "")
    result = allowed(f"{server}/image.jpg")
    assert isinstance(result, PreparedImage) and result.fetch_bytes == len(JPEG)
    assert result.timings["fetch_ms"] > 0
