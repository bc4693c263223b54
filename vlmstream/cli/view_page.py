"""The page of `vlmstream view` (the command: vlmstream/cli/view.py): a local page that follows the output topics live: image thumbnails beside their descriptions,
each document's result and summary, dead letters with their reason; filters by document, dead-letter kind and text;
the pipeline's progress (images done of total, rate, ETA).

A read_committed consumer without a group reads the documents, descriptions, results, dead-letter and (when the
cluster has it) summaries topics from their beginning, and keeps the latest ``view.max_images`` images in memory.
Thumbnails are made here with Pillow from local image files, read through the same root check as the decode
fetcher (``decode.allowed_roots``, plus ``--root``): a path that leads outside them is answered 403. The page
listens on 127.0.0.1 unless ``view.host`` says otherwise.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from schemas import DeadLetter, Description, DocumentRef, DocumentResult, SchemaError
from vlmstream.config import Settings
from vlmstream.images import pdf
from vlmstream.images.errors import ImageError, TooManyPixels
from vlmstream.images.localfiles import ForbiddenPath, LocalFiles, NotFound, TooLarge
from vlmstream.images.pages import split_page

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 5.0
RATE_WINDOW_S = 60
PAGE_ITEMS = 300  # images the page shows at once (the latest that pass the filters)


@dataclass
class ViewState:
    """What the topics said so far; every method holds the lock, since the follower thread writes it."""

    max_images: int
    images: OrderedDict = field(default_factory=OrderedDict)  # (doc_id, index) -> dict, oldest first
    image_counts: dict[str, int] = field(default_factory=dict)  # doc_id -> images, from the documents topic
    done: set = field(default_factory=set)  # (doc_id, index) described or dead-lettered
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    summaries: dict[str, str] = field(default_factory=dict)
    document_letters: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # letters without an image
    progress: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _image(self, doc_id: str, index: int) -> dict[str, Any]:
        key = (doc_id, index)
        item = self.images.get(key)
        if item is None:
            item = self.images[key] = {"doc_id": doc_id, "image_index": index, "text": None, "source_uri": None,
                                       "dead_letter": None}
            while len(self.images) > self.max_images:
                self.images.popitem(last=False)
        return item

    def add(self, kind: str, value: bytes | None) -> None:
        if value is None:
            return
        try:
            data = orjson.loads(value)
            if not isinstance(data, dict):
                return
            with self.lock:
                self._add(kind, data)
        except (orjson.JSONDecodeError, SchemaError, ValueError, TypeError):
            return  # another writer's record: `vlmstream status` and the exporter count those

    def _add(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "documents":
            ref = DocumentRef.from_dict(data)
            self.image_counts[ref.doc_id] = len(ref.image_uris)
        elif kind == "descriptions":
            d = Description.from_dict(data)
            item = self._image(d.doc_id, d.image_index)
            item.update(text=d.text, source_uri=d.source_uri or item["source_uri"], model=d.model,
                        image_count=d.image_count, dead_letter=None)
            self.image_counts.setdefault(d.doc_id, d.image_count)
            self.done.add((d.doc_id, d.image_index))
        elif kind == "deadletter":
            x = DeadLetter.from_dict(data)
            letter = {"stage": x.stage, "error_kind": x.error_kind, "detail": x.detail[:2000]}
            if x.doc_id is None:
                return
            if x.image_index is None:
                self.document_letters.setdefault(x.doc_id, []).append(letter)
                return
            item = self._image(x.doc_id, x.image_index)
            if item["text"] is None:  # a later success replaces an earlier failure, not the other way round
                item.update(dead_letter=letter, source_uri=x.source_uri or item["source_uri"])
            self.done.add((x.doc_id, x.image_index))
        elif kind == "results":
            r = DocumentResult.from_dict(data)
            self.results[r.doc_id] = {"image_count": r.image_count, "succeeded": r.succeeded, "failed": r.failed}
        elif kind == "summaries" and isinstance(data.get("doc_id"), str):
            self.summaries[data["doc_id"]] = orjson.dumps(
                {k: v for k, v in data.items() if k not in ("doc_id", "schema_version", "source")}).decode()

    def snapshot(self, doc: str = "", kind: str = "", text: str = "", limit: int = PAGE_ITEMS) -> dict[str, Any]:
        text = text.lower()
        with self.lock:
            items = []
            for item in reversed(self.images.values()):
                letter = item["dead_letter"]
                if doc and item["doc_id"] != doc:
                    continue
                letters = [letter] if letter else []
                letters += self.document_letters.get(item["doc_id"], [])
                if kind and kind not in {x["error_kind"] for x in letters}:
                    continue
                if text and text not in (item["text"] or "").lower() and \
                        not any(text in x["detail"].lower() for x in letters):
                    continue
                items.append({**item, "thumbnail": thumbnail_url(item["source_uri"]),
                              "result": self.results.get(item["doc_id"]),
                              "summary": self.summaries.get(item["doc_id"]),
                              "document_letters": self.document_letters.get(item["doc_id"])})
                if len(items) >= limit:
                    break
            kinds = sorted({i["dead_letter"]["error_kind"] for i in self.images.values() if i["dead_letter"]}
                           | {x["error_kind"] for letters in self.document_letters.values() for x in letters})
            total = sum(self.image_counts.values())
            return {"items": items, "documents": sorted({i["doc_id"] for i in self.images.values()}),
                    "error_kinds": kinds,
                    "progress": {**self.progress, "images_done": len(self.done), "images_total": total or None,
                                 "documents_completed": len(self.results)}}


def thumbnail_url(source_uri: str | None) -> str | None:
    """The page's link to an image's thumbnail: local files only (the page never fetches remote URLs)."""
    if not source_uri or local_path(source_uri) is None:
        return None
    return "/thumbnail?uri=" + quote(source_uri, safe="")


def local_path(uri: str) -> str | None:
    """The file system path a URI names, as the decode fetcher reads it; None for a remote one."""
    uri, _page = split_page(uri)
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "" or (len(scheme) == 1 and uri[1:2] == ":"):
        return uri
    if scheme == "file" and parts.netloc in ("", "localhost"):
        return unquote(parts.path)
    return None


class Follower:
    """The output topics into a ViewState, on a thread of its own, until stopped."""

    KINDS = ("documents", "descriptions", "deadletter", "results", "summaries")

    def __init__(self, settings: Settings, state: ViewState):
        self.settings = settings
        self.state = state
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="view-follower", daemon=True)

    def start(self) -> "Follower":
        self.thread.start()
        return self

    def _run(self) -> None:
        from kafka.errors import KafkaError

        from vlmstream.kafka.clients import make_consumer
        from vlmstream.kafka.group import topic_partitions
        from vlmstream.kafka.records import poll_past_unreadable

        topics = {getattr(self.settings.topics, kind): kind for kind in self.KINDS}
        consumer = make_consumer(self.settings, None, read_committed=True)
        try:
            assigned: set = set()
            looked_at = 0.0
            while not self.stop.is_set():
                if time.monotonic() - looked_at > 10:  # topics created after the page started (a run's, summaries)
                    looked_at = time.monotonic()
                    found = set(topic_partitions(consumer, topics, missing_ok=True))
                    if found - assigned:
                        positions = {tp: consumer.position(tp) for tp in assigned}
                        consumer.assign(sorted(found | assigned))
                        for tp, offset in positions.items():  # a new assignment keeps no position: say it
                            consumer.seek(tp, offset)
                        consumer.seek_to_beginning(*sorted(found - assigned))
                        assigned |= found
                if not assigned:
                    self.stop.wait(1.0)
                    continue
                try:
                    batch = poll_past_unreadable(consumer, timeout_ms=500)
                except KafkaError as exc:  # the broker away for a moment: the page keeps what it has
                    log.warning("view: reading the topics: %s", exc)
                    self.stop.wait(1.0)
                    continue
                for tp, records in batch.items():
                    for record in records:
                        self.state.add(topics[tp.topic], record.value)
        finally:
            consumer.close()


def _progress_loop(settings: Settings, state: ViewState, stop: threading.Event) -> None:
    """The descriptions topic's rate over the last minute (`vlmstream status`'s throughput), and the ETA it gives
    for the images not done yet."""
    from vlmstream.cli.status import pipeline_throughput

    while not stop.is_set():
        try:
            [row] = [r for r in pipeline_throughput(settings, windows_s=(RATE_WINDOW_S,))
                     if r.topic == settings.topics.descriptions]
            rate = row.per_s(RATE_WINDOW_S) if row.exists else None
            with state.lock:
                total, done = sum(state.image_counts.values()), len(state.done)
                remaining = max(0, total - done) if total else None
                eta = remaining / rate if rate and remaining is not None else (0.0 if remaining == 0 else None)
                state.progress = {"images_per_s": rate, "eta_s": eta}
        except Exception as exc:  # noqa: BLE001 - progress is a nicety: the page goes on without it
            log.warning("view: progress: %s", exc)
        stop.wait(PROGRESS_EVERY_S)


def make_app(settings: Settings, state: ViewState) -> Starlette:
    files = LocalFiles(settings.decode.allowed_roots, settings.decode.max_image_bytes)
    size = settings.view.thumbnail_px
    max_pixels = settings.decode.max_source_pixels

    renderer = pdf.PageRenderer(max_pixels=size * size, max_bytes=settings.decode.max_image_bytes)

    def pdf_thumbnail(data: bytes, page: int):
        """The page drawn by PDFium straight at thumbnail size, bounded like decode's renders."""
        from PIL import Image

        def fit(width_pt: float, height_pt: float) -> tuple[int, int]:
            scale = size / max(width_pt, height_pt)
            return max(1, round(width_pt * scale)), max(1, round(height_pt * scale))

        rendered = renderer.render(data, page, fit, time_limit_s=settings.decode.pdf_render_time_limit_s)
        return Image.fromarray(rendered.pixels)

    @lru_cache(maxsize=1024)
    def thumbnail(path: str, page: int | None) -> bytes:
        from PIL import Image, ImageOps

        data = files.read(path)  # ForbiddenPath outside the roots, whatever `..`, symlink or encoding led there
        if pdf.is_pdf(data):
            small = pdf_thumbnail(data, page or 1)
            out = io.BytesIO()
            small.save(out, "JPEG", quality=85)
            return out.getvalue()
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > max_pixels:
                raise TooManyPixels(f"{image.width}x{image.height} pixels", max_pixels)
            if page:
                image.seek(page - 1)
            image.draft("RGB", (size, size))  # JPEG: decode at a reduced scale
            small = ImageOps.exif_transpose(image.convert("RGB"))
            small.thumbnail((size, size))
            out = io.BytesIO()
            small.save(out, "JPEG", quality=85)
            return out.getvalue()

    async def page(request: Request) -> HTMLResponse:
        return HTMLResponse(PAGE)

    async def api_state(request: Request) -> JSONResponse:
        q = request.query_params
        return JSONResponse(state.snapshot(q.get("doc", ""), q.get("kind", ""), q.get("q", "")))

    def thumbnail_response(request: Request) -> Response:
        uri = request.query_params.get("uri", "")
        path = local_path(uri)
        if path is None:
            return Response("only local image files have thumbnails here", status_code=404)
        _, page_number = split_page(uri)
        try:
            body = thumbnail(path, page_number)
        except ForbiddenPath as exc:
            return Response(f"forbidden: {exc}", status_code=403)
        except NotFound as exc:
            return Response(str(exc), status_code=404)
        except (TooLarge, TooManyPixels) as exc:
            return Response(str(exc), status_code=413)
        except (OSError, ValueError, EOFError, ImageError) as exc:  # not an image Pillow or PDFium can open, or a
            return Response(f"cannot make a thumbnail: {exc}", status_code=415)  # page it lacks
        return Response(body, media_type="image/jpeg", headers={"Cache-Control": "max-age=3600"})

    # Host names the page answers to: a web page elsewhere that rebinds its own name to 127.0.0.1 (DNS rebinding)
    # would otherwise read the descriptions through the visitor's browser.
    host = settings.view.host
    hosts = ["*"] if host in ("0.0.0.0", "::", "") else sorted({host, "127.0.0.1", "localhost", "[::1]"})
    return Starlette(routes=[Route("/", page), Route("/api/state", api_state),
                             Route("/thumbnail", thumbnail_response)],
                     middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts)])


