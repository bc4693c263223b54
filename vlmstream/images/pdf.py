"""PDF documents through PDFium (pypdfium2): the page count without rendering, a page's displayed size, a page
rendered straight into a bitmap of the caller's size, and its text layer. Producers count pages to publish each page
of a PDF as ``URI#page=N``; the decode stage renders the page a URI names; ``vlmstream view`` its thumbnails.

PDFs are hostile input, so: PDFium is not thread-safe and every use in a process holds one lock; no form
environment is ever initialised and pypdfium2's PDFium is built without V8, so a document's JavaScript never runs
(``runs_no_scripts`` says so at run time); documents are opened, parsed and drawn in a child process that is killed
past a page's time limit (``PageRenderer``), so a page that never finishes, or crashes PDFium, costs that page, not
the worker.
Checked against pypdfium2 5.15: its raw ``FPDF_RenderPageBitmap`` draws into a bitmap of any size.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import orjson

from vlmstream.images.errors import ImageError

POINTS_PER_INCH = 72.0
# decode.max_pdf_pages' default: the pages of one PDF a folder source publishes page by page.
DEFAULT_MAX_PAGES = 1000
_LOCK = threading.RLock()


class PdfEncrypted(ImageError):
    error_kind = "decode_pdf_encrypted"


class CorruptPdf(ImageError):
    error_kind = "decode_corrupt"


class PdfTooManyPages(ImageError):
    """A document of more pages than ``decode.max_pdf_pages``."""

    error_kind = "decode_pdf_too_many_pages"

    def __init__(self, pages: int, limit: int):
        super().__init__(f"PDF of {pages:,} pages: over decode.max_pdf_pages ({limit:,}; "
                         f"VLMSTREAM_DECODE__MAX_PDF_PAGES raises it)")


class PdfRenderTimeout(ImageError):
    """The same page takes as long next time: not retriable."""

    error_kind = "decode_pdf_render_timeout"

    def __init__(self, seconds: float):
        super().__init__(f"rendering the PDF page took longer than {seconds:g}s (decode.pdf_render_time_limit_s)")


def is_pdf(head: bytes) -> bool:
    """A PDF's header; readers (PDFium too) accept it within the first 1,024 bytes, after junk a mailer left."""
    return b"%PDF-" in bytes(head[:1024])


def runs_no_scripts() -> bool:
    """True when this PDFium build cannot run a document's JavaScript (no V8 in it)."""
    import pypdfium2

    return "V8" not in pypdfium2.PDFIUM_INFO.flags


@contextlib.contextmanager
def open_document(source: bytes | str | Path) -> Iterator["object"]:
    """The open ``pypdfium2.PdfDocument`` of bytes or a local path, holding PDFium's lock until the block ends.
    Raises ``PdfEncrypted`` (a password or an unsupported security handler) or ``CorruptPdf``."""
    pypdfium2 = _pdfium()

    with _LOCK:
        try:
            document = pypdfium2.PdfDocument(source if isinstance(source, (bytes, str)) else str(source))
        except pypdfium2.PdfiumError as exc:
            raise _open_failure(exc) from exc
        try:
            yield document
        finally:
            document.close()


def _pdfium():
    try:
        import pypdfium2
    except ImportError as exc:  # an environment installed before PDFs were read: every PDF says so, no worker stops
        raise ImageError("PDF: pypdfium2, a dependency of vlmstream, is not installed here (install vlmstream "
                         "again: scripts/setup.sh)", error_kind="decode_unsupported") from exc
    return pypdfium2


def count_pages(source: bytes | str | Path) -> int:
    """Pages of a PDF, from its page tree (nothing rendered, no page parsed); raises like ``open_document``."""
    with open_document(source) as document:
        return len(document)


def page_size(document, number: int) -> tuple[float, float]:
    """(width, height) in points of page ``number`` (from 1) as displayed: its /Rotate applied."""
    import pypdfium2

    try:
        page = document[number - 1]
    except pypdfium2.PdfiumError as exc:
        raise CorruptPdf(f"PDF page {number} cannot be loaded: {exc}") from exc
    try:
        width, height = page.get_size()
    finally:
        page.close()
    if not (width > 0 and height > 0):  # NaN too
        raise CorruptPdf(f"PDF page {number} has no area ({width}x{height} points)")
    return width, height


