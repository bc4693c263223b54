"""Qwen2-VL and Qwen2.5-VL: one image input (14 px patches, 2 x 2 merged into one visual token, CLIP
normalisation, the smart_resize rule), so one family.

``smart_resize`` is a copy of transformers' ``qwen2_vl.image_processing_qwen2_vl.smart_resize``, kept here so the
decode workers need neither torch nor transformers; tests/test_decode_equivalence.py checks it against the
original with hypothesis.
"""

from __future__ import annotations

import math

from vlmstream.images.errors import ImageError
from vlmstream.models.family import ModelFamily, Tower

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # 28
# OpenAI CLIP's normalisation, which both models' image processors use.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS = 56 * 56
# The released checkpoints' preprocessor_config.json: 16,384 visual tokens, 12,845,056 pixels (12.8 MP).
MAX_VISUAL_TOKENS = 16384
MAX_PIXELS = FACTOR * FACTOR * MAX_VISUAL_TOKENS
# Qwen2VLImageProcessor's own default (and smart_resize's): 1,280 visual tokens, 1,003,520 pixels.
PROCESSOR_MAX_PIXELS = FACTOR * FACTOR * 1280
# The rule refuses a longer side more than this many times the shorter one.
MAX_ASPECT_RATIO = 200


class BadAspectRatio(ImageError):
    error_kind = "decode_bad_aspect"


def smart_resize(
    height: int,
    width: int,
    factor: int = FACTOR,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = PROCESSOR_MAX_PIXELS,
) -> tuple[int, int]:
    """The Qwen2-VL rule, exactly: both sides multiples of ``factor``, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible. Raises ``BadAspectRatio`` (a ValueError in transformers) when the
    longer side is more than 200 times the shorter one. The defaults are transformers' own."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise BadAspectRatio(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
            f"got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


QWEN2_VL = ModelFamily(
    name="qwen2_vl",
    model_types=("qwen2_vl", "qwen2_5_vl"),
    architectures=("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"),
    patch_size=PATCH_SIZE,
    merge_size=MERGE_SIZE,
    temporal_patch_size=TEMPORAL_PATCH_SIZE,
    image_mean=CLIP_MEAN,
    image_std=CLIP_STD,
    min_pixels=MIN_PIXELS,
    max_pixels=MAX_PIXELS,
    processor_max_pixels=PROCESSOR_MAX_PIXELS,
    size_rule=smart_resize,
    towers={
        "qwen2_5_vl": Tower("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
                            "transformers.models.qwen2_5_vl.configuration_qwen2_5_vl:Qwen2_5_VLVisionConfig",
                            windowed=True),
        "qwen2_vl": Tower("transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VisionTransformerPretrainedModel",
                          "transformers.models.qwen2_vl.configuration_qwen2_vl:Qwen2VLVisionConfig"),
    },
    # Qwen2.5-VL's template adds the default system turn.
    prompt_template=("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                     "{image}{prompt}<|im_end|>\n<|im_start|>assistant\n"),
)
FAMILY = QWEN2_VL
