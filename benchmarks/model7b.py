"""Qwen2.5-VL-7B-Instruct, Qwen3-VL-8B-Instruct, Qwen3-VL-30B-A3B-Instruct, Qwen3.5-397B-A17B, Qwen3.5-27B, and
Gemma 3 4B and LLaVA-OneVision-Qwen2-7B (the generic path) folders without weights, for GPU measurements with vLLM
``load_format="dummy"`` and for the tower checks against transformers.

The configs hold the released models' real values, so vLLM allocates, compiles and computes exactly as for
the real checkpoints; the tokenizer is the tiny model's synthetic one (real special-token ids). Random
weights: throughput figures hold, the text is noise.
"""

from __future__ import annotations

from pathlib import Path

from consumers.infer.tiny_model import (FIRST_SPECIAL_ID, QWEN3_5_CHAT_TEMPLATE, QWEN3_5_FIRST_SPECIAL_ID,
                                        QWEN3_CHAT_TEMPLATE, _dump, gemma3_token_ids, model_config_dict,
                                        write_gemma3_tokenizer_and_processor, write_llava_onevision_folder,
                                        write_processor_files,
                                        write_size_processor_files, write_tokenizer_files)
from vlmstream.models.qwen2_vl import QWEN2_VL
from vlmstream.models.qwen3_5 import QWEN3_5
from vlmstream.models.qwen3_vl import QWEN3_VL

TEXT_CONFIG_7B = {
    "model_type": "qwen2_5_vl_text", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000,
    "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [16, 24, 24]},
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 28,
    "bos_token_id": 151643, "eos_token_id": 151645, "initializer_range": 0.02, "use_cache": True,
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
}
VISION_CONFIG_7B = {
    "model_type": "qwen2_5_vl", "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
    "out_hidden_size": 3584, "patch_size": QWEN2_VL.patch_size, "spatial_merge_size": QWEN2_VL.merge_size,
    "temporal_patch_size": QWEN2_VL.temporal_patch_size,
    "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "hidden_act": "silu",
    "in_chans": 3, "in_channels": 3, "torch_dtype": "bfloat16", "initializer_range": 0.02,
}


def write_qwen25vl_7b_config(path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _dump(path / "config.json", model_config_dict(dict(TEXT_CONFIG_7B), dict(VISION_CONFIG_7B), dtype="bfloat16"))
    write_tokenizer_files(path)
    write_processor_files(path)
    return path


# What every Qwen3-VL release's config.json has at its top level beside its architecture.
QWEN3_VL_TOP_LEVEL = {
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0",
}

# Qwen/Qwen3-VL-8B-Instruct's config.json: a 36-layer Qwen3 language model (GQA 32/8, head_dim 128, interleaved
# M-RoPE) and a 27-block tower whose blocks 8, 16 and 24 feed DeepStack, so image_embeds are 4 x 4096 wide.
CONFIG_QWEN3_VL_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", **QWEN3_VL_TOP_LEVEL,
    "text_config": {
        "model_type": "qwen3_vl_text", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "dtype": "bfloat16", "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 262144,
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 151936,
    },
    "vision_config": {
        "model_type": "qwen3_vl", "deepstack_visual_indexes": [8, 16, 24], "depth": 27,
        "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02,
        "intermediate_size": 4304, "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096,
        "patch_size": QWEN3_VL.patch_size, "spatial_merge_size": QWEN3_VL.merge_size,
        "temporal_patch_size": QWEN3_VL.temporal_patch_size,
    },
}


def write_qwen3vl_8b_config(path: str | Path) -> Path:
    """Qwen3-VL-8B-Instruct's config and processor settings (size 65,536 to 16,777,216 px), no weights."""
    return _write_qwen3vl_folder(path, CONFIG_QWEN3_VL_8B)