@dataclass(frozen=True)
class RenderedPage:
    pixels: np.ndarray  # RGB: at the size ``size_for`` gave, or a full-page scan as ``scan`` decoded it
    width_pt: float  # the page as displayed (its /Rotate applied)
    height_pt: float
    pages: int  # in the document
    text: str
    scan: bool = False  # the pixels are the page's one JPEG as ``scan`` decoded it, at least the size asked for


class PageRenderer:
    """Renders PDF pages in a child process of this one, so that PDFium's parsing and drawing are bounded: C code
    that neither a signal nor a pause callback reaches (a nested form drawn a million times over is one call), or a
    crash on hostile bytes, costs the page, not the caller. The child is forked at the first page and serves page
    after page: the document's bytes go once through shared memory and stay open there for its next page, the
    pixels (or a scanned page's JPEG) come back through shared memory, the requests through a pipe. Past
    ``time_limit_s`` (counted from the page's start) the child is killed and the page is a ``PdfRenderTimeout``; a
    child that dies leaves a ``CorruptPdf``; either way the next page forks a new one. One renderer per process;
    thread-safe (one page at a time)."""

    def __init__(self, *, max_pixels: int, max_bytes: int):
        self.max_pixels = max_pixels
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._pid = 0
        self._opened: bytes | None = None
        self._pages = 0

    def render(self, data: bytes, number: int | None, size_for: Callable[[float, float], tuple[int, int]], *,
               time_limit_s: float = 0.0, text_chars: int = 0, page_limit: int | None = None,
               scan: Callable[[bytes, int, int], np.ndarray | None] | None = None,
               shrink: Callable[[np.ndarray, float, float], np.ndarray] | None = None) -> RenderedPage:
        """Page ``number`` (from 1; None: the first, with ``page_limit`` refusing a longer document) at
        ``size_for(width_pt, height_pt)`` = (width, height) pixels, at most ``max_pixels``. ``size_for`` runs here
        and may raise ``ImageError`` (a size over a cap).

        ``scan(jpeg, width_pt, height_pt)``: for a page that is one JPEG covering it exactly and nothing else (what
        a scanner writes), the JPEG's own bytes, decoded here for a page of that displayed size (a JPEG decoder
        scales by 1/2..1/8 while decoding, which PDFium does not), or None to have the page drawn after all.

        ``shrink(pixels, width_pt, height_pt)``: the drawn pixels, read in place in the shared buffer (a large
        raster is not copied to be shrunk), to a new array returned as the page's; without it, a copy."""
        if len(data) > self.max_bytes:
            raise CorruptPdf(f"a PDF of {len(data)} bytes is over the renderer's {self.max_bytes}")
        deadline = time.monotonic() + time_limit_s if time_limit_s > 0 else None
        with self._lock:
            try:
                pages = self._open(data, deadline, time_limit_s)
                if number is None and page_limit is not None and pages > page_limit:
                    raise PdfTooManyPages(pages, page_limit)
                number = number or 1
                if number > pages:
                    raise ImageError(f"page {number} asked for; the PDF has {pages}",
                                     error_kind="decode_page_out_of_range")
                size = self._ask({"op": "size", "page": number, "scan": scan is not None, "text": text_chars},
                                 deadline, time_limit_s)
                width, height = size_for(size["width"], size["height"])
                if not 0 < width * height <= self.max_pixels:
                    raise ImageError(f"render size {width}x{height} is outside 1..{self.max_pixels} pixels",
                                     error_kind="decode_internal")
                if size["scan"]:
                    pixels = scan(bytes(self._scans[: size["scan"]]), size["width"], size["height"])
                    if pixels is not None:
                        return RenderedPage(pixels, size["width"], size["height"], pages, size["text"], scan=True)
                reply = self._ask({"op": "render", "page": number, "width": width, "height": height,
                                   "text": text_chars}, deadline, time_limit_s)
            except _ChildGone:
                raise
            except ImageError:
                raise
            except BaseException:  # the caller's own alarm, an interrupt: the child is mid-request, so it goes
                self._stop()
                raise
            drawn = np.frombuffer(self._pixels, np.uint8, width * height * 3).reshape(height, width, 3)
            pixels = drawn.copy() if shrink is None else shrink(drawn, size["width"], size["height"])
            del drawn  # the buffer is the next page's
        return RenderedPage(pixels, size["width"], size["height"], pages, reply["text"])

    def close(self) -> None:
        with self._lock:
            self._stop()

    def child_cpu_seconds(self) -> float:
        """CPU time of the running child so far (0 without one): the part of the pages' cost that the parent's
        own clocks miss until the child is reaped."""
        if not self._pid:
            return 0.0
        try:  # Linux's CPU clock of another process: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
            return time.clock_gettime((~self._pid << 3) | 2)
        except OSError:
            return 0.0

    # -- the parent's side ------------------------------------------------------------------------------

    def _open(self, data: bytes, deadline: float | None, time_limit_s: float) -> int:
        if self._pid and self._opened is not None and len(self._opened) == len(data) and self._opened == data:
            return self._pages  # the same document's next page: already open in the child
        if not self._pid:
            self._start()
        self._opened = None
        self._input[: len(data)] = data
        self._pages = self._ask({"op": "open", "bytes": len(data)}, deadline, time_limit_s)["pages"]
        self._opened = data
        return self._pages

    def _ask(self, request: dict, deadline: float | None, time_limit_s: float) -> dict:
        os.write(self._requests, orjson.dumps(request) + b"\n")
        line = b""
        while not line.endswith(b"\n"):
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._replies], [], [], wait)
            if not ready:
                self._stop()
                raise PdfRenderTimeout(time_limit_s)
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                self._stop()
                raise _ChildGone(f"PDFium's process died on this file while doing {request['op']!r} "
                                 f"(a crash on hostile bytes)")
            line += chunk
        reply = orjson.loads(line)
        if "error_kind" in reply:
            raise ImageError(reply["detail"], error_kind=reply["error_kind"])
        return reply

    def _start(self) -> None:
        _pdfium()  # imported here first: a missing one is said as such, not as a child that died
        self._input = mmap.mmap(-1, max(1, self.max_bytes))
        self._pixels = mmap.mmap(-1, max(1, self.max_pixels) * 3)
        self._scans = mmap.mmap(-1, max(1, self.max_bytes))  # a scanned page's JPEG (only what is written is memory)
        to_child, self._requests = os.pipe()
        self._replies, from_child = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(self._requests)
                os.close(self._replies)
                _serve(to_child, from_child, self._input, self._pixels, self._scans)
            finally:
                os._exit(0)
        os.close(to_child)
        os.close(from_child)
        self._pid = pid
        # A renderer dropped without close() takes its child with it.
        self._finalizer = weakref.finalize(self, _end_child, pid, self._requests, self._replies)

    def _stop(self) -> None:
        if not self._pid:
            return
        self._finalizer()
        self._pid = 0
        self._opened = None
        self._input.close()
        self._pixels.close()
        self._scans.close()


