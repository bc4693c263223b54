"""Tiny random-weight models of each family, written locally, with no download.

The default (``qwen2.5-vl``) is a Qwen2.5-VL with the real architecture (window-attention vision tower, patch
merger, M-RoPE language model) and a tokenizer whose special tokens sit at the real Qwen2.5 ids (151643-151656), so
every code path that runs the 7B model (prompt building, placeholder expansion, grids, generate, vLLM's processor)
runs on it too, only ~10 M parameters big. Its text is noise; its shapes and token accounting are exact.
``TINY_FAMILIES`` adds the same for Qwen2-VL (its LayerNorm tower), Qwen3-VL (dense and MoE; a DeepStack tower with two levels) and Qwen3.5 (its
gated-delta/attention hybrid language model, the real 248k vocabulary and ids), each with the family's
preprocessor config (vlmstream/models/). The generic path has two: Gemma 3 (a fixed square resize) and
LLaVA-OneVision (tiles chosen by grid pinpoints).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmstream.models.family import ModelFamily
from vlmstream.models.qwen2_vl import QWEN2_VL
from vlmstream.models.qwen3_5 import QWEN3_5
from vlmstream.models.qwen3_vl import QWEN3_VL

TINY_MODEL_DIRNAME = "tiny-qwen2.5-vl"
# Bumped whenever the folder's contents change, so a cached older folder is rebuilt.
TINY_MODEL_VERSION = 2
_MARKER = "vlmstream-tiny-model.json"

FIRST_SPECIAL_ID = 151643
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
IMAGE_PAD_ID = 151655
# The real Qwen2.5 vocabulary is padded to a multiple of 128 past the last special token.
VOCAB_SIZE = 151936

# Qwen2.5-VL's chat template, reduced to what a single-image request needs (no tools, no video timing).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT_CONFIG = {
    "model_type": "qwen2_5_vl_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    # head_dim 16 -> 8 rotary frequencies split over (temporal, height, width)
    "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [2, 3, 3]},
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True, "attention_dropout": 0.0,
    "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 2, "bos_token_id": 151643,
    # 0.2, not the real 0.02: at 0.02 the tied embeddings make every greedy step repeat one token, and tests
    # need outputs that change with the image and the batch position to catch padding or ordering bugs.
    "eos_token_id": 151645, "initializer_range": 0.2, "use_cache": True,
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
}
VISION_CONFIG = {
    "model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
    "out_hidden_size": 64, "patch_size": QWEN2_VL.patch_size, "spatial_merge_size": QWEN2_VL.merge_size,
    "temporal_patch_size": QWEN2_VL.temporal_patch_size,
    # 112 px windows = 4x4 merged tokens, as in the real model; block 1 attends over the whole image.
    "window_size": 112, "fullatt_block_indexes": [1], "tokens_per_second": 2, "hidden_act": "silu",
    "in_chans": 3, "in_channels": 3, "initializer_range": 0.02,
}


def byte_level_tokenizer(first_special_id: int = 0):
    """A BPE tokenizer of the 256 byte symbols and no merges (one token per byte), with fillers up to
    ``first_special_id`` so that the special tokens added next land at a real checkpoint's ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for i in range(len(vocab), first_special_id):
        vocab[f"<filler_{i}>"] = i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def write_tokenizer_files(path: Path, first_special_id: int = FIRST_SPECIAL_ID,
                          chat_template: str = CHAT_TEMPLATE) -> None:
    """A byte-level tokenizer with the real special-token ids: ids below ``first_special_id`` (151643 for Qwen2.5
    and Qwen3-VL, 248044 for Qwen3.5) are the 256 byte symbols and fillers, so text costs one token per byte
    (more than the real BPE, never fewer)."""
    tokenizer = byte_level_tokenizer(first_special_id)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    ids = {s: tokenizer.token_to_id(s) for s in SPECIAL_TOKENS}
    if ids["<|endoftext|>"] != first_special_id or ids["<|image_pad|>"] != first_special_id + 12:
        raise RuntimeError(f"special tokens landed at the wrong ids: {ids}")
    tokenizer.save(str(path / "tokenizer.json"))
    added = {str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for s in SPECIAL_TOKENS}
    _dump(path / "tokenizer_config.json", {
        "tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "unk_token": None, "chat_template": chat_template, "model_max_length": 131072,
        "add_prefix_space": False, "errors": "replace", "clean_up_tokenization_spaces": False,
        "split_special_tokens": False, "added_tokens_decoder": added, "additional_special_tokens": SPECIAL_TOKENS[1:],
    })
    _dump(path / "chat_template.json", {"chat_template": chat_template})


