"""PDFs as documents of pages: the folder source, manifests and stdin publish one URI per page (a remote PDF fetched
to count them), the decode stage renders each page at the family's input size for its displayed shape, within the
image tolerance of the processor on a 200 dpi raster, and every hostile file is a failure value naming its setting,
the worker unharmed."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.decode.stage import DecodeStage
from consumers.decode.types import ImageFailure, PreparedImage
from producers.folder import scan_folder
from tests import images, pdfs
from vlmstream.config import DecodeSettings
from vlmstream.images import pdf
from vlmstream.images.payload import decode as decode_payload
from vlmstream.models.qwen2_vl import smart_resize

BUDGET = 256 * 28 * 28


def make_stage(tmp_path, **overrides) -> DecodeStage:
    return DecodeStage(DecodeSettings(allowed_roots=[str(tmp_path)], codec="raw", max_pixels=BUDGET, **overrides), "")


def pixels_of(result: PreparedImage) -> np.ndarray:
    assert isinstance(result, PreparedImage), result
    return decode_payload(result.data, "raw", result.height, result.width)


def test_each_page_is_rendered_at_the_family_size_for_its_displayed_shape(tmp_path):
    """Letter portrait, A4 landscape, and letter turned by /Rotate 90: the target is smart_resize of the page as
    displayed at decode.pdf_dpi, and the page comes out upright (its blue box where the rotation puts it)."""
    path = tmp_path / "mixed.pdf"
    path.write_bytes(pdfs.text_pdf([(612, 792, 0, "portrait"), (842, 595, 0, "landscape"),
                                    (612, 792, 90, "turned")]))
    stage = make_stage(tmp_path, pdf_page_text_chars=40)
    shown = {1: (612, 792), 2: (842, 595), 3: (792, 612)}
    for page, (width_pt, height_pt) in shown.items():
        result = stage(f"{path}#page={page}")
        pixels = pixels_of(result)
        width, height = round(width_pt * 200 / 72), round(height_pt * 200 / 72)
        assert (result.orig_width, result.orig_height) == (width, height)
        assert (result.height, result.width) == smart_resize(height, width, 28, 56 * 56, BUDGET)
        assert result.source_format == "pdf" and result.pages == 1
        assert result.page_text == ["portrait", "landscape", "turned"][page - 1]
        blue = np.argwhere((pixels[..., 2] > 200) & (pixels[..., 0] < 60))
        assert len(blue), page
        row, column = blue.mean(axis=0) / pixels.shape[:2]
        # Unrotated pages: the box at the bottom left. Turned 90 degrees clockwise: at the top left.
        assert column < 0.3 and (row < 0.3 if page == 3 else row > 0.7), (page, row, column)


def test_a_scanned_page_is_its_image_at_the_model_size(tmp_path):
    path = tmp_path / "scan.pdf"
    path.write_bytes(pdfs.scanned_pdf([(600, 800), (900, 500)]))
    stage = make_stage(tmp_path)
    first = pixels_of(stage(f"{path}#page=1"))
    second = stage(f"{path}#page=2")
    assert second.width > second.height  # the landscape scan stays landscape
    # The red block drawn on the scan at (1/8..1/3, 1/8..1/4) of the page is where the page puts it.
    red = np.argwhere((first[..., 0] > 170) & (first[..., 1] < 80))
    row, column = red.mean(axis=0) / first.shape[:2]
    assert 0.1 < column < 0.35 and 0.1 < row < 0.28, (row, column)


def test_a_pdf_named_without_a_page_is_its_first_page_and_says_how_many(tmp_path):
    path = tmp_path / "three.pdf"
    path.write_bytes(pdfs.text_pdf([(612, 792, 0, "one"), (612, 792, 0, "two"), (612, 792, 0, "three")]))
    stage = make_stage(tmp_path)
    result = stage(str(path))
    assert isinstance(result, PreparedImage) and result.pages == 3
    beyond = stage(f"{path}#page=4")
    assert isinstance(beyond, ImageFailure) and beyond.error_kind == "decode_page_out_of_range"


def test_a_folder_publishes_each_pdf_page_and_mixes_pdfs_with_images(tmp_path):
    book = tmp_path / "book"
    book.mkdir()
    (book / "a-cover.png").write_bytes(b"not checked here")
    (book / "b-report.pdf").write_bytes(pdfs.text_pdf([(612, 792, 0, "1"), (612, 792, 0, "2")]))
    (book / "c-broken.pdf").write_bytes(b"%PDF-1.7 nothing more")
    (book / "d-long.pdf").write_bytes(pdfs.many_pages(4))
    [doc] = list(scan_folder(tmp_path, max_pdf_pages=3))
    report = book / "b-report.pdf"
    # The broken one goes as it is (decode names what is wrong); so does one over the page limit (decode refuses it
    # naming decode.max_pdf_pages).
    assert doc.image_uris == (str(book / "a-cover.png"), f"{report}#page=1", f"{report}#page=2",
                              str(book / "c-broken.pdf"), str(book / "d-long.pdf"))


def test_counting_pages_renders_nothing(tmp_path):
    """The producer's count reads the page tree: a PDF whose only page takes hours to draw counts at once."""
    path = tmp_path / "slow.pdf"
    path.write_bytes(pdfs.endless_render())
    started = time.process_time()
    assert pdf.count_pages(path) == 1
    assert time.process_time() - started < 1.0