def _end_child(pid: int, *fds: int) -> None:
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


class _ChildGone(CorruptPdf):
    pass


def _serve(requests: int, replies: int, source: mmap.mmap, pixels: mmap.mmap, scans: mmap.mmap) -> None:
    """The child's loop: one JSON request a line, one JSON reply a line, until the parent closes the pipe."""
    import ctypes

    import pypdfium2

    document = None
    with os.fdopen(requests, "rb") as inbox, os.fdopen(replies, "wb", buffering=0) as outbox:
        for line in inbox:
            request = orjson.loads(line)
            try:
                if request["op"] == "open":
                    if document is not None:
                        document.close()
                        document = None
                    try:
                        document = pypdfium2.PdfDocument(bytes(source[: request["bytes"]]))
                    except pypdfium2.PdfiumError as exc:
                        raise _open_failure(exc) from exc
                    reply = {"pages": len(document)}
                elif request["op"] == "size":
                    width, height = page_size(document, request["page"])
                    scanned = full_page_jpeg(document, request["page"]) if request["scan"] else None
                    reply = {"width": width, "height": height, "scan": 0, "text": ""}
                    if scanned is not None and len(scanned) <= len(scans):
                        scans[: len(scanned)] = scanned
                        reply.update(scan=len(scanned), text=page_text(document, request["page"], request["text"]))
                else:
                    width, height = request["width"], request["height"]
                    target = (ctypes.c_ubyte * (width * height * 3)).from_buffer(pixels)
                    render_page(document, request["page"], width, height, out=target)
                    del target
                    reply = {"text": page_text(document, request["page"], request["text"])}
            except ImageError as exc:
                reply = {"error_kind": exc.error_kind, "detail": str(exc)}
            except Exception as exc:  # noqa: BLE001 - anything PDFium or its binding throws is this page's
                reply = {"error_kind": CorruptPdf.error_kind, "detail": f"PDFium: {type(exc).__name__}: {exc}"}
            outbox.write(orjson.dumps(reply) + b"\n")