def write_processor_files(path: Path, max_pixels: int = QWEN2_VL.max_pixels) -> None:
    """The released checkpoints' processor settings: the family's sizes, normalisation and pixel limits."""
    family = QWEN2_VL
    _dump(path / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "min_pixels": family.min_pixels, "max_pixels": max_pixels, "patch_size": family.patch_size,
        "merge_size": family.merge_size, "temporal_patch_size": family.temporal_patch_size,
        "image_mean": list(family.image_mean), "image_std": list(family.image_std), "do_resize": True,
        "do_normalize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_convert_rgb": True,
    })
    _dump(path / "generation_config.json", {
        "bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643, "do_sample": False,
    })


def write_size_processor_files(path: Path, family: ModelFamily, processor_class: str, first_special_id: int,
                               max_pixels: int | None = None) -> None:
    """Processor settings in the layout of the Qwen3-VL and Qwen3.5 releases (transformers 5's ``size`` with
    ``shortest_edge``/``longest_edge``)."""
    _dump(path / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": processor_class,
        "size": {"shortest_edge": family.min_pixels, "longest_edge": max_pixels or family.max_pixels},
        "patch_size": family.patch_size, "merge_size": family.merge_size,
        "temporal_patch_size": family.temporal_patch_size, "image_mean": list(family.image_mean),
        "image_std": list(family.image_std), "do_resize": True, "do_normalize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_convert_rgb": True,
    })
    end_of_text, im_end = first_special_id, first_special_id + 2
    _dump(path / "generation_config.json", {
        "bos_token_id": end_of_text, "eos_token_id": [im_end, end_of_text], "pad_token_id": end_of_text,
        "do_sample": False,
    })


def model_config_dict(text_config: dict, vision_config: dict, dtype: str = "float32") -> dict:
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "torch_dtype": dtype, "bos_token_id": 151643, "eos_token_id": 151645, "image_token_id": 151655,
        "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "vision_token_id": 151654, "tie_word_embeddings": text_config["tie_word_embeddings"], "transformers_version": "4.49.0",
        "text_config": text_config, "vision_config": vision_config,
    }
    # vLLM and transformers 4.x read the text fields at the top level (the layout of the real config.json).
    for key, value in text_config.items():
        if key != "model_type":
            config.setdefault(key, value)
    return config


# Qwen3-VL's chat template reduced the same way: no default system turn.
QWEN3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}", "")
# Qwen3.5's: its template opens an empty thought block when thinking is off, as it is for captions.
QWEN3_5_CHAT_TEMPLATE = QWEN3_CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}")