def _write_qwen3vl_folder(path: str | Path, config: dict, family=QWEN3_VL,
                          first_special_id: int = FIRST_SPECIAL_ID, chat_template: str = QWEN3_CHAT_TEMPLATE) -> Path:
    """A Qwen3-VL-layout checkpoint folder without weights: ``config``, the synthetic tokenizer with the family's
    special-token ids and chat template, and the released processor settings (every size of a family shares
    them; Qwen3.5's are Qwen3-VL's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _dump(path / "config.json", config)
    write_tokenizer_files(path, first_special_id, chat_template=chat_template)
    write_size_processor_files(path, family, "Qwen3VLProcessor", first_special_id)
    return path


# Qwen/Qwen3-VL-30B-A3B-Instruct's config.json: a 48-layer Qwen3 MoE language model (128 experts of width 768, 8 per
# token, GQA 32/4, head_dim 128, width 2,048) and the 8B's 27-block tower feeding DeepStack at blocks 8, 16 and 24,
# merged to 2,048: image_embeds 4 x 2048 wide.
CONFIG_QWEN3_VL_30B_A3B = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe", **QWEN3_VL_TOP_LEVEL,
    "text_config": {
        "model_type": "qwen3_vl_moe_text", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "decoder_sparse_step": 1, "dtype": "bfloat16", "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 262144,
        "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936,
    },
    "vision_config": {**CONFIG_QWEN3_VL_8B["vision_config"], "model_type": "qwen3_vl_moe", "out_hidden_size": 2048},
}


def write_qwen3vl_30b_a3b_config(path: str | Path) -> Path:
    """Qwen3-VL-30B-A3B-Instruct's config (the MoE family member) and the 8B's processor settings, no weights."""
    return _write_qwen3vl_folder(path, CONFIG_QWEN3_VL_30B_A3B)


# Qwen/Qwen3.5-397B-A17B's config.json: a 60-layer hybrid language model (three Gated DeltaNet layers to each gated
# full-attention one; 512 experts of width 1,024, 10 per token, and a shared expert; width 4,096) and the Qwen3.5
# tower: Qwen3-VL's 27 blocks of width 1,152 without DeepStack, merged to 4,096. The other Qwen3.5 releases build
# their towers from the same blocks (the merger's output width is their language model's; the smaller ones are
# reported with fewer blocks), so this is the family's vision part at one released size. The language model is far
# beyond one GPU: it serves the tower check (check_tower.py cuts the text stack to one layer, which the image
# features never pass through), not vLLM.
CONFIG_QWEN3_5_397B_A17B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
    "vision_end_token_id": 248054, "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0",
    "text_config": {
        "model_type": "qwen3_5_moe_text", "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(60)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 64, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
        "mlp_only_layers": [], "moe_intermediate_size": 1024, "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "num_attention_heads": 32, "num_experts": 512,
        "num_experts_per_tok": 10, "num_hidden_layers": 60, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 1024, "use_cache": True,
        "vocab_size": 248320,
    },
    "vision_config": {
        "model_type": "qwen3_5_moe", "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
        "in_channels": 3, "intermediate_size": 4304, "num_heads": 16, "num_position_embeddings": 2304,
        "out_hidden_size": 4096, "patch_size": QWEN3_5.patch_size, "spatial_merge_size": QWEN3_5.merge_size,
        "temporal_patch_size": QWEN3_5.temporal_patch_size,
    },
}


def write_qwen35_397b_a17b_config(path: str | Path) -> Path:
    """Qwen3.5-397B-A17B's config (the Qwen3.5 tower at a released width) and Qwen3.5's processor settings, no
    weights; for the tower check only (see above)."""
    return _write_qwen3vl_folder(path, CONFIG_QWEN3_5_397B_A17B, QWEN3_5, QWEN3_5_FIRST_SPECIAL_ID,
                                 QWEN3_5_CHAT_TEMPLATE)


# Qwen/Qwen3.5-27B's config.json, the dense member of the family: a 64-layer hybrid language model (three Gated
# DeltaNet layers to each gated full-attention one; GQA 24/4, head_dim 256, MLP width 17,408, width 5,120) and the
# family's tower (27 blocks of width 1,152, no DeepStack) merged to 5,120. Not read from the hub (none here): the
# values as public code that builds this model reproduces them, where two independent sources agree on the
# language model's shape. In bf16 it fits one H200 (about 54 GB of weights), so vLLM serves it with dummy weights.
CONFIG_QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
    "vision_end_token_id": 248054, "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256,
        "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144, "mlp_only_layers": [], "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "num_attention_heads": 24, "num_hidden_layers": 64,
        "num_key_value_heads": 4, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000, "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 248320,
    },
    "vision_config": {
        "model_type": "qwen3_5", "deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": 5120, "patch_size": QWEN3_5.patch_size,
        "spatial_merge_size": QWEN3_5.merge_size, "temporal_patch_size": QWEN3_5.temporal_patch_size,
    },
}


def write_qwen35_27b_config(path: str | Path) -> Path:
    """Qwen3.5-27B's config (the dense Qwen3.5, one GPU's worth) and Qwen3.5's processor settings, no weights."""
    return _write_qwen3vl_folder(path, CONFIG_QWEN3_5_27B, QWEN3_5, QWEN3_5_FIRST_SPECIAL_ID, QWEN3_5_CHAT_TEMPLATE)


