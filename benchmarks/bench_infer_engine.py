"""Inference-side measurements, side by side in one run.

    python benchmarks/bench_infer_engine.py engine   # transformers engine, tiny model, CPU: batch 1 vs 8
    python benchmarks/bench_infer_engine.py tower    # preprocessing + vision tower: HF processor (CPU) vs
                                                     # our patchify, and tower attention sdpa / torch varlen /
                                                     # vLLM FA3, batch 1 vs 8 (7B vision config on CUDA)
Options: --n images, --max-pixels budget, --tokens new tokens (engine arm).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.images import exact_size_images  # noqa: E402 - after the path insert




def corpus_images(n: int, max_pixels: int, folder: str | None) -> list[np.ndarray]:
    return exact_size_images(folder or REPO.parent / "shared" / "corpus", n, max_pixels)


def bench_engine(args) -> dict:
    import torch

    from consumers.infer.engine import InferenceRequest
    from consumers.infer.tiny_model import default_tiny_model_dir
    from consumers.infer.transformers_engine import TransformersEngine
    from vlmstream.config import InferSettings

    if args.threads:
        torch.set_num_threads(args.threads)
    images = corpus_images(args.n, args.max_pixels, args.images)
    model = default_tiny_model_dir()
    res = {"n": args.n, "max_pixels": args.max_pixels, "tokens": args.tokens, "threads": torch.get_num_threads()}
    for bs in (1, 8):
        with TransformersEngine(model, InferSettings(batch_size=bs), device=args.device,
                                ignore_eos=True) as eng:
            reqs = lambda tag: [InferenceRequest(f"{tag}{i}", im, (1, im.shape[0] // 14, im.shape[1] // 14),
                                                 "Describe this image.", args.tokens, want_embedding=True)
                                for i, im in enumerate(images)]
            eng.submit(reqs("warm")[:bs])
            got = 0
            while got < bs:
                got += len(eng.poll(5))
            t = time.perf_counter()
            eng.submit(reqs("run"))
            got = 0
            while got < len(images):
                got += len(eng.poll(5))
            res[f"batch{bs}_img_per_s"] = round(len(images) / (time.perf_counter() - t), 2)
    res["batch8_over_batch1"] = round(res["batch8_img_per_s"] / res["batch1_img_per_s"], 2)
    return res


def bench_tower(args) -> dict:
    import torch
    from transformers import AutoImageProcessor
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from benchmarks.model7b import write_qwen25vl_7b_config
    from consumers.infer.vision.checkpoint import vision_config_from
    from consumers.infer.vision.encoder import VisionEncoder
    from consumers.infer.vision.pixels import patchify_batch

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    folder = write_qwen25vl_7b_config("/tmp/vlmstream-7b-config") if device == "cuda" else None
    if folder is None:
        from consumers.infer.tiny_model import default_tiny_model_dir

        folder = default_tiny_model_dir()
    images = corpus_images(args.n, args.max_pixels, args.images)
    res: dict = {"device": device, "n": args.n, "max_pixels": args.max_pixels,
                 "mean_mp": round(float(np.mean([im.shape[0] * im.shape[1] for im in images])) / 1e6, 3)}

    processor = AutoImageProcessor.from_pretrained(folder)
    t = time.perf_counter()
    for im in images:
        processor(images=[im], do_resize=False, return_tensors="pt")
    res["hf_processor_cpu_ms_per_img"] = round((time.perf_counter() - t) / len(images) * 1e3, 2)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    patchify_batch(images[:2], device, dtype)
    sync()
    t = time.perf_counter()
    for im in images:
        patchify_batch([im], device, dtype)
    sync()
    res["our_patchify_ms_per_img"] = round((time.perf_counter() - t) / len(images) * 1e3, 3)
    ref, _ = processor(images=images[:2], do_resize=False, return_tensors="pt").values()
    ours, _ = patchify_batch(images[:2], device, torch.float32)
    res["patchify_max_abs_diff"] = float((ours.cpu() - ref).abs().max())

    config = vision_config_from(folder)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=dtype).eval()
    baseline = None
    for attention in (["sdpa", "torch_varlen", "vllm_fa3"] if device == "cuda" else ["sdpa"]):
        try:
            enc = VisionEncoder(tower, device, dtype, attention=attention)
        except Exception as exc:
            res[f"{attention}_error"] = repr(exc)[:300]
            continue
        out = enc.encode(images[:2])
        if baseline is None:
            baseline = [o.tokens.float() for o in out]
        else:
            res[f"{attention}_max_rel_diff_vs_sdpa"] = round(max(
                float((o.tokens.float() - b).abs().max() / b.abs().max()) for o, b in zip(out, baseline)), 5)
            res[f"{attention}_min_cosine_vs_sdpa"] = round(min(float(torch.nn.functional.cosine_similarity(
                o.tokens.float().flatten(), b.flatten(), dim=0)) for o, b in zip(out, baseline)), 6)
        for bs in (1, 8):
            enc.max_patches_per_call = 1 << 30
            sync()
            t = time.perf_counter()
            for s in range(0, len(images), bs):
                enc.encode(images[s:s + bs])
            sync()
            res[f"{attention}_batch{bs}_img_per_s"] = round(len(images) / (time.perf_counter() - t), 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("arm", choices=["engine", "tower"])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-pixels", type=int, default=256 * 28 * 28)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--device", default=None)
    ap.add_argument("--images", default=None)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    res = bench_engine(args) if args.arm == "engine" else bench_tower(args)
    print("RESULT", args.arm, json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