# Qwen3-VL: head_dim 16 -> 8 rotary frequencies, interleaved over (temporal, height, width) as in the real model.
_QWEN3_ROPE = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
QWEN3_VL_TEXT_CONFIG = {
    "model_type": "qwen3_vl_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 32768, "rope_parameters": _QWEN3_ROPE, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": True, "attention_dropout": 0.0, "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "initializer_range": 0.2, "use_cache": True,
}
QWEN3_VL_MOE_TEXT_CONFIG = {
    **QWEN3_VL_TEXT_CONFIG, "model_type": "qwen3_vl_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
}
QWEN3_VL_VISION_CONFIG = {
    "model_type": "qwen3_vl", "depth": 3, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
    "out_hidden_size": 64, "patch_size": QWEN3_VL.patch_size, "spatial_merge_size": QWEN3_VL.merge_size,
    "temporal_patch_size": QWEN3_VL.temporal_patch_size, "in_channels": 3, "hidden_act": "gelu_pytorch_tanh",
    # A 16 x 16 learned position grid (the real one is 48 x 48), resampled to every image's grid.
    "num_position_embeddings": 256,
    # Two DeepStack levels (the real models have three, at blocks 8, 16, 24): image_embeds are 3 x 64 wide.
    "deepstack_visual_indexes": [0, 1], "initializer_range": 0.02,
}
QWEN3_5_FIRST_SPECIAL_ID = 248044
QWEN3_5_TEXT_CONFIG = {
    "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 248320,
    # One gated-delta (linear attention) layer and one full-attention layer: the real models' 3:1 pattern, short.
    "layer_types": ["linear_attention", "full_attention"], "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    # head_dim 32 with a quarter rotary -> 4 frequencies over (temporal, height, width).
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [2, 1, 1],
                        "mrope_interleaved": True, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True,
    "attention_dropout": 0.0, "attention_bias": False, "bos_token_id": QWEN3_5_FIRST_SPECIAL_ID,
    "eos_token_id": QWEN3_5_FIRST_SPECIAL_ID + 2, "initializer_range": 0.2, "use_cache": True,
}
QWEN3_5_VISION_CONFIG = {k: v for k, v in QWEN3_VL_VISION_CONFIG.items() if k != "deepstack_visual_indexes"}
QWEN3_5_VISION_CONFIG["model_type"] = "qwen3_5"


@dataclass(frozen=True)
class TinyFamily:
    """One tiny checkpoint: its config.json contents, its transformers classes, tokenizer ids and processor."""

    name: str
    family: ModelFamily
    model_type: str
    architecture: str
    config_class: str
    text_config: dict = field(repr=False)
    vision_config: dict = field(repr=False)
    first_special_id: int = FIRST_SPECIAL_ID
    chat_template: str = field(default=QWEN3_CHAT_TEMPLATE, repr=False)
    processor_class: str = "Qwen3VLProcessor"

    @property
    def image_token_id(self) -> int:
        return self.first_special_id + 12

    def config_dict(self) -> dict:
        first = self.first_special_id
        config = {
            "architectures": [self.architecture], "model_type": self.model_type, "torch_dtype": "float32",
            "image_token_id": first + 12, "video_token_id": first + 13, "vision_start_token_id": first + 9,
            "vision_end_token_id": first + 10, "tie_word_embeddings": self.text_config["tie_word_embeddings"],
            "transformers_version": "5.17.0", "text_config": dict(self.text_config),
            "vision_config": dict(self.vision_config),
        }
        return config


QWEN2_VL_TEXT_CONFIG = {**TEXT_CONFIG, "model_type": "qwen2_vl_text"}
for _key in ("image_token_id", "video_token_id", "vision_start_token_id"):
    QWEN2_VL_TEXT_CONFIG.pop(_key)
# Qwen2-VL's tower: LayerNorm blocks, a quick-GELU MLP (embed_dim x mlp_ratio), no windows; "hidden_size" is the
# merger's output width, the language model's.
QWEN2_VL_VISION_CONFIG = {
    "model_type": "qwen2_vl", "depth": 2, "embed_dim": 64, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 4,
    "hidden_act": "quick_gelu", "patch_size": QWEN2_VL.patch_size, "spatial_merge_size": QWEN2_VL.merge_size,
    "temporal_patch_size": QWEN2_VL.temporal_patch_size, "in_channels": 3, "initializer_range": 0.02,
}