# google/gemma-3-4b-it's config.json: a 34-layer Gemma 3 language model (5 sliding-window layers of 1,024 tokens to
# each global one, GQA 8/4, head_dim 256, vocabulary 262,208) and SigLIP-so400m at 896 px (27 blocks, width 1,152),
# pooled to 256 image tokens. No family module describes it: it runs the generic path.
GEMMA3_4B_TEXT = {
    "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256, "vocab_size": 262208,
    "sliding_window": 1024, "sliding_window_pattern": 6, "max_position_embeddings": 131072,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
}
GEMMA3_4B_VISION = {
    "model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
    "num_attention_heads": 16, "image_size": 896, "patch_size": 14, "vision_use_head": False,
}
GEMMA3_4B_IMAGE_TOKENS = 256


def write_gemma3_4b_config(path: str | Path) -> Path:
    """Gemma 3 4B's config and processor (896 x 896, 256 image tokens, no pan and scan), no weights."""
    from transformers import Gemma3Config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = write_gemma3_tokenizer_and_processor(path, GEMMA3_4B_VISION["image_size"], GEMMA3_4B_IMAGE_TOKENS,
                                               vocab_size=GEMMA3_4B_TEXT["vocab_size"])
    config = Gemma3Config(text_config=dict(GEMMA3_4B_TEXT), vision_config=dict(GEMMA3_4B_VISION),
                          mm_tokens_per_image=GEMMA3_4B_IMAGE_TOKENS, **gemma3_token_ids(ids))
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.dtype = "bfloat16"
    config.save_pretrained(path)
    return path


def write_llava_onevision_7b_config(path: str | Path) -> Path:
    """LLaVA-OneVision-Qwen2-7B's config (the generic path with a tiling processor), no weights: as transformers'
    conversion script builds llava-hf/llava-onevision-qwen2-7b-ov-hf, a SigLIP-so400m tower of 26 layers on 384 px
    tiles (729 tokens each), Qwen2-7B-Instruct's language model, ``<image>`` and ``<video>`` at 151646-151647, grid
    pinpoints from 384 to 2304 px, ``anyres_max_9``."""
    path, config = write_llava_onevision_folder(
        path, 384, 729, first_special_id=FIRST_SPECIAL_ID,
        vision_config={"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 26,
                       "num_attention_heads": 16, "patch_size": 14},
        text_config={"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": False, "sliding_window": None, "use_sliding_window": False})
    config.dtype = "bfloat16"
    config.save_pretrained(path)
    return path


GPU_MODELS = {"qwen2.5-vl-7b": write_qwen25vl_7b_config, "qwen3-vl-8b": write_qwen3vl_8b_config,
              "qwen3-vl-30b-a3b": write_qwen3vl_30b_a3b_config, "qwen3.5-397b-a17b": write_qwen35_397b_a17b_config,
              "qwen3.5-27b": write_qwen35_27b_config,
              "gemma3-4b": write_gemma3_4b_config, "llava-onevision-7b": write_llava_onevision_7b_config}