def test_scripts_never_run(tmp_path):
    """pypdfium2's PDFium has no JavaScript engine, and no form environment is set up: a PDF whose open action is
    a script renders as its page and nothing else."""
    assert pdf.runs_no_scripts()
    path = tmp_path / "script.pdf"
    path.write_bytes(pdfs.javascript_pdf())
    plain = tmp_path / "plain.pdf"
    plain.write_bytes(pdfs.text_pdf([(612, 792, 0, "scripted")]))
    stage = make_stage(tmp_path)
    assert np.array_equal(pixels_of(stage(str(path))), pixels_of(stage(str(plain))))


@pytest.mark.parametrize("name", sorted(pdfs.hostile_set(3)))
def test_hostile_pdfs_are_failure_values_naming_their_setting(tmp_path, name):
    data, kind, words = pdfs.hostile_set(3)[name]
    path = tmp_path / f"{name}.pdf"
    path.write_bytes(data)
    stage = make_stage(tmp_path, max_pdf_pages=3, pdf_render_time_limit_s=1.0)
    started = time.monotonic()
    result = stage(str(path))
    assert isinstance(result, ImageFailure), result
    assert (result.error_kind, result.retriable) == (kind, False), result.detail
    assert words in result.detail
    assert time.monotonic() - started < 20
    # The worker goes on: the next page decodes.
    good = tmp_path / "good.pdf"
    good.write_bytes(pdfs.text_pdf([(612, 792, 0, "after")]))
    assert isinstance(stage(str(good)), PreparedImage)


def _children() -> set[int]:
    return {int(pid) for task in os.listdir("/proc/self/task")
            for pid in open(f"/proc/self/task/{task}/children").read().split()}


def test_pages_render_in_one_child_that_a_timeout_or_close_ends(tmp_path):
    slow, good = tmp_path / "slow.pdf", tmp_path / "good.pdf"
    slow.write_bytes(pdfs.endless_render())
    good.write_bytes(pdfs.text_pdf([(612, 792, 0, "one"), (612, 792, 0, "two")]))
    before = _children()
    stage = make_stage(tmp_path, pdf_render_time_limit_s=0.5)
    assert isinstance(stage(f"{good}#page=1"), PreparedImage) and isinstance(stage(f"{good}#page=2"),
                                                                             PreparedImage)
    [renderer] = _children() - before  # both pages from one child
    result = stage(str(slow))
    assert isinstance(result, ImageFailure) and result.error_kind == "decode_pdf_render_timeout"
    assert _children() == before  # killed and reaped
    assert isinstance(stage(f"{good}#page=1"), PreparedImage)  # a new child for the next page
    assert len(_children() - before) == 1
    stage.close()
    assert _children() == before


SAMPLES = [pdfs.text_pdf([(612, 792, 0, "fuzzed"), (300, 300, 90, "second")]),
           pdfs.scanned_pdf([(160, 200), (200, 120)])]  # the scan's JPEGs take the decoder's JPEG path


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_pdfs_give_values_not_exceptions(tmp_path, data):
    path = tmp_path / "damaged.pdf"
    path.write_bytes(images.damaged(data, data.draw(st.sampled_from(SAMPLES))))
    stage = make_stage(tmp_path, pdf_render_time_limit_s=5.0)
    for uri in (str(path), f"{path}#page=2"):
        result = stage(uri)
        assert isinstance(result, (PreparedImage, ImageFailure))
        if isinstance(result, ImageFailure):
            assert result.error_kind in {"decode_corrupt", "decode_truncated", "decode_page_out_of_range",
                                         "decode_not_an_image", "decode_bad_aspect", "decode_too_many_pixels",
                                         "decode_pdf_encrypted", "decode_pdf_render_timeout"}, \
                (result.error_kind, result.detail)
        else:
            assert len(result.data) == result.width * result.height * 3


def test_the_view_page_shows_a_thumbnail_of_each_pdf_page(tmp_path):
    import io

    from PIL import Image
    from starlette.testclient import TestClient

    from vlmstream.cli.view_page import ViewState, make_app
    from vlmstream.config import load_settings

    path = tmp_path / "two.pdf"
    path.write_bytes(pdfs.text_pdf([(612, 792, 0, "tall"), (842, 595, 0, "wide")]))
    (tmp_path / "slow.pdf").write_bytes(pdfs.endless_render())
    settings = load_settings()
    settings = settings.model_copy(update={"decode": settings.decode.model_copy(
        update={"allowed_roots": [str(tmp_path)], "pdf_render_time_limit_s": 1.0})})
    client = TestClient(make_app(settings, ViewState(10)), base_url="http://127.0.0.1")
    sizes = []
    for page in (1, 2):
        answer = client.get("/thumbnail", params={"uri": f"{path}#page={page}"})
        assert answer.status_code == 200, answer.text
        sizes.append(Image.open(io.BytesIO(answer.content)).size)
    thumb = settings.view.thumbnail_px
    assert sizes == [(round(612 * thumb / 792), thumb), (thumb, round(595 * thumb / 842))]
    assert client.get("/thumbnail", params={"uri": f"{path}#page=3"}).status_code == 415
    endless = client.get("/thumbnail", params={"uri": str(tmp_path / "slow.pdf")})
    assert endless.status_code == 415 and "decode.pdf_render_time_limit_s" in endless.text


