"""The decode stage end to end on files: every supported format, EXIF orientation, alpha, and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageOps

from vlmstream.images.payload import decode as decode_payload
from consumers.decode.decoder import Decoder, pick_dct_scale
from consumers.decode.headers import jpeg_exif_orientation
from consumers.decode.jpeg2000 import jpeg2000_decomposition_levels, jpeg2000_levels_to_drop
from consumers.decode.stage import DecodeStage
from consumers.decode.types import ImageFailure, PreparedImage, Stage
from tests import images
from vlmstream.config import DecodeSettings


def make_stage(tmp_path, **overrides) -> DecodeStage:
    settings = DecodeSettings(allowed_roots=[str(tmp_path)], codec="raw", **overrides)
    return DecodeStage(settings, str(tmp_path / "claims"))


def test_a_stage_is_a_callable_with_the_runners_hooks(tmp_path):
    class Failing(Stage):
        def __call__(self, uri):
            return ImageFailure("fetch_not_found", uri, False)

    with pytest.raises(TypeError):
        Stage()  # the call is what a stage must supply
    stage = Failing()
    assert stage("x").error_kind == "fetch_not_found"
    assert stage.end_document() is None and stage.close() is None and stage.store is None
    decode_stage = make_stage(tmp_path)
    assert isinstance(decode_stage, Stage) and decode_stage.store is not None
    decode_stage.close()


def pixels_of(result: PreparedImage) -> np.ndarray:
    assert isinstance(result, PreparedImage), result
    return decode_payload(result.data, "raw", result.height, result.width)


@pytest.mark.parametrize("name", sorted(images.supported_formats()))
def test_every_supported_format_decodes_to_the_smart_resize_size(tmp_path, name):
    data = images.supported_formats()[name]
    path = tmp_path / f"{name}.img"  # a name that says nothing: the format comes from the bytes
    path.write_bytes(data)
    result = make_stage(tmp_path)(str(path))
    pixels = pixels_of(result)
    with Image.open(path) as reference:
        width, height = reference.size
    from vlmstream.models.qwen2_vl import smart_resize

    assert (result.height, result.width) == smart_resize(height, width, 28, 56 * 56, 28 * 28 * 16384)
    assert (result.orig_width, result.orig_height) == (width, height)
    assert result.grid_thw == (1, result.height // 14, result.width // 14)
    assert result.source_format == name.split("_")[0]
    assert pixels.dtype == np.uint8 and pixels.shape == (result.height, result.width, 3)
    assert set(result.timings) >= {"fetch_ms", "decode_ms", "resize_ms", "encode_ms"}
    assert result.prepare_cpu_ms is not None and result.prepare_cpu_ms > 0  # what an estimate adds up


def test_photo_formats_agree_with_pillow_in_colour(tmp_path):
    """CMYK, grey, 16-bit and the rest land on the same RGB as Pillow's own conversion of the 8-bit RGB original."""
    formats = images.supported_formats()
    stage = make_stage(tmp_path)
    import cv2

    def smoothed(name):  # lossy codecs drop the test image's pixel noise; compare colour, not noise
        return cv2.blur(pixels_of(stage.prepare(formats[name])), (9, 9)).astype(np.int16)

    reference = smoothed("png_rgb")
    lossy_or_not = ("jpeg_baseline", "jpeg_progressive", "jpeg_cmyk", "webp", "tiff", "tiff_cmyk", "bmp", "jpeg2000",
                    "jpeg2000_codestream", "netpbm_ppm", "qoi", *(n for n in ("avif", "heif") if n in formats))
    for name in lossy_or_not:
        assert np.abs(smoothed(name) - reference).mean() < 2.5, name
    grey = pixels_of(stage.prepare(formats["jpeg_gray"]))
    assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()