TINY_FAMILIES = {
    "qwen2-vl": TinyFamily("qwen2-vl", QWEN2_VL, "qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen2VLConfig",
                           QWEN2_VL_TEXT_CONFIG, QWEN2_VL_VISION_CONFIG, chat_template=CHAT_TEMPLATE,
                           processor_class="Qwen2VLProcessor"),
    "qwen3-vl": TinyFamily("qwen3-vl", QWEN3_VL, "qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLConfig",
                           QWEN3_VL_TEXT_CONFIG, QWEN3_VL_VISION_CONFIG),
    "qwen3-vl-moe": TinyFamily("qwen3-vl-moe", QWEN3_VL, "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration",
                               "Qwen3VLMoeConfig", QWEN3_VL_MOE_TEXT_CONFIG,
                               {**QWEN3_VL_VISION_CONFIG, "model_type": "qwen3_vl_moe"}),
    "qwen3.5": TinyFamily("qwen3.5", QWEN3_5, "qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3_5Config",
                          QWEN3_5_TEXT_CONFIG, QWEN3_5_VISION_CONFIG, first_special_id=QWEN3_5_FIRST_SPECIAL_ID,
                          chat_template=QWEN3_5_CHAT_TEMPLATE, processor_class="Qwen3VLProcessor"),
}
DEFAULT_TINY_FAMILY = "qwen2.5-vl"
# The generic path's tiny models: no family module describes them; their own processors do the model's rest.
# Gemma 3 resizes to a fixed square; LLaVA-OneVision tiles by its grid pinpoints (the generic cap's tiling rule).
GENERIC_TINY = "gemma3"
GENERIC_TILING_TINY = "llava-onevision"
TINY_FAMILY_NAMES = (DEFAULT_TINY_FAMILY, *TINY_FAMILIES, GENERIC_TINY, GENERIC_TILING_TINY)

GEMMA3_NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]
GEMMA3_SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# Gemma 3's chat template reduced to single-image user turns.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def write_gemma3_tokenizer_and_processor(path: Path, image_size: int, tokens_per_image: int,
                                        vocab_size: int = 0) -> dict[str, int]:
    """A byte-level tokenizer carrying Gemma 3's chat and image tokens, and Gemma 3's processor files (a fixed
    ``image_size`` square resize, no pan and scan, ``tokens_per_image`` soft tokens). With ``vocab_size``, fillers
    take the ids up to the special tokens, which end the vocabulary, so any id the model can emit decodes. Returns
    the tokens' ids and the vocabulary's size (``"vocab"``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    base = ["<pad>", "<eos>", "<bos>"]
    vocab = {symbol: i for i, symbol in enumerate(base + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for i in range(len(vocab), vocab_size - len(GEMMA3_SPECIALS) - len(GEMMA3_NEWLINES)):
        vocab[f"<filler_{i}>"] = i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # Gemma's own vocabulary has runs of one to four newlines as single tokens; vLLM's Gemma 3 processor looks them
    # up by text around the image's "\n\n<start_of_image>...<end_of_image>\n\n".
    tokenizer.add_tokens([AddedToken(n, normalized=False) for n in GEMMA3_NEWLINES])
    tokenizer.add_special_tokens(base + GEMMA3_SPECIALS)
    ids = {token: tokenizer.token_to_id(token) for token in base + GEMMA3_SPECIALS}
    tokenizer.save(str(path / "tokenizer.json"))
    _dump(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": None, "chat_template": GEMMA3_CHAT_TEMPLATE, "padding_side": "left",
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"}})
    _dump(path / "chat_template.json", {"chat_template": GEMMA3_CHAT_TEMPLATE})
    _dump(path / "preprocessor_config.json", {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": image_size, "width": image_size}, "do_resize": True, "resample": 2, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "do_convert_rgb": True, "do_pan_and_scan": None})
    _dump(path / "processor_config.json", {"processor_class": "Gemma3Processor", "image_seq_length": tokens_per_image})
    ids["vocab"] = tokenizer.get_vocab_size(with_added_tokens=True)
    return ids


def write_tiny_gemma3(path: str | Path, seed: int = 0) -> Path:
    """A tiny random-weight Gemma 3 (SigLIP tower at 224 px, 16 image tokens, two text layers) with a byte-level
    tokenizer carrying Gemma 3's image tokens, and its processor (fixed 224 x 224 resize, no pan and scan)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = write_gemma3_tokenizer_and_processor(path, image_size=224, tokens_per_image=16)
    config = Gemma3Config(
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "vocab_size": ids["vocab"],
                     "sliding_window": 64, "max_position_embeddings": 4096, "initializer_range": 0.2,
                     "layer_types": ["sliding_attention", "full_attention"]},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                       "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 224, "patch_size": 14},
        mm_tokens_per_image=16, **gemma3_token_ids(ids))
    config.architectures = ["Gemma3ForConditionalGeneration"]
    return _write_weights(path, Gemma3ForConditionalGeneration, config, seed, GENERIC_TINY)


