"""Damaged files of every format: the stage returns a value (image or failure), never raises."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.decode.stage import DecodeStage
from consumers.decode.types import ImageFailure, PreparedImage
from tests import images
from vlmstream.config import DecodeSettings

SAMPLES = images.supported_formats()
KNOWN_KINDS = {"decode_not_an_image", "decode_truncated", "decode_corrupt", "decode_too_many_pixels",
               "decode_unsupported", "decode_bad_aspect"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(SAMPLES)), data=st.data())
def test_damaged_images_give_values_not_exceptions(tmp_path, name, data):
    path = tmp_path / "damaged.bin"
    path.write_bytes(images.damaged(data, SAMPLES[name]))
    stage = DecodeStage(DecodeSettings(allowed_roots=[str(tmp_path)], codec="raw", max_source_pixels=50_000_000), "")
    result = stage(str(path))
    assert isinstance(result, (PreparedImage, ImageFailure))
    if isinstance(result, ImageFailure):
        assert result.error_kind in KNOWN_KINDS, (result.error_kind, result.detail)
    else:
        assert len(result.data) == result.width * result.height * 3


def _avif_with_noise_for_pixels() -> bytes:
    import numpy as np

    avif = SAMPLES["avif"]
    pixels_at = avif.index(b"mdat") + 4
    return avif[:pixels_at] + np.random.default_rng(0).bytes(len(avif) - pixels_at)


def _heif_understating_its_size() -> bytes:
    """A 320x240 HEIF whose ispe box claims 16x16: libheif refuses the coded picture as over its size limit."""
    import struct

    heif = bytearray(images._save(images._photo_like(320, 240, 1), "HEIF", quality=50))
    struct.pack_into(">II", heif, heif.index(b"ispe") + 8, 16, 16)
    return bytes(heif)


@pytest.mark.parametrize("fmt, make", [("avif", _avif_with_noise_for_pixels), ("heif", _heif_understating_its_size)])
def test_damaged_avif_and_heif_are_corrupt_not_unexpected(tmp_path, fmt, make):
    """Pillow's AVIF plugin and pillow-heif raise RuntimeError for damaged pixels ("Decoding of color planes
    failed", "Security limit exceeded"); those made the fuzz test above fail now and then."""
    if fmt not in SAMPLES:
        pytest.skip(f"no {fmt} decoder in this environment")
    path = tmp_path / "damaged.bin"
    path.write_bytes(make())
    result = DecodeStage(DecodeSettings(allowed_roots=[str(tmp_path)], codec="raw"), "")(str(path))
    assert isinstance(result, ImageFailure) and result.error_kind == "decode_corrupt", result
    assert "RuntimeError" in result.detail
