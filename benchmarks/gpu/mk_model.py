# Builds a Qwen2.5-VL-7B-Instruct model folder (real config, synthetic tokenizer with the real special-token ids
# 151643-151656, no weights), copied from the team's ../shared/gpu/mk_model.py. Use with vLLM load_format="dummy"
# (random weights, same compute). Needs only `tokenizers`. Usage: python3 mk_model.py OUTDIR
import json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
out = sys.argv[1] if len(sys.argv) > 1 else "qwen25vl7b"
os.makedirs(out, exist_ok=True)
BASE = 151643
alpha = pre_tokenizers.ByteLevel.alphabet()          # 256 byte-level chars
vocab = {c: i for i, c in enumerate(sorted(alpha))}
i = len(vocab)
while len(vocab) < BASE:
    vocab[f"<filler_{i}>"] = i; i += 1
tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
tok.decoder = decoders.ByteLevel()
specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
tok.add_special_tokens(specials)
ids = {s: tok.token_to_id(s) for s in specials}
assert ids["<|endoftext|>"] == 151643 and ids["<|video_pad|>"] == 151656, ids
tok.save(f"{out}/tokenizer.json")
tmpl = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
        "{% if c['type'] in ('image','image_url') %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] in ('video','video_url') %}<|vision_start|><|video_pad|><|vision_end|>{% elif c['type']=='text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
added = {str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True} for s in specials}
json.dump({"tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
           "chat_template": tmpl, "model_max_length": 131072, "add_prefix_space": False, "errors": "replace", "clean_up_tokenization_spaces": False,
           "split_special_tokens": False, "added_tokens_decoder": added, "additional_special_tokens": specials[1:]},
          open(f"{out}/tokenizer_config.json", "w"), indent=1)
json.dump({"chat_template": tmpl}, open(f"{out}/chat_template.json", "w"))
tc = {"model_type": "qwen2_5_vl_text", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
      "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000,
      "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [16, 24, 24]},
      "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
      "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 28,
      "bos_token_id": 151643, "eos_token_id": 151645, "initializer_range": 0.02, "use_cache": True,
      "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652}
vc = {"model_type": "qwen2_5_vl", "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "hidden_act": "silu", "in_chans": 3, "in_channels": 3,
      "torch_dtype": "bfloat16", "initializer_range": 0.02}
cfg = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "torch_dtype": "bfloat16",
       "bos_token_id": 151643, "eos_token_id": 151645, "image_token_id": 151655, "video_token_id": 151656,
       "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
       "tie_word_embeddings": False, "transformers_version": "4.49.0", "text_config": tc, "vision_config": vc}
# also flat copies of the text fields (the HF 4.x layout of the real config.json)
for k, v in tc.items():
    if k not in ("model_type",): cfg.setdefault(k, v)
json.dump(cfg, open(f"{out}/config.json", "w"), indent=1)
json.dump({"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
           "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
           "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
           "do_resize": True, "do_normalize": True, "do_rescale": True, "rescale_factor": 0.00392156862745098, "do_convert_rgb": True},
          open(f"{out}/preprocessor_config.json", "w"), indent=1)
json.dump({"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643, "do_sample": False},
          open(f"{out}/generation_config.json", "w"))
print("ok", out, ids["<|image_pad|>"])