def serve(settings: Settings, host: str, port: int) -> None:
    import uvicorn

    state = ViewState(settings.view.max_images)
    follower = Follower(settings, state).start()
    threading.Thread(target=_progress_loop, args=(settings, state, follower.stop), name="view-progress",
                     daemon=True).start()
    try:
        uvicorn.run(make_app(settings, state), host=host, port=port, log_level="warning")
    finally:
        follower.stop.set()
        follower.thread.join(10)


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>vlmstream view</title>
<style>
body { font-family: system-ui, sans-serif; margin: 0; background: #f4f4f2; color: #222; }
header { position: sticky; top: 0; background: #1d2b36; color: #fff; padding: 10px 16px; display: flex;
         gap: 16px; align-items: center; flex-wrap: wrap; z-index: 1; }
header h1 { font-size: 18px; margin: 0; }
header select, header input { font-size: 14px; padding: 3px 6px; }
#progress { margin-left: auto; font-size: 14px; }
#grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(260px, 1fr)); gap: 12px; padding: 16px; }
.card { background: #fff; border-radius: 6px; box-shadow: 0 1px 3px rgba(0,0,0,.15); padding: 8px;
        display: flex; flex-direction: column; gap: 6px; }
.card img { width: 100%; height: 200px; object-fit: contain; background: #eee; border-radius: 4px; }
.noimg { height: 200px; display: flex; align-items: center; justify-content: center; text-align: center;
         background: #eee; color: #888; border-radius: 4px; }
.id { font-weight: 600; font-size: 13px; }
.text { font-size: 13px; white-space: pre-wrap; max-height: 9em; overflow: auto; }
.letter { font-size: 12px; color: #9b1c1c; background: #fde8e8; padding: 4px; border-radius: 4px; }
.result, .summary { font-size: 12px; color: #555; }
</style></head>
<body>
<header><h1>vlmstream</h1>
<label>document <select id="doc"><option value="">all</option></select></label>
<label>dead letter <select id="kind"><option value="">any</option></select></label>
<label>search <input id="q" type="search" placeholder="text in descriptions"></label>
<span id="progress">connecting...</span></header>
<div id="grid"></div>
<script>
const $ = (id) => document.getElementById(id);
function el(tag, cls, text) { const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text; return e; }
function fillSelect(select, values) {
  const have = new Set([...select.options].map(o => o.value));
  for (const v of values) if (!have.has(v)) { const o = el("option", null, v); o.value = v; select.appendChild(o); }
}
function duration(s) { if (s === null || s === undefined) return "unknown";
  if (s < 90) return Math.round(s) + " s"; if (s < 5400) return Math.round(s / 60) + " min";
  return (s / 3600).toFixed(1) + " h"; }
function card(item) {
  const c = el("div", "card"); c.dataset.doc = item.doc_id; c.dataset.index = item.image_index;
  if (item.thumbnail) { const img = el("img"); img.loading = "lazy"; img.src = item.thumbnail;
    img.alt = item.doc_id + " #" + item.image_index;
    img.onerror = () => img.replaceWith(el("div", "noimg", "no thumbnail: not an image this page can open"));
    c.appendChild(img); }
  else c.appendChild(el("div", "noimg", "no local image"));
  c.appendChild(el("div", "id", item.doc_id + " · image " + item.image_index));
  if (item.text !== null) c.appendChild(el("div", "text description", item.text));
  if (item.dead_letter) c.appendChild(el("div", "letter", item.dead_letter.stage + " / " +
      item.dead_letter.error_kind + ": " + item.dead_letter.detail));
  for (const l of item.document_letters || []) c.appendChild(el("div", "letter", "document: " + l.error_kind +
      ": " + l.detail));
  if (item.result) c.appendChild(el("div", "result", "document: " + item.result.succeeded + " of " +
      item.result.image_count + " images described, " + item.result.failed + " failed"));
  if (item.summary) c.appendChild(el("div", "summary", "summary: " + item.summary));
  return c;
}
let last = "";
async function refresh() {
  const params = new URLSearchParams({doc: $("doc").value, kind: $("kind").value, q: $("q").value});
  try {
    const state = await (await fetch("/api/state?" + params)).json();
    fillSelect($("doc"), state.documents); fillSelect($("kind"), state.error_kinds);
    const p = state.progress;
    $("progress").textContent = "images " + p.images_done + (p.images_total ? " of " + p.images_total : "") +
      " · " + (p.images_per_s === undefined || p.images_per_s === null ? "rate unknown" :
      p.images_per_s.toFixed(2) + " img/s") + " · ETA " + duration(p.eta_s) +
      " · documents completed " + p.documents_completed;
    const key = JSON.stringify(state.items);
    if (key !== last) { last = key; $("grid").replaceChildren(...state.items.map(card)); }
  } catch (e) { $("progress").textContent = "not reachable: " + e; }
}
for (const id of ["doc", "kind"]) $(id).addEventListener("change", refresh);
$("q").addEventListener("input", refresh);
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""
