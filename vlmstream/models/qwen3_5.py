"""Qwen3.5 (``qwen3_5``, natively multimodal; dense checkpoints such as Qwen3.5-9B/27B): its vision part.

transformers 5.17's ``Qwen3_5VisionModel`` is Qwen3-VL's tower without DeepStack (16 px patches, 2 x 2 merge, a
learned position grid resampled to each image, LayerNorm blocks, one merger), and auto/image_processing_auto.py maps
``qwen3_5`` to ``Qwen2VLImageProcessor``, so its image input is Qwen3-VL's: factor 32, mean and std 0.5, the
Qwen2-VL resize rule, pixel limits from the checkpoint's ``size``. Only the token ids differ (``<|image_pad|>`` is
248056), and those come from the checkpoint's own tokenizer and config. ``qwen3_5_moe`` (Qwen3.5-35B-A3B and up)
has the same tower under another class name.
"""

from __future__ import annotations

from dataclasses import replace

from vlmstream.models.family import Tower
from vlmstream.models.qwen3_vl import QWEN3_VL

QWEN3_5 = replace(
    QWEN3_VL,
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_moe"),
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
    towers={
        "qwen3_5": Tower("transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5VisionModel",
                         "transformers.models.qwen3_5.configuration_qwen3_5:Qwen3_5VisionConfig"),
        "qwen3_5_moe": Tower("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5MoeVisionModel",
                             "transformers.models.qwen3_5_moe.configuration_qwen3_5_moe:Qwen3_5MoeVisionConfig"),
    },
    # Qwen3.5 thinks unless told not to; an empty thought block is its chat template's way to skip it.
    prompt_template="<|im_start|>user\n{image}{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
)
FAMILY = QWEN3_5
