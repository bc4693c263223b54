"""Payload codecs (what the inference side decodes) and the claim-check store."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmstream.images.claimcheck import ClaimCheckStore
from vlmstream.images.payload import PayloadError, decode, encode, payload_to_array
from consumers.decode.stage import DecodeStage
from vlmstream.images.errors import ImageError
from schemas.messages import ImagePayload
from tests import images
from vlmstream.config import DecodeSettings


def _image(height=56, width=84, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    smooth = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], -1)
    return np.clip(smooth + rng.integers(-4, 5, smooth.shape), 0, 255).astype(np.uint8)


@settings(max_examples=30, deadline=None)
@given(h=st.integers(1, 6).map(lambda n: n * 28), w=st.integers(1, 6).map(lambda n: n * 28),
       codec=st.sampled_from(["raw", "png"]))
def test_lossless_codecs_round_trip_exactly(h, w, codec):
    rgb = _image(h, w, h * w)
    assert np.array_equal(decode(encode(rgb, codec), codec, h, w), rgb)


def test_jpeg_codec_is_close_at_quality_95():
    rgb = _image(224, 336)
    back = decode(encode(rgb, "jpeg", jpeg_quality=95), "jpeg", 224, 336)
    assert back.shape == rgb.shape and np.abs(back.astype(int) - rgb.astype(int)).mean() < 2.5


def test_decode_validates_the_declared_size():
    rgb = _image()
    for codec in ("raw", "png", "jpeg"):
        with pytest.raises(PayloadError):
            decode(encode(rgb, codec), codec, 28, 84)
    with pytest.raises(PayloadError):
        decode(b"not a payload", "jpeg", 56, 84)
    with pytest.raises(PayloadError):
        decode(b"", "webp", 56, 84)


def _meta(result, **extra) -> ImagePayload:
    return ImagePayload(doc_id="d1", image_index=0, image_count=1, source_uri="x", codec=result.codec,
                        width=result.width, height=result.height, grid_thw=result.grid_thw,
                        payload_bytes=len(result.data), **extra)


@pytest.mark.parametrize("codec", ["jpeg", "png", "raw"])
def test_stage_output_round_trips_through_payload_to_array(tmp_path, codec):
    stage = DecodeStage(DecodeSettings(codec=codec, allowed_roots=[str(tmp_path)]), str(tmp_path / "claims"))
    result = stage.prepare(images.supported_formats()["png_rgb"])
    pixels = payload_to_array(_meta(result), result.data, None)
    assert pixels.shape == (result.height, result.width, 3) and pixels.dtype == np.uint8
    # Through the claim-check store: the record value is empty, the header carries the reference.
    ref = stage.store.put("d1/0", result.data)
    from_store = payload_to_array(_meta(result, claim_check=ref), b"", stage.store)
    assert np.array_equal(from_store, pixels)
    with pytest.raises(PayloadError):
        payload_to_array(_meta(result, claim_check=ref), b"", None)


@pytest.mark.parametrize("url_kind", ["folder", "file_url", "memory"])
def test_claim_check_store_put_get_delete(tmp_path, url_kind, unique):
    url = {"folder": str(tmp_path / "store"), "file_url": (tmp_path / "store").as_uri(),
           "memory": f"memory://vlmstream-claims-{unique}"}[url_kind]
    store = ClaimCheckStore(url)
    ref = store.put("doc-1/0", b"pixels" * 1000)
    assert store.get(ref) == b"pixels" * 1000
    assert store.put("doc-1/0", b"pixels" * 1000) == ref  # redelivery: same name, no second object
    other = store.put("doc-2/0", b"pixels" * 1000)
    assert other != ref  # same bytes in another record: its own object, so deleting one keeps the other
    store.delete(ref)
    assert store.get(other) == b"pixels" * 1000
    with pytest.raises((FileNotFoundError, OSError)):
        store.get(ref)
    store.delete(other)


def test_claim_check_refuses_references_outside_the_store(tmp_path, unique):
    store = ClaimCheckStore(str(tmp_path / "store"))
    (tmp_path / "secret").write_bytes(b"x")
    for ref in (str(tmp_path / "secret"), str(tmp_path / "store" / ".." / "secret"), "/etc/passwd"):
        with pytest.raises(ImageError) as info:
            store.get(ref)
        assert info.value.error_kind == "claim_check_error"
    memory = ClaimCheckStore(f"memory://claims-{unique}")
    with pytest.raises(ImageError):
        memory.get(f"memory://other-{unique}/x.bin")


def test_a_payload_whose_header_disagrees_is_refused_before_decoding():
    """A few MB of PNG can hold gigabytes of pixels: the size comes from the header first."""
    import struct
    import time
    import zlib

    png = encode(np.zeros((56, 56, 3), np.uint8), "png")
    ihdr = struct.pack(">II", 32000, 32000) + png[24:29]
    bomb = png[:16] + ihdr + struct.pack(">I", zlib.crc32(png[12:16] + ihdr)) + png[33:]
    started = time.monotonic()
    with pytest.raises(PayloadError, match="32000x32000, metadata says 56x56"):
        decode(bomb, "png", 56, 56)
    assert time.monotonic() - started < 1.0
    jpeg = encode(np.zeros((56, 84, 3), np.uint8), "jpeg")
    with pytest.raises(PayloadError, match="84x56, metadata says 56x56"):
        decode(jpeg, "jpeg", 56, 56)


def test_damaged_or_empty_payloads_are_errors_not_grey_images():
    rng = np.random.default_rng(3)
    jpeg = encode(rng.integers(0, 255, (224, 224, 3), dtype=np.uint8), "jpeg")
    with pytest.raises(PayloadError):
        decode(jpeg[: len(jpeg) // 3], "jpeg", 224, 224)  # libjpeg would fill the rest with grey and only warn
    for codec in ("raw", "png", "jpeg"):
        with pytest.raises(PayloadError, match="empty"):
            decode(b"", codec, 56, 56)
