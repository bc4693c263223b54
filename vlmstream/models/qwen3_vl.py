"""Qwen3-VL, dense (``qwen3_vl``: 2B-32B) and MoE (``qwen3_vl_moe``: 30B-A3B, 235B-A22B): 16 px patches, 2 x 2
merged into one visual token (so a factor of 32), mean and std 0.5, and Qwen2-VL's resize rule.

transformers 5.17 maps ``qwen3_vl`` and ``qwen3_vl_moe`` to ``Qwen2VLImageProcessor`` (auto/image_processing_auto.py),
whose ``smart_resize`` is the rule in ``qwen2_vl.py``: round each side to the factor, then scale down to
``size.longest_edge`` or up to ``size.shortest_edge``. (Qwen3-VL's *video* processor has its own smart_resize, which
first enlarges a frame with a side under the factor; images never take that path.) The class defaults are Qwen2-VL's
(56 x 56 to 28 x 28 x 1280 pixels): the released checkpoints' preprocessor_config.json sets
``size = {shortest_edge: 65,536, longest_edge: 16,777,216}``, 64 to 16,384 visual tokens of 32 x 32 pixels, and those
limits are what ``registry.family_of`` reads.

The tower (``Qwen3VLVisionModel``) adds DeepStack: the outputs of ``deepstack_visual_indexes`` blocks (three in
the released models) each go through a merger of their own and are added to the language model's first layers'
hidden states at the image positions. vLLM takes them concatenated after the main merger's output as one
``image_embeds`` tensor (``ModelFamily.image_embeds_width``).
"""

from __future__ import annotations

from vlmstream.models.family import ModelFamily, Tower
from vlmstream.models.qwen2_vl import MAX_VISUAL_TOKENS, smart_resize

PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # 32
# Qwen3-VL's processor normalises with mean and std 0.5 (IMAGENET_STANDARD_*), not CLIP's.
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)
# The released checkpoints' preprocessor_config.json: 64 to 16,384 visual tokens.
MIN_PIXELS = FACTOR * FACTOR * 64  # 65,536
MAX_PIXELS = FACTOR * FACTOR * MAX_VISUAL_TOKENS  # 16,777,216
# Qwen2VLImageProcessor's class default, for a checkpoint whose preprocessor config names no size.
PROCESSOR_MAX_PIXELS = 28 * 28 * 1280

_MODELING = "transformers.models.{0}.modeling_{0}"
_CONFIGURATION = "transformers.models.{0}.configuration_{0}"

QWEN3_VL = ModelFamily(
    name="qwen3_vl",
    model_types=("qwen3_vl", "qwen3_vl_moe"),
    architectures=("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"),
    patch_size=PATCH_SIZE,
    merge_size=MERGE_SIZE,
    temporal_patch_size=TEMPORAL_PATCH_SIZE,
    image_mean=MEAN,
    image_std=STD,
    min_pixels=MIN_PIXELS,
    max_pixels=MAX_PIXELS,
    processor_max_pixels=PROCESSOR_MAX_PIXELS,
    size_rule=smart_resize,
    towers={
        "qwen3_vl": Tower(f"{_MODELING.format('qwen3_vl')}:Qwen3VLVisionModel",
                          f"{_CONFIGURATION.format('qwen3_vl')}:Qwen3VLVisionConfig"),
        "qwen3_vl_moe": Tower(f"{_MODELING.format('qwen3_vl_moe')}:Qwen3VLMoeVisionModel",
                              f"{_CONFIGURATION.format('qwen3_vl_moe')}:Qwen3VLMoeVisionConfig"),
    },
)
FAMILY = QWEN3_VL
