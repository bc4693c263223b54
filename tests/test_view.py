"""One `vlmstream run` on a folder (tiny model, real broker), looked at live with `vlmstream view` in headless
Chromium, its image files guarded (403 outside the roots), then exported to Parquet and read back with DuckDB."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from schemas import DeadLetter, Description, DocumentResult, Embedding
from tests.helpers import wait_for
from tests.kafka_helpers import read_topic

REPO = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveRun:
    def __init__(self, settings, root: Path, unique: str, corpus: Path):
        self.settings = settings
        self.folder = root / "docs"
        self.outside = root / "outside"
        # The smallest files: quick to decode on a shared machine.
        images = sorted((p for p in corpus.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png")),
                        key=lambda p: (p.stat().st_size, p.name))[:4]
        for doc, files in {"doc-a": images[:2], "doc-b": images[2:4]}.items():
            (self.folder / doc).mkdir(parents=True)
            for index, path in enumerate(files):
                shutil.copy(path, self.folder / doc / f"{index:02d}{path.suffix.lower()}")
        (self.folder / "doc-b" / "99-broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a JPEG")
        self.outside.mkdir()
        shutil.copy(images[0], self.outside / "secret.jpg")  # a real image: only the root check can refuse it
        (self.folder / ".links").mkdir()  # hidden: the run does not publish it
        (self.folder / ".links" / "escape.jpg").symlink_to(self.outside / "secret.jpg")
        t = settings.topics
        self.env = {**os.environ, "OMP_NUM_THREADS": "1",
                    "VLMSTREAM_BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
                    **{f"VLMSTREAM_TOPICS__{k.upper()}": getattr(t, k) for k in
                       ("documents", "images", "descriptions", "embeddings", "results", "deadletter", "summaries")},
                    "VLMSTREAM_TOPICS__PARTITIONS": "3", "VLMSTREAM_DECODE__GROUP_ID": f"view-decode-{unique}",
                    "VLMSTREAM_INFER__GROUP_ID": f"view-infer-{unique}",
                    "VLMSTREAM_PRODUCER__STATE_DIR": str(root / "ledger"), "VLMSTREAM_INFER__BATCH_SIZE": "4"}
        self.logs = root
        self.run = self._start(["run", str(self.folder), "--decode-workers", "1", "--max-pixels", str(128 * 28 * 28),
                                "--max-new-tokens", "6", "--timeout-s", "400"], "run.log")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.view = self._start(["view", "--port", str(self.port), "--root", str(self.folder)], "view.log")
        wait_for(lambda: self._answers(), 60, f"the view on {self.url}\n{self.log('view.log')}")

    def _start(self, args: list[str], log: str) -> subprocess.Popen:
        with open(self.logs / log, "wb") as out:
            return subprocess.Popen([sys.executable, "-m", "vlmstream.cli", *args], cwd=REPO, env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _answers(self) -> bool:
        try:
            return httpx.get(self.url + "/api/state", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self, name: str) -> str:
        return (self.logs / name).read_text(errors="replace")[-4000:]

    def finished(self) -> None:
        """Waits for the run to end; it must end well."""
        try:
            code = self.run.wait(timeout=480)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not end\n{self.log('run.log')}") from None
        assert code == 0, self.log("run.log")

    def close(self) -> None:
        for proc in (self.view, self.run):
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            proc.wait()


@pytest.fixture(scope="module")
def live(kafka_settings, corpus_dir, tmp_path_factory):
    import uuid

    from tests.kafka_helpers import create_uuid_topics, delete_topics

    settings = create_uuid_topics(kafka_settings)
    run = LiveRun(settings, tmp_path_factory.mktemp("live"), uuid.uuid4().hex[:10], corpus_dir)
    try:
        yield run
    finally:
        run.close()
        delete_topics(kafka_settings, settings)


# --- the page's parts, without a broker ---------------------------------------------------------------------


def _letter(doc: str, index: int | None, kind: str = "decode_corrupt") -> bytes:
    return DeadLetter(stage="decode", error_kind=kind, detail=f"why {doc}", doc_id=doc, image_index=index,
                      source_uri=f"/img/{doc}/{index}.jpg").encode()


def _description(doc: str, index: int, text: str, count: int = 2) -> bytes:
    return Description(doc_id=doc, image_index=index, image_count=count, text=text, model="tiny", prompt_id="p",
                       engine="transformers", source_uri=f"file:///img/{doc}/{index}.jpg").encode()


def test_the_state_filters_by_document_dead_letter_kind_and_text_and_stays_bounded():
    from vlmstream.cli.view_page import ViewState

    state = ViewState(max_images=3)
    state.add("documents", b'{"schema_version": 1, "doc_id": "a", "image_uris": ["x", "y"]}')
    state.add("deadletter", _letter("a", 0))
    state.add("descriptions", _description("a", 0, "A red Barn"))  # redone: the description replaces the failure
    state.add("deadletter", _letter("a", 0))  # an old failure read after it does not come back
    state.add("deadletter", _letter("b", 1, "fetch_not_found"))
    state.add("deadletter", _letter("b", None, "metadata_too_large"))  # the document's own letter
    state.add("descriptions", b"not json")
    state.add("summaries", b'{"schema_version": 1, "doc_id": "a", "answer": {"type": "barn"}}')
    snap = state.snapshot()
    assert [(i["doc_id"], i["image_index"]) for i in snap["items"]] == [("b", 1), ("a", 0)]
    assert snap["items"][1]["dead_letter"] is None and snap["items"][1]["text"] == "A red Barn"
    assert snap["items"][1]["summary"] == '{"answer":{"type":"barn"}}'
    assert snap["items"][0]["document_letters"][0]["error_kind"] == "metadata_too_large"
    assert snap["items"][1]["thumbnail"] == "/thumbnail?uri=file%3A%2F%2F%2Fimg%2Fa%2F0.jpg"
    assert snap["error_kinds"] == ["fetch_not_found", "metadata_too_large"]
    assert snap["progress"]["images_done"] == 2 and snap["progress"]["images_total"] == 2  # b: no count known
    assert [i["doc_id"] for i in state.snapshot(doc="a")["items"]] == ["a"]
    assert [i["image_index"] for i in state.snapshot(kind="metadata_too_large")["items"]] == [1]
    assert [i["doc_id"] for i in state.snapshot(text="red barn")["items"]] == ["a"]
    assert [i["doc_id"] for i in state.snapshot(text="why b")["items"]] == ["b"]
    for index in range(5):
        state.add("descriptions", _description("c", index, "more", count=5))
    assert len(state.snapshot()["items"]) == 3  # view.max_images: the latest kept


def test_thumbnails_come_only_from_inside_the_roots(tmp_path, corpus_dir):
    from starlette.testclient import TestClient

    from vlmstream.cli.view_page import ViewState, make_app
    from vlmstream.config import load_settings

    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    image = next(p for p in sorted(corpus_dir.rglob("*")) if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    shutil.copy(image, root / "in.jpg")
    shutil.copy(image, outside / "secret.jpg")
    (root / "link.jpg").symlink_to(outside / "secret.jpg")
    (root / "fifo.jpg").write_bytes(b"not an image")
    settings = load_settings()
    settings = settings.model_copy(update={"decode": settings.decode.model_copy(
        update={"allowed_roots": [str(root)]})})
    client = TestClient(make_app(settings, ViewState(10)), base_url="http://127.0.0.1")
    assert client.get("/thumbnail", params={"uri": str(root / "in.jpg")}).status_code == 200
    assert client.get("/thumbnail", params={"uri": f"file://{root}/in.jpg"}).status_code == 200
    for uri in (str(outside / "secret.jpg"), f"{root}/../outside/secret.jpg", str(root / "link.jpg"),
                f"{root}%2F..%2Foutside%2Fsecret.jpg", f"file://{root}/%2e%2e/outside/secret.jpg", "/etc/passwd"):
        answer = client.get("/thumbnail?uri=" + uri.replace("%", "%25") if "%" in uri else "/thumbnail",
                            params=None if "%" in uri else {"uri": uri})
        assert answer.status_code == 403, (uri, answer.status_code, answer.text)
    assert client.get("/thumbnail", params={"uri": str(root / "fifo.jpg")}).status_code == 415
    assert client.get("/thumbnail", params={"uri": "https://example.com/a.jpg"}).status_code == 404
    rebound = TestClient(make_app(settings, ViewState(10)), base_url="http://attacker.example")
    assert rebound.get("/api/state").status_code == 400  # a name other than this machine's
    # Over decode's limits the page makes no thumbnail either, and says which setting refused it.
    for limit, setting in (({"max_source_pixels": 100}, "decode.max_source_pixels"),
                           ({"max_image_bytes": 100}, "decode.max_image_bytes")):
        strict = settings.model_copy(update={"decode": settings.decode.model_copy(update=limit)})
        answer = TestClient(make_app(strict, ViewState(10)), base_url="http://127.0.0.1").get(
            "/thumbnail", params={"uri": str(root / "in.jpg")})
        assert answer.status_code == 413 and setting in answer.text, (limit, answer.status_code, answer.text)


# --- a live run ---------------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_images_outside_the_roots_are_refused_however_the_path_is_written(live):
    inside = next((live.folder / "doc-a").iterdir())
    ok = httpx.get(live.url + "/thumbnail", params={"uri": str(inside)}, timeout=30)
    assert ok.status_code == 200 and ok.headers["content-type"] == "image/jpeg"
    import io

    from PIL import Image

    assert max(Image.open(io.BytesIO(ok.content)).size) <= 256  # view.thumbnail_px
    secret = str(live.outside / "secret.jpg")
    dotdot = f"{live.folder}/doc-a/../../outside/secret.jpg"
    attempts = {
        "absolute path outside": f"uri={secret}",
        "..": f"uri={dotdot}",
        "file URL with ..": f"uri=file://{dotdot}",
        "symlink pointing out": f"uri={live.folder}/.links/escape.jpg",
        "encoded slashes": "uri=" + dotdot.replace("/", "%2F"),
        "encoded dots": "uri=" + f"{live.folder}/doc-a/%2e%2e/%2e%2e/outside/secret.jpg",
        "encoded dots and slashes": "uri=" + f"{live.folder}/doc-a/%2e%2e%2F%2e%2e%2Foutside%2Fsecret.jpg",
        "double-encoded file URL": "uri=" + f"file://{live.folder}/doc-a/%252e%252e/%252e%252e/outside/secret.jpg",
        "/etc/passwd": "uri=/etc/passwd",
    }
    for what, query in attempts.items():
        # A raw request line: an HTTP client would tidy `..` and the encodings away before sending.
        with socket.create_connection(("127.0.0.1", live.port), timeout=30) as conn:
            conn.sendall(f"GET /thumbnail?{query} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            status_line = conn.makefile("rb").readline().decode()
        assert " 403 " in status_line, (what, status_line)
    remote = httpx.get(live.url + "/thumbnail", params={"uri": "http://169.254.169.254/latest"}, timeout=30)
    assert remote.status_code == 404  # the page never fetches a URL for anyone


def _browser():
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip(f"headless Chromium is not installed ({CHROMIUM}, {CHROMEDRIVER}: Debian packages chromium and "
                    "chromium-driver; scripts/setup.sh installs them when run as root)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,860"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.mark.model
@pytest.mark.slow
def test_the_page_shows_the_runs_descriptions_beside_their_thumbnails(live, tmp_path):
    driver = _browser()
    try:
        driver.get(live.url + "/")  # opened while the run is still going: the page follows it
        live.finished()
        t = live.settings.topics
        described = {(d.doc_id, d.image_index): d.text for d in
                     (Description.decode(r.value) for r in read_topic(live.settings, t.descriptions, expected=4,
                                                                      timeout_s=60, idle_s=1.0))}
        assert set(described) == {("doc-a", 0), ("doc-a", 1), ("doc-b", 0), ("doc-b", 1)}

        def shown():
            cards = driver.execute_script(
                "return [...document.querySelectorAll('.card')].map(c => [c.dataset.doc, +c.dataset.index, "
                "(c.querySelector('.description') || {}).textContent, (c.querySelector('.letter') || {}).textContent,"
                " (c.querySelector('img') || {}).naturalWidth || 0, (c.querySelector('.result') || {}).textContent])")
            by_image = {(doc, index): rest for doc, index, *rest in cards}
            ready = all(by_image.get(k, [None])[0] == text and by_image[k][2] > 0 and by_image[k][3]
                        for k, text in described.items())
            return by_image if ready and any(v[1] for v in by_image.values()) else None

        by_image = wait_for(shown, 60, "the page to show every description, thumbnail and result")
        [broken] = [v for k, v in by_image.items() if k not in described]
        assert "decode" in broken[1], broken  # the dead letter's stage and reason
        assert "2 of 3 images described" in by_image[("doc-b", 0)][3]
        progress = driver.find_element("id", "progress").text
        assert "images 5 of 5" in progress, progress
        # README's picture: rewritten only when asked, so a test run leaves the checkout clean.
        shot = REPO / "docs" / "view.png" if os.environ.get("VLMSTREAM_UPDATE_SCREENSHOT") else tmp_path / "view.png"
        shot.parent.mkdir(exist_ok=True)
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000

        from selenium.webdriver.support.ui import Select

        Select(driver.find_element("id", "doc")).select_by_value("doc-a")
        wait_for(lambda: set(driver.execute_script(
            "return [...document.querySelectorAll('.card')].map(c => c.dataset.doc)")) == {"doc-a"}, 20,
            "the document filter")
        Select(driver.find_element("id", "doc")).select_by_value("")
        driver.find_element("id", "q").send_keys(described[("doc-b", 1)][:12] or "x")
        wait_for(lambda: ("doc-b", 1) in {tuple(x) for x in driver.execute_script(
            "return [...document.querySelectorAll('.card')].map(c => [c.dataset.doc, +c.dataset.index])")}, 20,
            "the text search")
    finally:
        driver.quit()


@pytest.mark.model
@pytest.mark.slow
def test_the_run_exported_to_parquet_matches_its_topics_exactly(live, tmp_path):
    import duckdb

    live.finished()
    out = tmp_path / "parquet"
    done = subprocess.run([sys.executable, "-m", "vlmstream.cli", "export", str(out), "--format", "parquet"],
                          cwd=REPO, env=live.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    t = live.settings.topics
    for kind, topic, message, key in (
            ("descriptions", t.descriptions, Description, lambda m: (m.doc_id, m.image_index)),
            ("embeddings", t.embeddings, Embedding, lambda m: (m.doc_id, m.image_index)),
            ("results", t.results, DocumentResult, lambda m: (m.doc_id, None)),
            ("deadletter", t.deadletter, DeadLetter, lambda m: (m.doc_id, m.image_index))):
        records = read_topic(live.settings, topic, timeout_s=30, idle_s=1.0, read_committed=True)
        on_topic = sorted((r.partition, r.offset, *key(message.decode(r.value))) for r in records)
        index = "NULL" if kind == "results" else "image_index"
        rows = sorted(duckdb.sql(f"SELECT kafka_partition, kafka_offset, doc_id, {index} "
                                 f"FROM '{out}/{kind}-*.parquet'").fetchall())
        assert rows == on_topic and rows, kind
    assert not list(out.glob(".*"))
