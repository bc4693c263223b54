"""The model family registry: a checkpoint's config.json names its family, its preprocessor config the pixel
limits; the family's numbers are transformers' own."""

from __future__ import annotations

import json

import pydantic
import pytest

from consumers.infer.tiny_model import (QWEN3_5_VISION_CONFIG, QWEN3_VL_VISION_CONFIG, TEXT_CONFIG, VISION_CONFIG,
                                       model_config_dict, write_processor_files)
from vlmstream.config import DecodeSettings
from vlmstream.models.qwen2_vl import QWEN2_VL
from vlmstream.models.registry import UnknownModelFamily, deepstack_levels, family_named, family_of


def tiny_checkpoint(path, *, model_type=None, architectures=None, max_pixels=None):
    """The tiny model's config.json and preprocessor_config.json (no weights), optionally renamed."""
    path.mkdir(parents=True, exist_ok=True)
    config = model_config_dict(dict(TEXT_CONFIG), dict(VISION_CONFIG))
    if model_type is not None:
        config["model_type"] = model_type
    if architectures is not None:
        config["architectures"] = architectures
    (path / "config.json").write_text(json.dumps(config))
    if max_pixels is None:
        write_processor_files(path)
    else:
        write_processor_files(path, max_pixels=max_pixels)
    return path


def test_the_tiny_qwen25_vl_is_found_with_its_pixel_limits(tmp_path):
    family = family_of(tiny_checkpoint(tmp_path / "tiny", max_pixels=256 * 28 * 28))
    assert family.name == "qwen2_vl" and family.factor == 28
    assert (family.min_pixels, family.max_pixels) == (56 * 56, 256 * 28 * 28)
    assert family.target_size(1000, 2000) == (308, 616)  # 200,704 px budget: 11 x 22 factors


def test_a_released_checkpoints_default_budget_is_16384_visual_tokens(tmp_path):
    family = family_of(tiny_checkpoint(tmp_path / "tiny"))
    assert family.max_pixels == 12_845_056 and family.max_visual_tokens == 16384


@pytest.mark.parametrize("model_type, architectures", [
    ("qwen2_vl", ["Qwen2VLForConditionalGeneration"]),
    ("qwen2_5_vl", ["Qwen2_5_VLForConditionalGeneration"]),
    (None, ["Qwen2VLForConditionalGeneration"]),  # no model_type: the architecture decides
])
def test_qwen2_vl_and_qwen25_vl_are_one_family(tmp_path, model_type, architectures):
    path = tiny_checkpoint(tmp_path / "tiny", model_type=model_type, architectures=architectures)
    if model_type is None:
        config = json.loads((path / "config.json").read_text())
        del config["model_type"]
        (path / "config.json").write_text(json.dumps(config))
    assert family_of(path) == QWEN2_VL


def test_an_unknown_image_text_model_takes_the_generic_path_and_an_unknown_text_model_fails_naming_it(tmp_path):
    path = tiny_checkpoint(tmp_path / "other", model_type="llava_next", architectures=["LlavaNextForConditionalGeneration"])
    assert family_of(path).name == "generic"
    config = json.loads((path / "config.json").read_text())
    del config["vision_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownModelFamily, match="'llava_next'"):
        family_of(path)
    # With a vision part but no image processor settings: the generic path cannot cap, and the error says what to add.
    config["vision_config"] = {}
    (path / "config.json").write_text(json.dumps(config))
    (path / "preprocessor_config.json").unlink()
    with pytest.raises(UnknownModelFamily, match="'llava_next'.*preprocessor_config.json"):
        family_of(path)


def test_without_a_preprocessor_config_the_processor_defaults_apply(tmp_path):
    path = tiny_checkpoint(tmp_path / "tiny")
    (path / "preprocessor_config.json").unlink()
    assert family_of(path).max_pixels == 28 * 28 * 1280


def test_transformers_5_size_keys_are_read(tmp_path):
    path = tiny_checkpoint(tmp_path / "tiny")
    processor = json.loads((path / "preprocessor_config.json").read_text())
    del processor["min_pixels"], processor["max_pixels"]
    processor["size"] = {"shortest_edge": 100 * 28 * 28, "longest_edge": 512 * 28 * 28}
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    family = family_of(path)
    assert (family.min_pixels, family.max_pixels) == (100 * 28 * 28, 512 * 28 * 28)


def test_the_family_is_transformers_processor():
    import inspect

    from transformers.models.qwen2_vl import image_processing_qwen2_vl as reference

    processor = reference.Qwen2VLImageProcessor()
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (
        QWEN2_VL.patch_size, QWEN2_VL.merge_size, QWEN2_VL.temporal_patch_size)
    assert tuple(processor.image_mean) == QWEN2_VL.image_mean and tuple(processor.image_std) == QWEN2_VL.image_std
    # The processor's class-level size dict is changed in place by any processor built with max_pixels (the tiny
    # model's, in other tests), so the defaults are read from smart_resize's signature.
    defaults = inspect.signature(reference.smart_resize).parameters
    assert (defaults["factor"].default, defaults["min_pixels"].default, defaults["max_pixels"].default) == (
        QWEN2_VL.factor, QWEN2_VL.min_pixels, QWEN2_VL.processor_max_pixels)


def test_grid_and_visual_tokens():
    assert QWEN2_VL.grid_thw(308, 644) == (1, 22, 46)
    assert QWEN2_VL.visual_tokens((1, 22, 46)) == 22 * 46 // 4
    assert QWEN2_VL.size_problem(308, 644) is None
    assert "multiple of 28" in QWEN2_VL.size_problem(300, 644)


def test_decode_settings_name_a_known_family():
    assert family_named(DecodeSettings().model_family) == QWEN2_VL
    with pytest.raises(pydantic.ValidationError, match="unknown model family 'qwen9_vl'"):
        DecodeSettings(model_family="qwen9_vl")


def test_deepstack_levels_come_from_the_checkpoints_vision_config(tmp_path):
    """The vLLM engine keeps vLLM's own tower for a model whose image embeddings carry DeepStack levels."""
    for name, vision, levels in (("qwen3_vl", QWEN3_VL_VISION_CONFIG, 2), ("qwen3_5", QWEN3_5_VISION_CONFIG, 0),
                                 ("qwen2_5_vl", VISION_CONFIG, 0)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": name, "vision_config": dict(vision)}))
        assert deepstack_levels(folder) == levels, name
    assert deepstack_levels(tmp_path / "no-such-folder") == 0