def test_sixteen_bit_pngs_are_scaled_not_clipped(tmp_path):
    stage = make_stage(tmp_path)
    gray = pixels_of(stage.prepare(images.png_16bit_gray(40000)))
    assert np.all(gray == round(40000 / 257))  # 156, where a clip would give 255
    rgb = pixels_of(stage.prepare(images.png_16bit_rgb()))
    assert tuple(rgb[10, 10]) == (255, 128, 0)


def test_alpha_is_composited_on_white(tmp_path):
    pixels = pixels_of(make_stage(tmp_path).prepare(images.rgba_half_transparent()))
    h, w = pixels.shape[:2]
    assert tuple(pixels[h // 2, w // 4]) == (255, 0, 0)
    assert tuple(pixels[h // 2, 3 * w // 4]) == (255, 255, 255)
    palette = pixels_of(make_stage(tmp_path).prepare(images.supported_formats()["png_palette_transparent"]))
    assert palette.mean() > 200  # index 0 (the transparent one) covers most of the image and became white


def _corner_colours(pixels: np.ndarray) -> dict[str, tuple[int, int, int]]:
    h, w = pixels.shape[:2]
    points = {"top_left": (4, 4), "top_right": (4, w - 5), "bottom_left": (h - 5, 4), "bottom_right": (h - 5, w - 5)}
    return {name: tuple(int(v) for v in pixels[y, x]) for name, (y, x) in points.items()}


def _is_red(colour) -> bool:
    return colour[0] > 200 and colour[1] < 60 and colour[2] < 60


@pytest.mark.parametrize(
    "orientation, red_corner", [(1, "top_left"), (3, "bottom_right"), (6, "top_right"), (8, "bottom_left")]
)
@pytest.mark.parametrize("container", ["jpeg", "png"])
def test_exif_orientation_turns_the_image_upright(tmp_path, orientation, red_corner, container):
    data = (images.jpeg_with_orientation if container == "jpeg" else images.png_with_orientation)(orientation)
    result = make_stage(tmp_path).prepare(data)
    pixels = pixels_of(result)
    landscape = orientation in (1, 3)
    assert (result.orig_width > result.orig_height) == landscape  # 280x140 stored; 6 and 8 stand it up
    assert (result.width > result.height) == landscape
    corners = _corner_colours(pixels)
    assert _is_red(corners[red_corner]), corners
    assert [name for name, colour in corners.items() if _is_red(colour)] == [red_corner]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_all_eight_orientations_match_pillow_exif_transpose(tmp_path, orientation):
    import io

    data = images.jpeg_with_orientation(orientation, 224, 112)  # sizes already multiples of 28: no resampling
    assert jpeg_exif_orientation(data) == orientation
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")).astype(np.int16)
    ours = pixels_of(make_stage(tmp_path).prepare(data)).astype(np.int16)
    assert ours.shape == expected.shape
    assert np.abs(ours - expected).mean() < 1.0


@pytest.mark.parametrize("name", sorted(images.bad_inputs()))
def test_bad_inputs_become_failures_with_the_right_kind(tmp_path, name):
    data, expected_kind = images.bad_inputs()[name]
    path = tmp_path / "photo.jpg"
    path.write_bytes(data)
    result = make_stage(tmp_path)(str(path))
    assert isinstance(result, ImageFailure), result
    assert result.error_kind == expected_kind, result.detail
    assert result.retriable is False


def test_bomb_is_refused_before_any_pixel_is_decoded(tmp_path):
    import time

    stage = make_stage(tmp_path, max_source_pixels=10_000_000)
    (tmp_path / "big.png").write_bytes(images.png_bomb(4000, 3000))  # 12 MP header, below Pillow's own limit
    started = time.perf_counter()
    result = stage(str(tmp_path / "big.png"))
    assert isinstance(result, ImageFailure) and result.error_kind == "decode_too_many_pixels", result
    assert time.perf_counter() - started < 0.5
    # The reason names the setting that would let a genuine large image through.
    assert "12000000 pixels (Pillow's header check): over decode.max_source_pixels (10,000,000" in result.detail


def test_jpeg_is_decoded_at_the_smallest_dct_scale_that_covers_the_target():
    factors = {(1, 8), (1, 4), (3, 8), (1, 2), (5, 8), (3, 4), (7, 8), (1, 1), (2, 1)}
    assert pick_dct_scale(5120, 2880, 1316, 728, factors) == (3, 8)  # 1920x1080 >= 1316x728; 1/4 is 1280 wide
    assert pick_dct_scale(2560, 1600, 2548, 1596, factors) == (1, 1)
    assert pick_dct_scale(4000, 3000, 10, 10, factors) == (1, 8)
    decoder = Decoder(max_pixels=256 * 28 * 28)
    big = images._save(images._photo_like(1200, 900, 1), "JPEG", quality=80)
    decoded = decoder.decode(big)
    assert (decoded.target_height, decoded.target_width) == (364, 504)  # smart_resize(900, 1200, 28, .., 200704)
    assert decoded.scale == 1 / 2 and decoded.pixels.shape[:2] == (450, 600)  # 3/8 would be 450 wide < 504


def test_pillow_fallback_without_libjpeg_turbo_gives_the_same_size(tmp_path):
    data = images._save(images._photo_like(800, 600, 2), "JPEG", quality=90)
    settings = DecodeSettings(allowed_roots=[str(tmp_path)], codec="raw", max_pixels=64 * 28 * 28)
    turbo, pillow = DecodeStage(settings, ""), DecodeStage(settings, "", use_turbojpeg=False)
    assert not pillow.decoder.uses_turbojpeg
    a, b = turbo.prepare(data), pillow.prepare(data)
    assert (a.width, a.height) == (b.width, b.height)
    assert b.timings["dct_scale"] < 1  # Pillow's draft() also decodes at a reduced DCT scale
    assert np.abs(pixels_of(a).astype(int) - pixels_of(b).astype(int)).mean() < 3


def test_large_jpeg2000_skips_the_resolution_levels_it_does_not_need(tmp_path):
    """A JPEG 2000 is decoded at the smallest wavelet resolution that still covers the target: as with JPEG's DCT
    scaling, most of a large page image is never decoded. A file with fewer levels is reduced only as far as it
    can be, and the stage's output size is the same either way."""
    photo = images._photo_like(1600, 1200, 9)
    budget = 128 * 28 * 28  # 364 x 252: a 400 x 300 decode (two levels skipped) covers it, 200 x 150 does not
    decoder = Decoder(max_pixels=budget)
    five_levels = images._save(photo, "JPEG2000")  # openjpeg's default: 6 resolutions, 5 decomposition levels
    one_level = images._save(photo, "JPEG2000", num_resolutions=2)
    assert (jpeg2000_decomposition_levels(five_levels), jpeg2000_decomposition_levels(one_level)) == (5, 1)
    assert jpeg2000_decomposition_levels(b"not a codestream") == 0
    assert jpeg2000_decomposition_levels(images.jp2_with_box_before_codestream(five_levels, 10_000)) == 5

    reduced = decoder.decode(five_levels)
    assert reduced.scale == 0.25 and reduced.pixels.shape == (300, 400, 3)
    assert decoder.decode(images.jp2_with_box_before_codestream(five_levels, 10_000)).scale == 0.25
    assert min(reduced.pixels.shape[:2]) >= min(reduced.target_height, reduced.target_width)
    assert decoder.decode(one_level).scale == 0.5

    stage = make_stage(tmp_path, max_pixels=budget)
    sizes = {(r.height, r.width) for r in (stage.prepare(five_levels), stage.prepare(one_level))}
    assert sizes == {smart_resize_size(1200, 1600, budget)}


def smart_resize_size(height, width, max_pixels):
    from vlmstream.models.qwen2_vl import smart_resize

    return smart_resize(height, width, 28, 56 * 56, max_pixels)


@pytest.mark.parametrize("size,need,levels", [
    ((1600, 1200), (400, 300), 2),   # 400x300 still covers it, 200x150 does not
    ((1600, 1200), (401, 300), 1),
    ((1600, 1200), (1600, 1200), 0),
    ((1601, 1201), (401, 301), 2),   # sides round up at each level
    ((100_000, 100_000), (28, 28), 5),  # never more than asked for
])
def test_jpeg2000_levels_to_drop(size, need, levels):
    assert jpeg2000_levels_to_drop(*size, *need) == levels


def test_float_pixels_that_are_not_numbers_become_black(tmp_path):
    values = np.tile(np.linspace(0, 1, 96, dtype=np.float32), (64, 1))  # dark left, bright right
    values[:, :8] = np.nan
    values[:, 8:16] = np.inf
    pixels = pixels_of(make_stage(tmp_path).prepare(images._save(Image.fromarray(values, "F"), "TIFF")))
    assert pixels[:, :4].max() == 0  # the resize blends the edge columns; the first few stay pure
    assert pixels[:, -4:].min() > 200


def test_heic_needs_pillow_heif_and_says_so_without_it(tmp_path, monkeypatch):
    from consumers.decode import sniff

    assert "heif" in images.supported_formats()  # the test extra installs pillow-heif: HEIC decodes (above)
    monkeypatch.setattr(sniff, "pillow_reads_heif", lambda: False)
    path = tmp_path / "phone.heic"
    path.write_bytes(images.supported_formats()["heif"])
    result = make_stage(tmp_path)(str(path))
    assert isinstance(result, ImageFailure) and result.error_kind == "decode_unsupported"
    assert "pip install 'vlmstream[heif]'" in result.detail


def test_heic_rotation_is_applied_once(tmp_path):
    """pillow-heif turns a HEIF's rotation (and an EXIF orientation written into it) into upright pixels and
    reports orientation 1: the stage must not rotate again."""
    landscape = np.zeros((140, 280, 3), np.uint8)
    landscape[:28, :28] = (255, 0, 0)  # red in the stored top-left corner
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    data = images._save(Image.fromarray(landscape), "HEIF", quality=95, exif=exif.tobytes())
    pixels = pixels_of(make_stage(tmp_path).prepare(data))
    assert pixels.shape[0] > pixels.shape[1]  # portrait, as displayed
    corner = pixels[:14, -14:].reshape(-1, 3).mean(axis=0)  # clockwise: the top-left corner lands top-right
    assert corner[0] > 150 and corner[1] < 80 and corner[2] < 80, corner


def test_jpeg2000_that_cannot_drop_the_levels_its_header_promised_decodes_at_full_size(tmp_path, monkeypatch):
    """A component may have fewer levels than the main header says (a COC segment): the reduced decode fails,
    and the picture is decoded whole rather than dead-lettered."""
    from consumers.decode import decoder

    one_level = images._save(images._photo_like(1600, 1200, 9), "JPEG2000", num_resolutions=2)
    monkeypatch.setattr(decoder, "jpeg2000_decomposition_levels", lambda data: 5)
    decoded = Decoder(max_pixels=128 * 28 * 28).decode(one_level)
    assert decoded.scale == 1.0 and decoded.pixels.shape == (1200, 1600, 3)


def _with_repeated_last_scan(jpeg: bytes, copies: int) -> bytes:
    """A progressive JPEG whose last scan is repeated: libjpeg only warns, and walks every block again per copy."""
    last_scan = jpeg.rindex(b"\xff\xda")
    return jpeg[:-2] + jpeg[last_scan:-2] * copies + b"\xff\xd9"


@pytest.mark.parametrize("mode, use_turbojpeg", [("L", True), ("L", False), ("CMYK", True)])
def test_jpeg_with_hundreds_of_repeated_scans_is_refused_before_decoding(tmp_path, mode, use_turbojpeg):
    progressive = images._save(Image.new(mode, (64, 64), 128), "JPEG", quality=90, progressive=True)
    assert pixels_of(make_stage(tmp_path).prepare(progressive)).shape[2] == 3  # the original is fine
    bomb = _with_repeated_last_scan(progressive, 600)
    (tmp_path / "scans.jpg").write_bytes(bomb)
    settings = DecodeSettings(allowed_roots=[str(tmp_path)], codec="raw")
    result = DecodeStage(settings, "", use_turbojpeg=use_turbojpeg)(str(tmp_path / "scans.jpg"))
    assert isinstance(result, ImageFailure) and result.error_kind == "decode_corrupt", result
    scans = bomb.count(b"\xff\xda")
    assert f"{scans} scans" in result.detail


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("container", ["tiff", "png", "webp"])
def test_orientation_is_applied_exactly_once_in_every_container(tmp_path, orientation, container):
    """Pillow 13 turns a TIFF upright itself when it loads one; PNG and WebP it leaves to the caller."""
    import io

    exif = Image.Exif()
    exif[0x0112] = orientation
    params = {"lossless": True} if container == "webp" else {}
    data = images._save(images.marked_image(), container.upper(), exif=exif.tobytes(), **params)
    reference = images._save(images.marked_image(), "PNG", exif=exif.tobytes())  # Pillow never turns PNGs itself
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(reference))).convert("RGB"))
    ours = pixels_of(make_stage(tmp_path).prepare(data))  # 280x140: multiples of 28, so no resampling
    assert ours.shape == expected.shape
    assert np.array_equal(ours, expected)


@pytest.mark.parametrize("mode", ["RGB", "CMYK"])
@pytest.mark.parametrize("progressive", [False, True])
def test_jpeg_cut_short_with_an_end_marker_appended_is_truncated(tmp_path, progressive, mode):
    """libjpeg's warning for it is "Corrupt JPEG data: premature end of data segment", and the rows it never got
    come out grey. CMYK files are decoded by Pillow, which hides that warning."""
    jpeg = images._save(images._photo_like(320, 240, 5).convert(mode), "JPEG", quality=90, progressive=progressive)
    result = make_stage(tmp_path)(str(_write(tmp_path, jpeg[: len(jpeg) // 2] + b"\xff\xd9")))
    assert isinstance(result, ImageFailure) and result.error_kind == "decode_truncated", result


def _write(tmp_path, data: bytes):
    path = tmp_path / "image.bin"
    path.write_bytes(data)
    return path


def _keyed(mode: str, key, *, animated: bool = False) -> bytes:
    """Left half opaque, right half the tRNS colour key (black: transparent) as a PNG or an APNG."""
    image = Image.new(mode, (200, 100), key)
    image.paste((255, 0, 0) if mode == "RGB" else 200, (0, 0, 100, 100))
    extra = {"save_all": True, "append_images": [image.copy()]} if animated else {}
    return images._save(image, "PNG", transparency=key, **extra)


@pytest.mark.parametrize("data", [
    _keyed("RGB", (0, 0, 0)),
    _keyed("L", 0),
    _keyed("I;16", 0),
    _keyed("RGB", (0, 0, 0), animated=True),
    _keyed("L", 0, animated=True),
], ids=["rgb", "grey", "grey16", "rgb_apng", "grey_apng"])
def test_transparent_colour_keys_come_out_white(tmp_path, data):
    pixels = pixels_of(make_stage(tmp_path).prepare(data))
    w = pixels.shape[1]
    assert pixels[:, -w // 4:].min() == 255  # the keyed half, transparent
    assert pixels[:, : w // 4].max(axis=(0, 1)).tolist() != [255, 255, 255]  # the opaque half is not


def _rgba_png(width: int, height: int, depth: int) -> bytes:
    import cv2

    bgra = np.zeros((height, width, 4), np.uint16 if depth == 16 else np.uint8)
    bgra[..., 2] = 200 * (257 if depth == 16 else 1)
    bgra[..., 3] = (np.arange(width) % 256 * (257 if depth == 16 else 1))[None, :]  # every level of transparency
    ok, data = cv2.imencode(".png", bgra)
    assert ok
    return data.tobytes()


@pytest.mark.parametrize("make, source_bytes_per_pixel", [
    (lambda: _rgba_png(3000, 2000, 8), 4),
    (lambda: _rgba_png(3000, 2000, 16), 8),
    (lambda: images._save(Image.fromarray(np.tile(np.linspace(0, 1, 3000, dtype=np.float32), (2000, 1)), "F"),
                          "TIFF"), 4),
], ids=["rgba8_png", "rgba16_png", "float_tiff"])
def test_decoding_allocates_little_beyond_the_source_and_the_output(make, source_bytes_per_pixel):
    """Alpha compositing and 16-bit or float scaling work a row block at a time: full-size uint16, uint32 or float
    temporaries cost a 196 MP image several GB. Bound: the decoded source array, the RGB output (3 bytes a pixel)
    and 2 more; the full-size temporaries took 13 (float), 30 (RGBA8) and 40 (RGBA16) bytes a pixel."""
    import tracemalloc

    data = make()
    decoder = Decoder()
    tracemalloc.start()  # sees numpy's and OpenCV's arrays, not Pillow's own image memory
    try:
        pixels = decoder.decode(data).pixels
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert pixels.shape == (2000, 3000, 3)
    assert peak / pixels[..., 0].size < source_bytes_per_pixel + 3 + 2


def _tiled_tiff(width: int, height: int, tile: int) -> bytes:
    """An 8-bit grey TIFF of width x height stored in one deflated tile x tile tile (all black)."""
    import struct
    import zlib

    pixels = zlib.compress(bytes(tile * tile), 9)
    entries = [(256, 3, width), (257, 3, height), (258, 3, 8), (259, 3, 8), (262, 3, 1), (277, 3, 1),
               (322, 4, tile), (323, 4, tile), (324, 4, None), (325, 4, len(pixels))]
    data_at = 8 + 2 + 12 * len(entries) + 4
    out = b"II*\x00" + struct.pack("<IH", 8, len(entries))
    for tag, kind, value in entries:
        value = data_at if value is None else value
        out += struct.pack("<HHI", tag, kind, 1) + struct.pack("<HH" if kind == 3 else "<I", *(
            (value, 0) if kind == 3 else (value,)))
    return out + struct.pack("<I", 0) + pixels


def test_tiff_tile_far_larger_than_its_image_is_refused_before_loading(tmp_path):
    """libtiff allocates and inflates a whole tile, whatever the image size: a 16x16 image in one 46336-square tile
    cost 2 GB. The image-size check alone passes it."""
    stage = make_stage(tmp_path, max_source_pixels=10_000_000)
    assert isinstance(stage.prepare(_tiled_tiff(16, 16, 256)), PreparedImage)  # a usual tile for a small image
    corrupt = stage(str(_write(tmp_path, _tiled_tiff(16, 16, 2048))))
    assert isinstance(corrupt, ImageFailure) and corrupt.error_kind == "decode_corrupt", corrupt
    assert "tile 2048x2048" in corrupt.detail
    too_many = stage(str(_write(tmp_path, _tiled_tiff(16, 16, 4096))))  # 16.8 MP: over max_source_pixels
    assert isinstance(too_many, ImageFailure) and too_many.error_kind == "decode_too_many_pixels", too_many
    assert "decode.max_source_pixels" in too_many.detail


@pytest.mark.parametrize("endian, kind", [(">", 3), (">", 4), ("<", 3), ("<", 4)],
                         ids=["big_short", "big_long", "little_short", "little_long"])
def test_exif_orientation_is_read_as_short_or_long_in_either_byte_order(tmp_path, endian, kind):
    """The standard says SHORT; some writers use LONG, which Pillow (and so the stage's CMYK path) honours. Read as
    2 bytes, a big-endian LONG is 0."""
    import struct

    entry = struct.pack(endian + "HHI", 0x0112, kind, 1) + struct.pack(endian + ("I" if kind == 4 else "HH"),
                                                                          *((6,) if kind == 4 else (6, 0)))
    tiff = (b"MM\x00*" if endian == ">" else b"II*\x00") + struct.pack(endian + "IH", 8, 1) + entry + bytes(4)
    app1 = b"Exif\x00\x00" + tiff
    jpeg = images._save(images.marked_image(), "JPEG", quality=90)
    data = jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + jpeg[2:]
    assert jpeg_exif_orientation(data) == 6
    result = make_stage(tmp_path).prepare(data)
    assert (result.width, result.height) == (140, 280)  # stood up


def _jpeg_frame_rewritten(*, marker: int | None = None, precision: int | None = None) -> bytes:
    data = bytearray(images._save(images._photo_like(64, 48, 1), "JPEG", quality=90))
    sof = data.index(b"\xff\xc0")
    if marker is not None:
        data[sof + 1] = marker
    if precision is not None:
        data[sof + 4] = precision
    return bytes(data)


@pytest.mark.parametrize("data", [_jpeg_frame_rewritten(precision=12), _jpeg_frame_rewritten(marker=0xC3)],
                         ids=["12_bit", "lossless"])
@pytest.mark.parametrize("use_turbojpeg", [True, False])
def test_12_bit_and_lossless_jpeg_are_unsupported_not_corrupt(tmp_path, data, use_turbojpeg):
    settings = DecodeSettings(allowed_roots=[str(tmp_path)], codec="raw")
    result = DecodeStage(settings, "", use_turbojpeg=use_turbojpeg)(str(_write(tmp_path, data)))
    assert isinstance(result, ImageFailure) and result.error_kind == "decode_unsupported", result


def rle8_bmp(side: int) -> bytes:
    """An RLE8 BMP of side x side whose rows are one pixel and an end-of-line each: a few bytes per row, for which
    Pillow's pure-Python RLE decoder pads every row a byte at a time."""
    import struct

    rows = b"\x01\x07\x00\x00" * side + b"\x00\x01"
    palette = b"".join(struct.pack("<BBBB", i, i, i, 0) for i in range(256))
    info = struct.pack("<IiiHHIIiiII", 40, side, side, 1, 8, 1, len(rows), 2835, 2835, 256, 0)
    offset = 14 + len(info) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(rows), 0, 0, offset) + info + palette + rows


def test_a_decode_past_its_time_limit_is_a_failure_not_a_stuck_worker(tmp_path):
    import time

    path = tmp_path / "slow.bmp"
    path.write_bytes(rle8_bmp(6000))  # ~200 KB; seconds of Python loops in Pillow
    started = time.monotonic()
    result = make_stage(tmp_path, decode_time_limit_s=0.3)(str(path))
    assert isinstance(result, ImageFailure), result
    assert (result.error_kind, result.retriable) == ("decode_timeout", False)
    assert time.monotonic() - started < 3.0
    (tmp_path / "small.bmp").write_bytes(rle8_bmp(64))
    assert isinstance(make_stage(tmp_path, decode_time_limit_s=0.3)(str(tmp_path / "small.bmp")), PreparedImage)
    import signal

    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no alarm left behind


def save_pages(path, colours, **save_options):
    pages = [Image.new("RGB", (420, 560), colour) for colour in colours]
    pages[0].save(path, save_all=True, append_images=pages[1:], **save_options)
    return path


def test_a_page_selector_picks_one_page_and_a_bare_multi_page_tiff_says_how_many_it_has(tmp_path):
    """Scanned documents and faxes are often one multi-page TIFF; only its first page used to be described."""
    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]
    scan = save_pages(tmp_path / "scan.tif", colours, compression="tiff_lzw")
    stage = make_stage(tmp_path, max_pixels=256 * 28 * 28)
    bare = stage(str(scan))
    assert bare.pages == 3 and pixels_of(bare)[5, 5].tolist() == [200, 30, 30]
    for page, colour in enumerate(colours, start=1):
        chosen = stage(f"{scan}#page={page}")
        assert chosen.pages == 1 and np.abs(pixels_of(chosen)[5, 5].astype(int) - colour).max() <= 2
    beyond = stage(f"{scan}#page=4")
    assert isinstance(beyond, ImageFailure) and beyond.error_kind == "decode_page_out_of_range"
    assert "has 3" in beyond.detail and not beyond.retriable
    # Frames of other formats, and page 1 of a single-page file through the fast JPEG path.
    gif = save_pages(tmp_path / "frames.gif", colours[:2])
    assert pixels_of(stage(f"{gif}#page=2"))[5, 5].tolist() == [30, 200, 30] and stage(str(gif)).pages == 1
    Image.new("RGB", (420, 560), (10, 120, 240)).save(tmp_path / "photo.jpg", quality=95)
    assert np.abs(pixels_of(stage(f"{tmp_path / 'photo.jpg'}#page=1"))[5, 5].astype(int) - (10, 120, 240)).max() <= 3
    assert stage(f"{tmp_path / 'photo.jpg'}#page=2").error_kind == "decode_page_out_of_range"


def test_a_png_whose_exif_comes_after_the_pixels_is_still_turned_upright(tmp_path):
    """The header pass sees an eXIf chunk only before IDAT; one after it was ignored and the page came out
    sideways. Found by a probe with images nobody on the team had made."""
    import struct
    import zlib
    from io import BytesIO

    picture = Image.new("RGB", (320, 200), (240, 240, 240))
    picture.paste((220, 0, 220), (0, 0, 40, 40))  # a marker in the stored top-left corner
    buffer = BytesIO()
    picture.save(buffer, "PNG")
    data = buffer.getvalue()
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: turn 90 degrees clockwise to view
    body = exif.tobytes()[6:]  # an eXIf chunk holds the bare TIFF structure
    chunk = struct.pack(">I", len(body)) + b"eXIf" + body + struct.pack(">I", zlib.crc32(b"eXIf" + body))
    iend = data.rfind(b"IEND") - 4
    (tmp_path / "late.png").write_bytes(data[:iend] + chunk + data[iend:])

    result = make_stage(tmp_path, max_pixels=256 * 28 * 28)(str(tmp_path / "late.png"))
    upright = np.asarray(ImageOps.exif_transpose(Image.open(tmp_path / "late.png")).convert("RGB"))
    assert (result.orig_width, result.orig_height) == (200, 320) and result.height > result.width
    pixels = pixels_of(result)
    assert pixels[5, -5].tolist() == [220, 0, 220] == upright[5, -5].tolist()  # the marker is now top-right


def test_pages_are_counted_only_up_to_a_bound(tmp_path, monkeypatch):
    """Pillow's own page count walks every page directory, quadratically: a hostile TIFF of 100,000 one-pixel pages
    took 54 s to count, in the decode stage and in the folder source alike."""
    import vlmstream.images.pages as page_files
    from producers.folder import page_uris

    monkeypatch.setattr(page_files, "MAX_PAGES", 4)
    many = save_pages(tmp_path / "many.tif", [(i * 40, 0, 0) for i in range(6)])
    three = save_pages(tmp_path / "three.tif", [(200, 30, 30), (30, 200, 30), (30, 30, 200)])
    stage = make_stage(tmp_path, max_pixels=256 * 28 * 28)
    assert stage(str(many)).pages == 4 and stage(str(three)).pages == 3
    assert stage(f"{many}#page=5").error_kind == "decode_page_out_of_range"
    assert page_uris(many) == [str(many)]  # too many to list: the decode stage describes page 1 and notes the rest
    assert page_uris(three) == [f"{three}#page={n}" for n in (1, 2, 3)]