def _write_weights(path: Path, model_class, config, seed: int, family: str) -> Path:
    """The model's random weights drawn from ``seed`` (the callers' random state untouched) saved into ``path``,
    then the marker that says the folder is whole."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).eval()
    model.save_pretrained(path)
    _dump(path / _MARKER, {"version": TINY_MODEL_VERSION, "seed": seed, "family": family})
    return path


# LLaVA-OneVision's tiles, scaled down: 56 px (4 x 4 SigLIP patches of 14 px; the released model's are 384 px,
# 27 x 27) in grids of up to 6 x 6 tiles, as the released pinpoints run from 384 to 2304 px.
LLAVA_OV_TILE = 56


def grid_pinpoints(tile: int) -> list[list[int]]:
    """LLaVA-OneVision's best-resolution candidates: every grid of 1 to 6 x 1 to 6 tiles."""
    return [[tile * rows, tile * columns] for rows in range(1, 7) for columns in range(1, 7)]


LLAVA_OV_PINPOINTS = grid_pinpoints(LLAVA_OV_TILE)
LLAVA_OV_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
# LLaVA-OneVision's (Qwen2) chat template, reduced to single-image user turns.
LLAVA_OV_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_llava_onevision_folder(path: str | Path, tile: int, tokens_per_tile: int, vision_config: dict,
                                 text_config: dict, first_special_id: int = 0) -> tuple[Path, Any]:
    """A LLaVA-OneVision checkpoint folder without weights: a byte-level tokenizer whose special tokens start at
    ``first_special_id`` (fillers below it; the released model's are at 151643-151647) or right after the byte
    symbols, and the processor as transformers 5 saves one (the image processor's settings inside
    ``processor_config.json``, no ``preprocessor_config.json``): ``tile`` px tiles, grid pinpoints of up to 6 x 6
    tiles, ``anyres_max_9``. Returns the folder and the ``LlavaOnevisionConfig`` to build or save."""
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionImageProcessor, LlavaOnevisionProcessor,
                              LlavaOnevisionVideoProcessor, PreTrainedTokenizerFast)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_level_tokenizer(first_special_id)
    tokenizer.add_special_tokens(LLAVA_OV_SPECIALS)
    ids = {token: tokenizer.token_to_id(token) for token in LLAVA_OV_SPECIALS}
    text_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left",
        extra_special_tokens={"image_token": "<image>", "video_token": "<video>"}, chat_template=LLAVA_OV_CHAT_TEMPLATE)
    pinpoints = grid_pinpoints(tile)
    images = LlavaOnevisionImageProcessor(size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints,
                                          image_mean=[0.5] * 3, image_std=[0.5] * 3)
    LlavaOnevisionProcessor(image_processor=images, tokenizer=text_tokenizer,
                            video_processor=LlavaOnevisionVideoProcessor(), num_image_tokens=tokens_per_tile,
                            vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
                            chat_template=LLAVA_OV_CHAT_TEMPLATE).save_pretrained(path)
    text = {"vocab_size": max(text_config.get("vocab_size", 0), tokenizer.get_vocab_size()), **text_config,
            "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    config = LlavaOnevisionConfig(
        vision_config={"model_type": "siglip_vision_model", "image_size": tile, "vision_use_head": False,
                       **vision_config},
        text_config={"model_type": "qwen2", **text}, image_token_index=ids["<image>"],
        video_token_index=ids["<video>"], image_grid_pinpoints=pinpoints, vision_feature_select_strategy="full",
        vision_feature_layer=-1, vision_aspect_ratio="anyres_max_9")
    config.architectures = ["LlavaOnevisionForConditionalGeneration"]
    config.eos_token_id, config.pad_token_id = ids["<|im_end|>"], ids["<|endoftext|>"]
    return path, config