def test_the_parquet_export_has_the_page_of_each_record():
    from schemas import DeadLetter, Description
    from vlmstream.cli.export_parquet import _row

    described = Description(doc_id="d", image_index=1, image_count=2, text="a page", model="m", prompt_id="p",
                            engine="e", source_uri="/scans/report.pdf#page=2")
    assert _row("descriptions", described.encode())["page"] == 2
    letter = DeadLetter(stage="decode", error_kind="decode_pdf_encrypted", detail="encrypted", doc_id="d",
                        image_index=0, image_count=2, source_uri="/scans/report.pdf#page=1")
    assert _row("deadletter", letter.encode())["page"] == 1
    photo = Description(doc_id="d", image_index=0, image_count=2, text="a photo", model="m", prompt_id="p",
                        engine="e", source_uri="/scans/cover.jpg")
    assert _row("descriptions", photo.encode())["page"] is None


def test_a_scanned_page_decodes_its_own_jpeg_like_pdfium_draws_it(tmp_path):
    """A page that is one JPEG covering it (a scanner's page) is decoded from the JPEG and shrunk to the target
    instead of drawn: the same size and nearly the same pixels as PDFium's drawing of it."""
    from consumers.decode.decoder import Decoder

    data = pdfs.scanned_pdf([(1200, 1600), (1500, 900)])
    fast = Decoder(max_pixels=BUDGET)
    drawn = Decoder(max_pixels=BUDGET, use_turbojpeg=False)  # no JPEG decoder here: PDFium draws every page
    for page in (1, 2):
        scanned = fast.decode(data, page)
        reference = drawn.decode(data, page)
        assert scanned.target_width == reference.target_width and scanned.target_height == reference.target_height
        assert scanned.pixels.shape[:2] == reference.pixels.shape[:2] == (reference.target_height,
                                                                          reference.target_width)
        ours = scanned.pixels.astype(np.int16)
        assert np.abs(ours - reference.pixels.astype(np.int16)).mean() < 4, page
    text = fast.decode(pdfs.text_pdf([(612, 792, 0, "typed")]), 1)
    assert text.pixels.shape[:2] == (text.target_height, text.target_width)  # drawn: not a scan
    fast.close()
    drawn.close()


# The image path's tolerance (tests/test_decode_equivalence.py) at three budgets: 0.2 MP, 1 MP, the default.
PIXEL_BUDGETS = (256 * 28 * 28, 1280 * 28 * 28, 16384 * 28 * 28)
REPORT_PAGES = [(612, 792, 0), (842, 595, 0), (612, 792, 90)]  # letter, A4 landscape, letter turned by /Rotate


def processor_route(raster: np.ndarray, height: int, width: int) -> np.ndarray:
    """A 200 dpi raster of a page taken to the model's size by transformers' Qwen2VLImageProcessor (its resize)."""
    from transformers import Qwen2VLImageProcessor
    from transformers.image_transforms import resize

    return resize(raster, (height, width), resample=Qwen2VLImageProcessor().resample,
                  input_data_format="channels_last")


