"""The decode stage: a URI in, a ``PreparedImage`` (pixels at exactly the model family's input size) or an
``ImageFailure`` out. No Kafka here; ``consumers/decode/runner.py`` owns the clients and the commits.

One call = fetch -> sniff + decode (DCT-scaled for JPEG; a PDF page rendered at the target size) -> exact resize -> EXIF orientation -> encode.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

from vlmstream.images.claimcheck import ClaimCheckStore
from vlmstream.images.payload import encode
from consumers.decode.decoder import Decoder
from consumers.decode.errors import DecodeTimeout
from vlmstream.images.pages import split_page
from vlmstream.images.fetch import Fetcher
from consumers.decode.resize import apply_orientation, resize_exact
from vlmstream.images.errors import ImageError
from consumers.decode.types import ImageFailure, PreparedImage, Stage
from vlmstream.models.family import ModelFamily
from vlmstream.models.registry import family_named, family_of

log = logging.getLogger(__name__)

# Source size classes for metrics labels (megapixels of the upright source image).
SIZE_CLASSES = ((0.5, "lt0.5mp"), (2.0, "0.5-2mp"), (8.0, "2-8mp"), (24.0, "8-24mp"))


def size_class(width: int, height: int) -> str:
    megapixels = width * height / 1e6
    for limit, name in SIZE_CLASSES:
        if megapixels < limit:
            return name
    return "ge24mp"


def decode_family(settings) -> ModelFamily:
    """The family the images are resized for, with the pixel limits they are resized within: the checkpoint's
    (``decode.model``: its config.json's family, the user's min_pixels/max_pixels within the limits of its image
    processor settings, since its processor would resize anything outside them), else ``decode.model_family`` with
    the user's limits as they are."""
    model = getattr(settings, "model", "")
    if not model:
        return family_named(settings.model_family).with_pixel_limits(settings.min_pixels, settings.max_pixels)
    checkpoint = family_of(model)
    low = max(settings.min_pixels, checkpoint.min_pixels)
    high = min(settings.max_pixels, checkpoint.max_pixels)
    return checkpoint.with_pixel_limits(min(low, high), high)


class DecodeStage(Stage):
    """``stage(uri) -> PreparedImage | ImageFailure``; never raises. Known bad input gets a stable error_kind
    (see fetch.py, errors.py, vlmstream/models/qwen2_vl.py); anything a library throws unexpectedly becomes ``decode_unexpected``
    and is logged with its traceback, so one hostile file cannot stop a partition.

    ``store`` is the claim-check store for payloads over the record limit; the runner decides when to use it."""

    def __init__(self, settings, claim_check_url: str = "", *, fetcher: Fetcher | None = None,
                 use_turbojpeg: bool = True):
        self.settings = settings
        self.family = decode_family(settings)
        self.fetcher = fetcher or Fetcher.from_settings(settings)
        self.decoder = Decoder(
            family=self.family,
            max_source_pixels=settings.max_source_pixels,
            use_turbojpeg=use_turbojpeg,
            pdf_dpi=getattr(settings, "pdf_dpi", 200.0),
            max_pdf_pages=getattr(settings, "max_pdf_pages", 1000),
            pdf_render_time_limit_s=getattr(settings, "pdf_render_time_limit_s", 0.0),
            pdf_page_text_chars=getattr(settings, "pdf_page_text_chars", 0),
            max_pdf_bytes=getattr(settings, "max_image_bytes", 64 * 1024 * 1024),
        )
        self.store = ClaimCheckStore(claim_check_url) if claim_check_url else None
        # (location, bytes) of the last file a ``#page=N`` URI named: a document's pages of one PDF or TIFF come one
        # after another, and its bytes (a remote PDF's download) are fetched once for them all, until end_document.
        self._held: tuple[str, bytes] | None = None

    def __call__(self, uri: str) -> PreparedImage | ImageFailure:
        try:
            started = time.perf_counter()
            location, page = split_page(uri)
            if page is not None and self._held is not None and self._held[0] == location:
                data = self._held[1]
            else:
                self._held = None
                data = self.fetcher.fetch(location)
                if page is not None:
                    self._held = (location, data)
            fetched = time.perf_counter()
            return self.prepare(data, fetch_ms=(fetched - started) * 1000, page=page)
        except ImageError as error:
            return ImageFailure.from_error(error)
        except MemoryError:
            # Another image on this worker may have held the memory; the same input can succeed later.
            return ImageFailure("decode_out_of_memory", f"out of memory preparing {uri[:200]}", True)
        except Exception as exc:  # a library choking on hostile bytes must not stop the partition
            log.exception("unexpected error preparing %s", uri[:200])
            return ImageFailure("decode_unexpected", f"{type(exc).__name__}: {exc}"[:500], False)

    def prepare(self, data: bytes, *, fetch_ms: float = 0.0, page: int | None = None) -> PreparedImage:
        """Bytes already in memory -> PreparedImage; raises ImageError (``__call__`` turns it into a value).
        ``page``: which page of a multi-page file (from 1); None = the first, and ``pages`` says how many."""
        with time_limit(getattr(self.settings, "decode_time_limit_s", 0.0)):
            t0, cpu0 = time.perf_counter(), time.thread_time()
            decoded = self.decoder.decode(data, page)
            t1 = time.perf_counter()
            stored_h, stored_w = decoded.stored_target
            pixels = apply_orientation(resize_exact(decoded.pixels, stored_h, stored_w), decoded.orientation)
            t2 = time.perf_counter()
            payload = encode(pixels, self.settings.codec, jpeg_quality=self.settings.jpeg_quality)
            t3, cpu3 = time.perf_counter(), time.thread_time()
        height, width = pixels.shape[:2]
        timings = {
            "fetch_ms": fetch_ms,
            "decode_ms": (t1 - t0) * 1000,
            "resize_ms": (t2 - t1) * 1000,
            "encode_ms": (t3 - t2) * 1000,
            "dct_scale": decoded.scale,
            "source_mp": decoded.width * decoded.height / 1e6,
        }
        return PreparedImage(
            data=payload,
            codec=self.settings.codec,
            width=width,
            height=height,
            orig_width=decoded.width,
            orig_height=decoded.height,
            grid_thw=self.family.grid_thw(height, width),
            source_format=decoded.source_format,
            decode_ms=(t2 - t0) * 1000,
            fetch_bytes=len(data),
            timings=timings,
            pages=decoded.pages,
            page_text=decoded.text,
            prepare_cpu_ms=(cpu3 - cpu0) * 1000,
        )

    def end_document(self) -> None:
        """The document's images are done: the next one fetches its files afresh."""
        self._held = None

    def close(self) -> None:
        self._held = None
        self.fetcher.close()
        self.decoder.close()


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raises DecodeTimeout in the block after ``seconds``. Some of Pillow's decoders are pure Python and
    quadratic on hostile input (an RLE BMP of 56 KB took 21 s of CPU); the bytes will take as long next time, so
    the failure is not retriable. Only the main thread can take the alarm; elsewhere the block runs unbounded."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise DecodeTimeout(f"decoding took longer than {seconds:g}s (decode.decode_time_limit_s)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