def full_page_jpeg(document, number: int) -> bytes | None:
    """The JPEG of a page that is exactly one DCT-coded RGB or grey image covering its box upright (no rotation,
    no flip, no mask, nothing else drawn): a scanner's page. None for any other page."""
    import pypdfium2
    import pypdfium2.raw as pdfium_c

    page = document[number - 1]
    try:
        if page.get_rotation() != 0 or pdfium_c.FPDFPage_CountObjects(page) != 1:
            return None
        [image] = page.get_objects(max_depth=0)
        if image.type != pdfium_c.FPDF_PAGEOBJ_IMAGE or image.get_filters() != ["DCTDecode"]:
            return None
        if pdfium_c.FPDFPageObj_HasTransparency(image):
            return None
        if image.get_metadata().colorspace not in (pdfium_c.FPDF_COLORSPACE_DEVICERGB,
                                                   pdfium_c.FPDF_COLORSPACE_DEVICEGRAY):
            return None
        left, bottom, right, top = page.get_bbox()
        m = image.get_matrix()
        placed = (m.a, m.b, m.c, m.d, m.e, m.f)
        wanted = (right - left, 0, 0, top - bottom, left, bottom)
        if any(abs(got - want) > 0.5 for got, want in zip(placed, wanted)):
            return None
        return bytes(image.get_data(decode_simple=False))
    except (pypdfium2.PdfiumError, ValueError):
        return None
    finally:
        page.close()


def render_page(document, number: int, width: int, height: int, out=None) -> np.ndarray | None:
    """Page ``number`` drawn straight into a ``height`` x ``width`` RGB bitmap in this process (the page's
    displayed box mapped onto it: a scale per axis, which for a target rounded from the page's aspect differs by
    under a pixel), white beneath, annotations' appearances drawn, forms not. Into ``out`` (a ctypes buffer of
    width * height * 3 bytes) when given, else returned. Unbounded: ``PageRenderer`` bounds it."""
    import pypdfium2
    import pypdfium2.raw as pdfium_c

    try:
        page = document[number - 1]
    except pypdfium2.PdfiumError as exc:
        raise CorruptPdf(f"PDF page {number} cannot be loaded: {exc}") from exc
    bitmap = pypdfium2.PdfBitmap.new_native(width, height, pdfium_c.FPDFBitmap_BGR, rev_byteorder=True, buffer=out)
    try:
        bitmap.fill_rect((255, 255, 255, 255), 0, 0, width, height)
        pdfium_c.FPDF_RenderPageBitmap(bitmap, page, 0, 0, width, height, 0,
                                       pdfium_c.FPDF_ANNOT | pdfium_c.FPDF_REVERSE_BYTE_ORDER)
        return None if out is not None else np.array(bitmap.to_numpy(), copy=True)
    finally:
        bitmap.close()
        page.close()


def page_text(document, number: int, limit: int) -> str:
    """The first ``limit`` characters of page ``number``'s text layer ('' for a scan without one)."""
    import pypdfium2

    if limit <= 0:
        return ""
    try:
        page = document[number - 1]
    except pypdfium2.PdfiumError as exc:
        raise CorruptPdf(f"PDF page {number} cannot be loaded: {exc}") from exc
    try:
        text = page.get_textpage()
        try:
            return text.get_text_range(0, min(text.count_chars(), limit))
        finally:
            text.close()
    except pypdfium2.PdfiumError:
        return ""  # a text layer PDFium cannot read leaves the page's pixels as good as they were
    finally:
        page.close()


def _open_failure(exc: Exception) -> ImageError:
    import pypdfium2.raw as pdfium_c

    code = getattr(exc, "err_code", None)
    if code in (pdfium_c.FPDF_ERR_PASSWORD, pdfium_c.FPDF_ERR_SECURITY):
        return PdfEncrypted(f"encrypted PDF (PDFium: {exc}); vlmstream opens no password-protected document")
    return CorruptPdf(f"PDF that PDFium cannot open: {exc}")
