"""Our vision tower against transformers' full model on the GPU, in bf16, for a model family's real config with
random weights: what the engine hands vLLM as ``image_embeds`` (for Qwen3-VL the merged tokens and the DeepStack
levels) and what it publishes as the embedding, against ``get_image_features`` on the checkpoint's own processor's
pixels. Needs torch and transformers only (no vLLM). ``--blocks fast`` (the default) checks what the engine runs:
FastVisionBlocks, compiled, with the Triton q/k/v and MLP activation kernels; ``--blocks transformers`` the tower's
own blocks.

Usage: python3 benchmarks/gpu/check_tower.py [--model qwen3-vl-8b|qwen2.5-vl-7b]
           [--blocks fast|transformers]
           [--images DIR] [--n 8] [--max-pixels 1003520] [--out $OUT/tower_check.json]
Prints one RESULT line; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's packages


def main() -> int:
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText

    from benchmarks.images import exact_size_images
    from benchmarks.model7b import GPU_MODELS
    from benchmarks.reference_tower import TransformersBlocksEncoder
    from consumers.infer.vision.blocks import block_kernels
    from consumers.infer.vision.encoder import VisionEncoder
    from vlmstream.models.registry import family_of

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-vl-8b", choices=sorted(GPU_MODELS))
    ap.add_argument("--blocks", default="fast", choices=("fast", "transformers"))
    ap.add_argument("--images", default=os.environ.get("IMAGES"))
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-pixels", type=int, default=1003520)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tower_check.json"))
    args = ap.parse_args()

    folder = GPU_MODELS[args.model](f"/tmp/vlmstream-{args.model}")
    family = family_of(folder)
    config = AutoConfig.from_pretrained(folder)
    config.text_config.num_hidden_layers = 1  # the vision path never reads the language model
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16).eval()
    images = exact_size_images(args.images, args.n, args.max_pixels, family.factor)
    processor = AutoImageProcessor.from_pretrained(folder)
    # The encoder gets a copy: it swaps the patch embedding and picks its own attention, and the reference must run
    # transformers' own modules (its sdpa attention, its index tensors, its Conv3d).
    build = TransformersBlocksEncoder if args.blocks == "transformers" else VisionEncoder
    encoder = build(copy.deepcopy(model.model.visual), "cuda", torch.bfloat16, family=family)
    started = time.perf_counter()
    ours = encoder.encode(images)
    torch.cuda.synchronize()
    encode_s = time.perf_counter() - started
    worst_token_cos, worst_embedding_cos, shapes = 1.0, 1.0, []
    with torch.inference_mode():
        for image, encoded in zip(images, ours):
            inputs = processor(images=[image], do_resize=False, return_tensors="pt")
            features = model.model.get_image_features(inputs["pixel_values"].cuda(), inputs["image_grid_thw"].cuda())
            merged = features.pooler_output[0]
            # One image per call: transformers 5.17 gives each DeepStack level as one tensor, later releases as a
            # tuple of one tensor per image.
            levels = [level if torch.is_tensor(level) else torch.cat(level)
                      for level in getattr(features, "deepstack_features", None) or []]
            reference = torch.cat([merged, *levels], -1).float()
            got = encoded.tokens.float()
            shapes.append([list(got.shape), list(reference.shape)])
            if got.shape != reference.shape:
                worst_token_cos = -1.0
                continue
            cos = torch.nn.functional.cosine_similarity(got, reference, dim=-1)
            worst_token_cos = min(worst_token_cos, float(cos.min()))
            mean_ref = merged.float().mean(0)
            mean_got = torch.from_numpy(encoded.mean_pooled().astype(np.float32)).cuda()
            worst_embedding_cos = min(worst_embedding_cos, float(torch.nn.functional.cosine_similarity(
                mean_got, mean_ref, dim=0)))
    expected_width = family.image_embeds_width(config.vision_config.to_dict())
    report = {"model": args.model, "family": family.name, "n": len(images), "attention": encoder.attention,
              "window_attention": encoder.window_attention,
              "fast_blocks": encoder.fast.replaced if encoder.fast else 0, "compiled": encoder.compiled,
              "kernels": block_kernels(encoder.fast), "image_embeds_width": encoder.image_embeds_width,
              "expected_width": expected_width, "deepstack_levels": encoder.deepstack_levels,
              "min_token_cosine": round(worst_token_cos, 6), "min_embedding_cosine": round(worst_embedding_cos, 6),
              "encode_s": round(encode_s, 3), "shapes_first": shapes[:1]}
    blocks_as_asked = (report["fast_blocks"] == len(encoder.visual.blocks)) == (args.blocks != "transformers")
    report["blocks"] = args.blocks
    report["pass"] = bool(encoder.image_embeds_width == expected_width and blocks_as_asked
                          and worst_token_cos > 0.99 and worst_embedding_cos > 0.999)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("RESULT", json.dumps(report), flush=True)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