def write_tiny_llava_onevision(path: str | Path, seed: int = 0) -> Path:
    """A tiny random-weight LLaVA-OneVision (SigLIP tower on 56 px tiles, grid pinpoints up to 6 x 6 tiles,
    ``anyres_max_9``, two Qwen2 text layers) with its processor as transformers 5 saves one
    (``write_llava_onevision_folder``)."""
    from transformers import LlavaOnevisionForConditionalGeneration

    path, config = write_llava_onevision_folder(
        path, LLAVA_OV_TILE, (LLAVA_OV_TILE // 14) ** 2,
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "patch_size": 14},
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "max_position_embeddings": 8192, "initializer_range": 0.2})
    return _write_weights(path, LlavaOnevisionForConditionalGeneration, config, seed, GENERIC_TILING_TINY)


def gemma3_token_ids(ids: dict[str, int]) -> dict:
    """Gemma3Config's token arguments for the tokenizer ``write_gemma3_tokenizer_and_processor`` wrote."""
    return dict(boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                image_token_index=ids["<image_soft_token>"], bos_token_id=ids["<bos>"],
                eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]], pad_token_id=ids["<pad>"])


def write_tiny_family_model(path: str | Path, name: str, seed: int = 0) -> Path:
    """Write the tiny model of family ``name`` (one of ``TINY_FAMILY_NAMES``) at ``path``; deterministic in
    ``seed``."""
    if name == DEFAULT_TINY_FAMILY:
        return write_tiny_model(path, seed)
    if name == GENERIC_TINY:
        return write_tiny_gemma3(path, seed)
    if name == GENERIC_TILING_TINY:
        return write_tiny_llava_onevision(path, seed)
    try:
        tiny = TINY_FAMILIES[name]
    except KeyError:
        raise ValueError(f"no tiny model of family {name!r}; known: {', '.join(TINY_FAMILY_NAMES)}") from None
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_dict = tiny.config_dict()
    config_class = getattr(transformers, tiny.config_class)
    config = config_class(**{k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")})
    config.architectures = config_dict["architectures"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, tiny.architecture)(config).eval()
    model.save_pretrained(path)
    write_tokenizer_files(path, tiny.first_special_id, tiny.chat_template)
    write_size_processor_files(path, tiny.family, tiny.processor_class, tiny.first_special_id)
    _dump(path / _MARKER, {"version": TINY_MODEL_VERSION, "seed": seed, "family": name})
    return path


def write_tiny_model(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny Qwen2.5-VL folder at ``path`` (created if missing) and return it. Deterministic in ``seed``."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_dict = model_config_dict(dict(TEXT_CONFIG), dict(VISION_CONFIG))
    config = Qwen2_5_VLConfig(**{k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")})
    config.architectures = config_dict["architectures"]
    # Seed the global generator only for the duration of the init, so callers' random state is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    # save_pretrained writes transformers' own config layout; replace it with the real checkpoint's layout
    # (text fields also at the top level) so vLLM reads it the way it reads the 7B model.
    _dump(path / "config.json", config_dict)
    write_tokenizer_files(path)
    write_processor_files(path)
    _dump(path / _MARKER, {"version": TINY_MODEL_VERSION, "seed": seed})
    return path


def default_tiny_model_dir() -> Path:
    """The tiny model under $VLMSTREAM_HOME (or ~/.cache/vlmstream), written on first use and reused."""
    home = Path(os.environ.get("VLMSTREAM_HOME") or Path.home() / ".cache" / "vlmstream")
    target = home / TINY_MODEL_DIRNAME
    if _is_current(target):
        return target
    home.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so parallel processes never load a half-written folder.
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_DIRNAME}-", dir=home))
    try:
        write_tiny_model(staging)
        if target.exists() and not _is_current(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            if not _is_current(target):  # not another process winning the race: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_current(path: Path) -> bool:
    try:
        return json.loads((path / _MARKER).read_text()).get("version") == TINY_MODEL_VERSION
    except (OSError, ValueError):
        return False


def _dump(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=1))