def normalised_diff(ours: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(mean, 99th percentile) of |diff| of the two as the model gets them (CLIP mean/std normalisation)."""
    mean = np.asarray((0.48145466, 0.4578275, 0.40821073), np.float32)
    std = np.asarray((0.26862954, 0.26130258, 0.27577711), np.float32)
    diff = np.abs((ours.astype(np.float32) - reference.astype(np.float32)) / 255.0 / std)
    return float(diff.mean()), float(np.percentile(diff, 99))


def decoded_pages(tmp_path, data: bytes, budget: int):
    """(page, the decode stage's pixels, the page's 200 dpi width and height) of each page of ``data``."""
    path = tmp_path / f"pages-{budget}.pdf"
    path.write_bytes(data)
    stage = DecodeStage(DecodeSettings(allowed_roots=[str(tmp_path)], codec="raw", max_pixels=budget), "")
    try:
        for page in range(1, pdf.count_pages(data) + 1):
            result = stage(f"{path}#page={page}")
            yield page, pixels_of(result), result.orig_width, result.orig_height
    finally:
        stage.close()


def test_typed_pages_are_within_the_image_tolerance_of_the_processor_on_a_200_dpi_raster(tmp_path):
    """Typed pages (10 pt text, thin rules, fills; three sizes and rotations) against PDFium drawing each page at
    200 dpi and the processor resizing that raster: the tolerance the image path holds, mean and 99th percentile,
    at every budget (drawn at the model's size the 99th percentile is 1.1-1.3, drawn at 3x it and shrunk 0.34-0.51
    at 0.2 MP: glyphs hinted to another pixel grid than the 200 dpi raster's)."""
    import pypdfium2

    from tests.test_decode_equivalence import MEAN_LIMIT, P99_LIMIT

    data = pdfs.report_pdf(REPORT_PAGES)
    document = pypdfium2.PdfDocument(data)
    for budget in PIXEL_BUDGETS:
        for page, pixels, width, height in decoded_pages(tmp_path, data, budget):
            reference = processor_route(pdf.render_page(document, page, width, height), *pixels.shape[:2])
            mean, p99 = normalised_diff(pixels, reference)
            assert mean < MEAN_LIMIT and p99 < P99_LIMIT, (budget, page, mean, p99)
    document.close()


def test_scanned_pages_are_within_the_image_tolerance_of_the_processor_on_their_own_jpeg(tmp_path):
    """Scanned pages (a 300 dpi letter, an A4 at 200 dpi: dark rules and a filled block on paper noise, sharp edges a
    photo has few of) through the decode stage against the processor on the page's own JPEG decoded whole: the image
    tolerance, mean and 99th percentile, at every budget (the JPEG at a DCT scale near the target, as a photo is
    taken, is p99 0.53-0.64 from it)."""
    import io

    import pypdfium2
    from PIL import Image

    from tests.test_decode_equivalence import MEAN_LIMIT, P99_LIMIT

    data = pdfs.ruled_scan_pdf()
    document = pypdfium2.PdfDocument(data)
    own = []
    for index in range(len(document)):
        [jpeg] = document[index].get_objects()
        own.append(np.asarray(Image.open(io.BytesIO(bytes(jpeg.get_data()))).convert("RGB")))
    document.close()
    for budget in PIXEL_BUDGETS:
        for page, pixels, _width, _height in decoded_pages(tmp_path, data, budget):
            mean, p99 = normalised_diff(pixels, processor_route(own[page - 1], *pixels.shape[:2]))
            assert mean < MEAN_LIMIT and p99 < P99_LIMIT, (budget, page, mean, p99)


def shrink_test_pages(shape):
    """Three pages of one shape for the shrinks' tests: a dark block on grey (a scan's edges), lines of 1-3 px strokes
    (a typed page's glyphs), and noise."""
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    page = np.full((*shape, 3), 236, np.uint8)
    page[shape[0] // 5: shape[0] // 2, shape[1] // 7: shape[1] * 2 // 3] = (40, 40, 40)
    text = np.full((*shape, 3), 255, np.uint8)
    for row in range(shape[0] // 10, shape[0] * 9 // 10, 32):  # lines of 1-3 px strokes, a typed page's glyphs
        text[row: row + 18, shape[1] // 10: shape[1] * 9 // 10: 7] = 0
        text[row + 8: row + 10, shape[1] // 10: shape[1] * 9 // 10] = 0
    return page, text, noise


@pytest.mark.parametrize("shape", [(2200, 1700), (2339, 1653), (101, 77)])
def test_shrink_antialiased_is_pillows_reducing_gap_resize(shape):
    """The drawn pages' shrink, with the decoder's gaps, against Pillow's own antialiased bicubic after its box reduce
    (``Image.resize(..., BICUBIC, reducing_gap=2.0)``) at 1.3x to 10x, on a page with a dark block (a scan's edges),
    strokes 1-3 px wide (a typed page's glyphs) and noise: Pillow's resample itself, so within one level where no
    box reduce runs (float32 sums against Pillow's fixed point) and within two after one (cv2's box means round apart
    from Pillow's by a level, which the kernel's negative lobes can double), more than one level apart at under 2% of
    values, mean under 0.25 (measured: at most 1 level without a reduce; 2, at 1.5% of a text page's values, and mean
    0.21 at 10x)."""
    from PIL import Image

    from consumers.decode.decoder import PDF_LEAST_GAP, PDF_REDUCING_GAP
    from consumers.decode.resize import shrink_antialiased

    page, text, noise = shrink_test_pages(shape)
    for factor in (1.3, 2.1, 4.3, 10.0):
        height, width = max(1, round(shape[0] / factor)), max(1, round(shape[1] / factor))
        reduced = factor / PDF_REDUCING_GAP >= 2 or factor / 2 >= PDF_LEAST_GAP
        for name, image in (("page", page), ("text", text), ("noise", noise)):
            ours = shrink_antialiased(image, height, width, PDF_REDUCING_GAP, PDF_LEAST_GAP)
            pillow = np.asarray(Image.fromarray(image).resize((width, height), Image.BICUBIC,
                                                              reducing_gap=PDF_REDUCING_GAP))
            diff = np.abs(ours.astype(int) - pillow)
            assert ours.shape == pillow.shape, (name, factor, ours.shape, pillow.shape)
            assert diff.max() <= (2 if reduced else 1), (name, factor, diff.max())
            assert (diff > 1).mean() < 0.02 and diff.mean() < 0.25, (name, factor, (diff > 1).mean(), diff.mean())


@pytest.mark.parametrize("shape", [(2200, 1700), (2339, 1653), (101, 77)])
def test_shrink_filtered_is_near_pillows_reducing_gap_resize(shape):
    """The scans' shrink, with the decoder's gaps, against Pillow's own antialiased bicubic after its box reduce
    (``Image.resize(..., BICUBIC, reducing_gap=2.0)``), mean levels at 1.3x to 10x: on a page with a dark block (a
    scan's edges) within 2.5; on strokes 1-3 px wide (a typed page's glyphs) within 5 at 1.3x and 3 from 2x; on noise,
    the worst case for interpolating the filtered image, within 12 at 1.3x (kept frequencies the interpolation blurs)
    and 3.5 from 2x (measured 0.01-2.0; 3.3-4.0 and 1.1-2.6; 9.7 and 0.6-3.0)."""
    from PIL import Image

    from consumers.decode.decoder import PDF_LEAST_GAP, PDF_REDUCING_GAP
    from consumers.decode.resize import shrink_filtered

    page, text, noise = shrink_test_pages(shape)
    for factor in (1.3, 2.1, 4.3, 10.0):
        height, width = max(1, round(shape[0] / factor)), max(1, round(shape[1] / factor))
        for name, image, mean_limit in (("page", page, 2.5), ("text", text, 5.0 if factor < 2 else 3.0),
                                        ("noise", noise, 12.0 if factor < 2 else 3.5)):
            ours = shrink_filtered(image, height, width, PDF_REDUCING_GAP, PDF_LEAST_GAP)
            pillow = np.asarray(Image.fromarray(image).resize((width, height), Image.BICUBIC,
                                                              reducing_gap=PDF_REDUCING_GAP))
            diff = np.abs(ours.astype(int) - pillow)
            assert ours.shape == pillow.shape and diff.mean() < mean_limit, (name, factor, diff.mean())


@pytest.mark.parametrize("shape", [(2200, 1700), (2339, 1653), (101, 77)])
def test_box_reduce_is_pillows_reduce(shape):
    """The shrink's box reduce on cv2's integer area path against Pillow's ``Image.reduce``, edges whose boxes are
    cut short included: on noise, the box means round apart by one level at most, most pixels equal."""
    from PIL import Image

    from consumers.decode.resize import box_reduce

    image = np.random.default_rng(0).integers(0, 256, (*shape, 3), dtype=np.uint8)
    for kx, ky in ((2, 2), (3, 2), (4, 5), (7, 3)):
        ours = box_reduce(image, kx, ky)
        pillow = np.asarray(Image.fromarray(image).reduce((kx, ky)))
        diff = np.abs(ours.astype(int) - pillow)
        assert ours.shape == pillow.shape and diff.max() <= 1 and diff.mean() < 0.5, (kx, ky, diff.max(), diff.mean())


@pytest.mark.skipif(shutil.which("pdftoppm") is None, reason="pdftoppm (poppler-utils) is not installed")
def test_drawn_pages_are_within_the_image_tolerance_of_pdftoppm_and_the_processor(tmp_path):
    """Rules and filled shapes of three page sizes and rotations against `pdftoppm -r 200` and the processor's
    resize: within the image tolerance at every budget, so the page box, rotation, placement and colours are
    poppler's. (Text is not compared with poppler: two rasterisers draw glyphs apart by more than the tolerance at
    one and the same size; benchmarks/bench_pdf_render.py measures that.)"""
    import io
    import subprocess

    from PIL import Image

    from tests.test_decode_equivalence import MEAN_LIMIT, P99_LIMIT

    data = pdfs.report_pdf(REPORT_PAGES, text=False)
    (tmp_path / "drawn.pdf").write_bytes(data)
    for budget in PIXEL_BUDGETS:
        for page, pixels, width, height in decoded_pages(tmp_path, data, budget):
            raster = subprocess.run(["pdftoppm", "-r", "200", "-f", str(page), "-l", str(page),
                                     str(tmp_path / "drawn.pdf")], capture_output=True, check=True).stdout
            raster = np.asarray(Image.open(io.BytesIO(raster)).convert("RGB"))
            assert raster.shape[:2] == (height, width), page
            mean, p99 = normalised_diff(pixels, processor_route(raster, *pixels.shape[:2]))
            assert mean < MEAN_LIMIT and p99 < P99_LIMIT, (budget, page, mean, p99)


def test_a_manifest_or_stdin_document_naming_a_local_pdf_gets_each_page(tmp_path):
    import orjson

    from producers.items import with_pdf_pages
    from producers.manifest import read_manifest
    from producers.stdin import parse_stdin_line

    (tmp_path / "two.pdf").write_bytes(pdfs.text_pdf([(612, 792, 0, "1"), (612, 792, 0, "2")]))
    (tmp_path / "long.pdf").write_bytes(pdfs.many_pages(5))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(orjson.dumps(line).decode() for line in [
        {"doc_id": "a", "image_uris": ["two.pdf", "cover.jpg", f"file://{tmp_path}/two.pdf"]},
        {"doc_id": "b", "image_uris": ["two.pdf#page=2", "long.pdf", "https://example.org/remote.pdf"]},
    ]) + "\n")
    a, b = with_pdf_pages(read_manifest(manifest), max_pdf_pages=3)
    two = tmp_path / "two.pdf"
    assert a.image_uris == (f"{two}#page=1", f"{two}#page=2", str(tmp_path / "cover.jpg"),
                            f"file://{two}#page=1", f"file://{two}#page=2")
    # A page already named, a PDF over the limit (decode refuses it by name) and a remote one stay as they are.
    assert b.image_uris == (f"{two}#page=2", str(tmp_path / "long.pdf"), "https://example.org/remote.pdf")
    [line] = with_pdf_pages([parse_stdin_line(b"two.pdf", line=1, base_dir=tmp_path)], max_pdf_pages=3)
    assert line.image_uris == (f"{two}#page=1", f"{two}#page=2")


def test_page_text_fills_the_prompts_placeholder_and_nothing_else():
    from consumers.infer.prompts import instruction_for

    template = 'Describe the page. Text: {page_text}. Answer as {"kind": ...}'
    assert instruction_for(template, {"page_text": "Total 12"}) == (
        'Describe the page. Text: Total 12. Answer as {"kind": ...}')
    assert instruction_for(template, {}) == 'Describe the page. Text: . Answer as {"kind": ...}'
    assert instruction_for("Describe this image.", {"page_text": "unused"}) == "Describe this image."


@pytest.fixture
def pdf_server(tmp_path):
    """http.server on 127.0.0.1 serving ``tmp_path/served``, and the list of paths it was asked for."""
    import functools
    import http.server
    import threading

    served = tmp_path / "served"
    served.mkdir()
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            requests.append(self.path)
            super().do_GET()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(served)))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield served, f"http://127.0.0.1:{httpd.server_address[1]}", requests
    httpd.shutdown()
    httpd.server_close()


MIXED = [(612, 792, 0, "portrait"), (842, 595, 0, "landscape"), (612, 792, 90, "turned")]
SHOWN = [(612, 792), (842, 595), (792, 612)]  # each page as displayed: the third turned by /Rotate


def assert_pages_render_at_their_shapes(stage, uris):
    for uri, (width_pt, height_pt) in zip(uris, SHOWN, strict=True):
        result = stage(uri)
        assert isinstance(result, PreparedImage), (uri, result)
        width, height = round(width_pt * 200 / 72), round(height_pt * 200 / 72)
        assert (result.orig_width, result.orig_height, result.source_format) == (width, height, "pdf"), uri
        assert (result.height, result.width) == smart_resize(height, width, 28, 56 * 56, BUDGET)


def test_a_remote_pdf_over_http_or_fsspec_is_a_document_of_its_pages(tmp_path, pdf_server):
    """A document naming an http(s) or fsspec (memory://) PDF: the producer fetches it with the decode stage's rules
    to count its pages, one URI per page; the decode stage renders each. One it cannot fetch stays as it is."""
    import fsspec

    from vlmstream.images.fetch import Fetcher
    from producers.items import with_pdf_pages
    from schemas import DocumentRef

    served, base, requests = pdf_server
    (served / "mixed.pdf").write_bytes(pdfs.text_pdf(MIXED))
    memory = f"memory://vlmstream-pdf-{os.getpid()}-{time.monotonic_ns()}/mixed.pdf"
    with fsspec.open(memory, "wb") as out:
        out.write(pdfs.text_pdf(MIXED))
    fetcher = Fetcher(allow_private_hosts=True, retries=0, connect_timeout_s=2.0, read_timeout_s=5.0)
    doc = DocumentRef(doc_id="remote", image_uris=(f"{base}/mixed.pdf", memory, f"{base}/missing.pdf"))
    [counted] = with_pdf_pages([doc], max_pdf_pages=10, read=fetcher.fetch)
    fetcher.close()
    assert counted.image_uris == (*(f"{base}/mixed.pdf#page={n}" for n in (1, 2, 3)),
                                  *(f"{memory}#page={n}" for n in (1, 2, 3)), f"{base}/missing.pdf")
    # `vlmstream run` on a manifest reads it the same way.
    from vlmstream.cli.run_setup import read_source

    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"doc_id": "web", "image_uris": ["%s/mixed.pdf"]}\n' % base)
    [read] = read_source(manifest, per_file=False, id_prefix="", decode=DecodeSettings(allow_private_hosts=True)).items
    assert read.image_uris == counted.image_uris[:3]
    stage = make_stage(tmp_path, allow_private_hosts=True)
    requests.clear()
    assert_pages_render_at_their_shapes(stage, counted.image_uris[:3])
    assert requests == ["/mixed.pdf"]  # a document's pages of one PDF: one download
    stage.end_document()
    assert_pages_render_at_their_shapes(stage, counted.image_uris[:3])
    assert requests == ["/mixed.pdf"] * 2  # the next document fetches afresh
    assert_pages_render_at_their_shapes(stage, counted.image_uris[3:6])
    assert stage(counted.image_uris[6]).error_kind == "fetch_not_found"
    stage.decoder.close()


@pytest.mark.kafka
def test_vlmstream_produce_publishes_each_page_of_a_pdf_named_by_url(topic_names, tmp_path, pdf_server):
    """`vlmstream produce --manifest` on the real broker: a document naming a PDF served over http is published as
    its pages, and each page URI decodes."""
    import subprocess
    import sys

    import orjson

    from schemas import DocumentRef
    from tests.kafka_helpers import read_topic

    served, base, requests = pdf_server
    (served / "mixed.pdf").write_bytes(pdfs.text_pdf(MIXED))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(orjson.dumps({"doc_id": "web", "image_uris": [f"{base}/mixed.pdf"]}).decode() + "\n")
    t = topic_names.topics
    env = {**os.environ, "VLMSTREAM_BOOTSTRAP_SERVERS": topic_names.kafka.bootstrap_servers,
           "VLMSTREAM_PRODUCER__STATE_DIR": str(tmp_path / "ledger"), "VLMSTREAM_DECODE__ALLOW_PRIVATE_HOSTS": "true",
           **{f"VLMSTREAM_TOPICS__{name.upper()}": getattr(t, name) for name in ("documents", "deadletter")}}
    run = subprocess.run([sys.executable, "-m", "vlmstream.cli", "produce", "--manifest", str(manifest), "--quiet"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    [record] = read_topic(topic_names, t.documents, expected=1, idle_s=1.0)
    doc = DocumentRef.decode(record.value)
    assert doc.image_uris == tuple(f"{base}/mixed.pdf#page={n}" for n in (1, 2, 3))
    stage = make_stage(tmp_path, allow_private_hosts=True)
    assert_pages_render_at_their_shapes(stage, doc.image_uris)
    assert requests == ["/mixed.pdf"] * 2  # once to count its pages, once for the decode stage's three
    stage.decoder.close()


def test_vlmstream_estimate_counts_and_sizes_each_pdf_page_of_a_folder_or_manifest(tmp_path):
    """The estimate's job shape has a PDF's pages, as the producer publishes them, each sized from the page tree at
    decode.pdf_dpi (nothing drawn), from a folder and from a manifest alike."""
    import orjson

    from vlmstream.cli.estimate_job import job_documents, read_shape
    from vlmstream.config import Settings
    from vlmstream.models.qwen2_vl import QWEN2_VL

    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "mixed.pdf").write_bytes(pdfs.text_pdf(MIXED))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(orjson.dumps({"doc_id": "m", "image_uris": [str(folder / "mixed.pdf")]}).decode() + "\n")
    settings = Settings()
    for source in (folder, manifest):
        documents, _ = job_documents(settings, source, topic=False, per_file=True)
        shape = read_shape(documents, QWEN2_VL, 56 * 56, BUDGET, pdf_dpi=settings.decode.pdf_dpi)
        assert shape.images == 3 and not shape.unseen, (source, shape.unseen)
        [document] = shape.documents
        assert [image.source_px for image in document.images] == [
            round(w * 200 / 72) * round(h * 200 / 72) for w, h in SHOWN], source


def _page_counts_job(served, base, tmp_path, counts):
    """A manifest of one document per served PDF of ``counts[i]`` pages, then a document naming two of them and a
    local image; returns the manifest and the job's true image count (each PDF's pages, as the producer publishes
    them)."""
    import orjson

    lines = []
    for n, pages in enumerate(counts):
        (served / f"d{n}.pdf").write_bytes(pdfs.text_pdf([(612, 792, 0, f"page {p}") for p in range(pages)]))
        lines.append({"doc_id": f"d{n}", "image_uris": [f"{base}/d{n}.pdf"]})
    image = tmp_path / "photo.png"
    images.marked_image(64, 48).save(image)
    lines.append({"doc_id": "mixed", "image_uris": [f"{base}/d0.pdf", str(image), f"{base}/d1.pdf"]})
    manifest = tmp_path / "job.jsonl"
    manifest.write_text("".join(orjson.dumps(line).decode() + "\n" for line in lines))
    return manifest, sum(counts) + counts[0] + 1 + counts[1]


def test_the_estimate_counts_remote_pdf_pages_where_fetched_and_says_how_many_it_assumed(tmp_path, pdf_server):
    """A manifest of PDFs served over http: the estimate's shape fetches a few spread over the job (with the decode
    stage's rules) to count their pages, assumes the mean for the others and marks their pages; the sample's
    documents are fetched and counted before they run, and the fewest and most images the job may hold bracket its
    true count."""
    from vlmstream.cli.estimate_job import count_remote_pdfs, draw_sample, job_documents, read_shape, \
        settle_sample_pdfs
    from vlmstream.config import Settings
    from vlmstream.models.qwen2_vl import QWEN2_VL

    served, base, requests = pdf_server
    counts = [1, 3, 2, 5, 6, 4, 2, 3, 1, 2, 2, 3]
    manifest, true_images = _page_counts_job(served, base, tmp_path, counts)
    settings = Settings(decode={"allow_private_hosts": True})
    documents, _ = job_documents(settings, manifest, topic=False, per_file=False)
    documents, remote = count_remote_pdfs(documents, settings.decode, count=4)
    assert len(requests) == 4 and len(remote.pages) == 4  # 4 of the 12 remote PDFs fetched, spread over the job
    assert requests[0] == "/d0.pdf" and requests[-1] == "/d11.pdf"
    counted = [counts[int(path[2:-4])] for path in requests]
    assert remote.readable() == counted and remote.assumed_pages == max(1, round(sum(counted) / 4))
    shape = read_shape(documents, QWEN2_VL, 56 * 56, BUDGET, remote_pdfs=remote)
    pdfs_assumed, images_assumed = shape.assumed_pdfs()
    # 8 PDFs not fetched, one of them named by two documents (each document's pages are its own images)
    assert pdfs_assumed == 9 and images_assumed == 9 * remote.assumed_pages
    low, high = shape.images_range()
    assert low <= true_images <= high and low < shape.images < high
    assert "9 remote PDF(s) not fetched: their pages assumed" in shape.pdfs_said()
    # The sample's documents run as the job will publish them: their PDFs fetched and counted first.
    sample = draw_sample(shape, 6, seed=1)
    sampled = {im.uri.rpartition("#page=")[0] for d in sample for im in d.images if im.assumed}
    assert sampled  # the draw took documents whose pages were assumed
    still_assumed = sum(1 for d in shape.documents for im in d.images
                        if im.assumed and im.uri.endswith("#page=1") and im.uri.rpartition("#page=")[0] not in sampled)
    requests.clear()
    settle_sample_pdfs(shape, sample, settings.decode)
    assert sorted(requests) == sorted(urlpath.removeprefix(base) for urlpath in sampled)
    for document in sample:
        assert not any(im.assumed for im in document.images)
        for uri in document.doc.image_uris:
            pdf_uri, _, page = uri.rpartition("#page=")
            if pdf_uri.startswith(base):
                assert 1 <= int(page) <= counts[int(pdf_uri.rsplit("/d", 1)[1][:-4])]
    assert shape.assumed_pdfs()[0] == still_assumed < 9
    # Nothing left to assume: every remote PDF counted, the job's count is the producer's.
    documents, _ = job_documents(settings, manifest, topic=False, per_file=False)
    documents, remote = count_remote_pdfs(documents, settings.decode, count=20)
    shape = read_shape(documents, QWEN2_VL, 56 * 56, BUDGET, remote_pdfs=remote)
    assert shape.images == true_images and shape.assumed_pdfs() == (0, 0) and shape.images_range() is None


@pytest.mark.kafka
@pytest.mark.model
@pytest.mark.slow
def test_vlmstream_estimate_of_remote_pdfs_runs_counted_pages_and_says_what_it_assumed(kafka_settings, tmp_path,
                                                                                       pdf_server):
    """`vlmstream estimate` on a manifest of PDFs served over http, on the real broker with the tiny model: its sample
    runs each of its documents' pages (none dead-lettered, so none was assumed into existence), the JSON line says how
    many PDFs' page counts were assumed, and the printed estimate says so beside its range."""
    import json
    import subprocess
    import sys

    served, base, requests = pdf_server
    counts = [n % 6 + 1 for n in range(24)]  # the 8 counted first (every third or so) hold 1 to 6 pages
    manifest, true_images = _page_counts_job(served, base, tmp_path, counts)
    env = {**os.environ, "VLMSTREAM_INFER__BATCH_SIZE": "4", "OMP_NUM_THREADS": "1",
           "VLMSTREAM_PRODUCER__STATE_DIR": str(tmp_path / "ledger"), "VLMSTREAM_DECODE__ALLOW_PRIVATE_HOSTS": "true"}
    cmd = [sys.executable, "-m", "vlmstream.cli", "estimate", str(manifest), "--sample-images", "6",
           "--decode-workers", "1", "--max-pixels", str(64 * 28 * 28), "--max-new-tokens", "2", "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["documents"] == len(counts) + 1 and data["sample_missing"] == 0
    assert data["remote_pdfs_counted"] >= 8 and 0 < data["remote_pdfs_assumed"] < len(counts)
    low, high = data["images_range"]
    assert low <= true_images <= high and low <= data["images"] <= high
    assert data["range_parts"]["images_up"] > 0 and data["low_s"] <= data["predicted_s"] <= data["high_s"]
    said = [line for line in data["assumptions"] if "remote PDF(s) not fetched: their pages assumed" in line]
    assert len(said) == 1 and f"{data['remote_pdfs_assumed']} remote PDF(s) not fetched" in said[0]
    assert f"pages of {data['remote_pdfs_assumed']} remote PDF(s) not fetched" in proc.stderr
