"""Damaged files of every format: the stage returns a value (image or failure), never raises."""

from __future__ import annotations

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
    original = bytearray(SAMPLES[name])
    how = data.draw(st.sampled_from(["flip", "cut", "splice"]))
    if how == "cut":
        damaged = original[: data.draw(st.integers(0, len(original) - 1))]
    else:
        damaged = original
        for _ in range(data.draw(st.integers(1, 8))):
            at = data.draw(st.integers(0, len(damaged) - 1))
            if how == "flip":
                damaged[at] ^= data.draw(st.integers(1, 255))
            else:
                damaged[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    path = tmp_path / "damaged.bin"
    path.write_bytes(bytes(damaged))
    stage = DecodeStage(DecodeSettings(allowed_roots=[str(tmp_path)], codec="raw", max_source_pixels=50_000_000), "")
    result = stage(str(path))
    assert isinstance(result, (PreparedImage, ImageFailure))
    if isinstance(result, ImageFailure):
        assert result.error_kind in KNOWN_KINDS, (result.error_kind, result.detail)
    else:
        assert len(result.data) == result.width * result.height * 3
