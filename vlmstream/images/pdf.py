"""PDF documents through PDFium (pypdfium2): the page count without rendering, a page's displayed size, a page
rendered straight into a bitmap of the caller's size, and its text layer. Producers count pages to publish each page
of a PDF as ``URI#page=N``; the decode stage renders the page a URI names; ``vlmstream view`` its thumbnails.

PDFs are hostile input, so: PDFium is not thread-safe and every use holds one lock (``open_document``); no form
environment is ever initialised and pypdfium2's PDFium is built without V8, so a document's JavaScript never runs
(``runs_no_scripts`` says so at run time); a page is parsed and drawn in a forked child that is killed past its time
limit (``render_page_bounded``), so a page that never finishes, or crashes PDFium, costs that page, not the worker.
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
    try:
        import pypdfium2
    except ImportError as exc:  # an environment installed before PDFs were read: every PDF says so, no worker stops
        raise ImageError("PDF: pypdfium2, a dependency of vlmstream, is not installed here (install vlmstream "
                         "again: scripts/setup.sh)", error_kind="decode_unsupported") from exc

    with _LOCK:
        try:
            document = pypdfium2.PdfDocument(source if isinstance(source, (bytes, str)) else str(source))
        except pypdfium2.PdfiumError as exc:
            raise _open_failure(exc) from exc
        try:
            yield document
        finally:
            document.close()


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
    pixels: np.ndarray  # RGB, at the size ``size_for`` gave
    width_pt: float  # the page as displayed (its /Rotate applied)
    height_pt: float
    text: str


def render_page_bounded(document, number: int, size_for: Callable[[float, float], tuple[int, int]], *,
                        max_pixels: int, time_limit_s: float = 0.0, text_chars: int = 0) -> RenderedPage:
    """Page ``number`` (from 1) of an open document, rendered in a forked child at ``size_for(width_pt,
    height_pt)`` = (width, height) pixels, at most ``max_pixels``, with its first ``text_chars`` characters of
    text. PDFium parses and draws in C, where neither a signal nor a pause callback reaches into a nested form
    drawn a million times over; a child can be stopped: past ``time_limit_s`` (0: none) it is killed and the page
    is a ``PdfRenderTimeout``. A child that dies (PDFium crashing on hostile bytes) leaves a ``CorruptPdf``; the
    caller's process lives on either way. ``size_for`` may raise ``ImageError`` (a size over a cap): the child
    reports it. Call with ``open_document``'s lock held (the child inherits the open document)."""
    buffer = mmap.mmap(-1, max(1, max_pixels) * 3)
    read_end, write_end = os.pipe()
    deadline = time.monotonic() + time_limit_s if time_limit_s > 0 else None
    pid = os.fork()
    if pid == 0:  # the child: render, reply, leave without running the parent's exit handlers
        try:
            os.close(read_end)
            try:
                reply = _render_into(buffer, document, number, size_for, max_pixels, text_chars)
            except ImageError as exc:
                reply = {"error_kind": exc.error_kind, "detail": str(exc)}
            except BaseException as exc:  # noqa: BLE001 - anything PDFium or its binding throws is the page's
                reply = {"error_kind": CorruptPdf.error_kind, "detail": f"PDFium: {type(exc).__name__}: {exc}"}
            with os.fdopen(write_end, "wb") as out:
                out.write(orjson.dumps(reply))
        finally:
            os._exit(0)
    os.close(write_end)
    reaped = False
    try:
        reply = _read_reply(read_end, deadline, time_limit_s)
        os.waitpid(pid, 0)
        reaped = True
    finally:
        os.close(read_end)
        if not reaped:  # past the time limit, or the caller's own alarm (decode.decode_time_limit_s)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if reply is None:
        raise CorruptPdf(f"PDFium's render of page {number} died without an answer (a crash on this file)")
    if "error_kind" in reply:
        raise ImageError(reply["detail"], error_kind=reply["error_kind"])
    width, height = reply["width"], reply["height"]
    pixels = np.frombuffer(buffer, np.uint8, width * height * 3).reshape(height, width, 3).copy()
    buffer.close()
    return RenderedPage(pixels, reply["width_pt"], reply["height_pt"], reply["text"])


def _read_reply(read_end: int, deadline: float | None, time_limit_s: float) -> dict | None:
    """The child's JSON reply, read until it closes the pipe; None when it died without one."""
    parts = []
    while True:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([read_end], [], [], wait)
        if not ready:
            raise PdfRenderTimeout(time_limit_s)
        chunk = os.read(read_end, 1 << 16)
        if not chunk:
            break
        parts.append(chunk)
    try:
        return orjson.loads(b"".join(parts)) if parts else None
    except orjson.JSONDecodeError:
        return None


def _render_into(buffer: mmap.mmap, document, number: int, size_for, max_pixels: int, text_chars: int) -> dict:
    width_pt, height_pt = page_size(document, number)
    width, height = size_for(width_pt, height_pt)
    if width * height > max_pixels:
        raise ImageError(f"render size {width}x{height} is over {max_pixels} pixels", error_kind="decode_internal")
    pixels = render_page(document, number, width, height)
    buffer[: pixels.nbytes] = pixels.tobytes()
    return {"width": width, "height": height, "width_pt": width_pt, "height_pt": height_pt,
            "text": page_text(document, number, text_chars)}


def render_page(document, number: int, width: int, height: int) -> np.ndarray:
    """Page ``number`` drawn straight into a ``height`` x ``width`` RGB bitmap in this process (the page's
    displayed box mapped onto it: a scale per axis, which for a target rounded from the page's aspect differs by
    under a pixel), white beneath, annotations' appearances drawn, forms not. Unbounded: see
    ``render_page_bounded``."""
    import pypdfium2
    import pypdfium2.raw as pdfium_c

    try:
        page = document[number - 1]
    except pypdfium2.PdfiumError as exc:
        raise CorruptPdf(f"PDF page {number} cannot be loaded: {exc}") from exc
    bitmap = pypdfium2.PdfBitmap.new_native(width, height, pdfium_c.FPDFBitmap_BGR, rev_byteorder=True)
    try:
        bitmap.fill_rect((255, 255, 255, 255), 0, 0, width, height)
        pdfium_c.FPDF_RenderPageBitmap(bitmap, page, 0, 0, width, height, 0,
                                       pdfium_c.FPDF_ANNOT | pdfium_c.FPDF_REVERSE_BYTE_ORDER)
        return np.array(bitmap.to_numpy(), copy=True)
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
