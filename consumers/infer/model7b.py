"""A Qwen2.5-VL-7B-Instruct folder without weights, for GPU measurements with vLLM ``load_format="dummy"``.

The config holds the released model's real values, so vLLM allocates, compiles and computes exactly as for
the real checkpoint; the tokenizer is the tiny model's synthetic one (real special-token ids). Random
weights: throughput figures hold, the text is noise.
"""

from __future__ import annotations

from pathlib import Path

from consumers.infer.tiny_model import _dump, model_config_dict, write_processor_files, write_tokenizer_files
from vlmstream.models.qwen2_vl import QWEN2_VL

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
