"""GPU smoke test and measurement of the vLLM engine, both modes, on the Qwen2.5-VL-7B or Qwen3-VL-8B config (dummy
weights).

Run on a GPU machine with vLLM (benchmarks/gpu/README.md):
    python benchmarks/gpu_engine_smoke.py [--model qwen2.5-vl-7b|qwen3-vl-8b] [--images DIR] [--n 64]
        [--max-pixels 1003520] [--tokens 64]
        [--modes embeds,pixels]
        [--out $OUT/engine_smoke.json]

What it checks and prints:
1. embeds mode: images/s through VllmEngine (our tower in vLLM's engine process, the decoded images sent there as
   pixel rows, consumers/infer/pixel_rows.py; or, where vLLM's model does not take it, in this process), what the
   engine reports it runs, and that, to bf16 tolerance, the published embeddings (kept by vLLM's engine for the
   consumer, engine_tower.EmbeddingTap) equal transformers' full model's vision path (processor pixels, sdpa
   attention) with the same tower weights (the seeded random tower load_vision_tower builds for a folder without
   weights, as the engine does), and so does the whole ``image_embeds`` our encoder makes of them (for Qwen3-VL the
   DeepStack levels included).
2. guided decoding: with a JSON Schema set, outputs parse and validate (parsed_json is not None).
3. pixels mode: images/s with vLLM doing its own normalise/patchify/tower on the exact-size arrays.
Every engine is closed before the next starts; the script exits with os._exit so no thread or EngineCore
child can keep the device call alive.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.images import exact_size_images  # noqa: E402 - after the path insert




def load_images(folder: str | None, n: int, max_pixels: int, factor: int = 28) -> list[np.ndarray]:
    images = exact_size_images(folder, n, max_pixels, factor)
    for i, arr in enumerate(images):
        arr[0, 0] = (i % 251, (i // 251) % 251, 7)  # unique pixels per request
    return images


def requests_for(images, tokens, prefix, want_embedding=True, family=None):
    from consumers.infer.engine import InferenceRequest
    from vlmstream.models.qwen2_vl import QWEN2_VL

    family = family or QWEN2_VL
    return [InferenceRequest(f"{prefix}{i}/0", im, family.grid_thw(*im.shape[:2]),
                             "Describe this image in detail.", tokens, want_embedding=want_embedding)
            for i, im in enumerate(images)]


def run_all(engine, requests, timeout_s=400.0):
    from consumers.infer.engine import InferenceOutput

    start = time.perf_counter()
    engine.submit(requests)
    results = {}
    while len(results) < len(requests):
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"{len(results)}/{len(requests)} after {timeout_s}s")
        for r in engine.poll(1.0):
            results[r.request_id] = r
    wall = time.perf_counter() - start
    ok = [r for r in results.values() if isinstance(r, InferenceOutput)]
    failed = [r for r in results.values() if not isinstance(r, InferenceOutput)]
    return results, dict(n=len(requests), ok=len(ok), failed=len(failed), wall_s=round(wall, 2),
                         img_per_s=round(len(requests) / wall, 2),
                         mean_output_tokens=round(float(np.mean([r.output_tokens for r in ok])), 1) if ok else 0,
                         first_failure=repr(failed[0])[:300] if failed else None)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))


def reference_embeddings(model_dir, tower_state, images):
    """transformers' own path: the checkpoint's image processor (do_resize=False) -> full model's
    get_image_features (sdpa), with our tower's weights. The language model is cut to one layer: the vision path
    never reads it. Returns per image (mean of the main merger's tokens, the whole image_embeds: merged tokens then
    any DeepStack levels, as our tower hands them to vLLM)."""
    import torch
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    config.text_config.num_hidden_layers = 1
    if getattr(config.text_config, "layer_types", None):
        config.text_config.layer_types = ["full_attention"]
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16).eval()
    model.model.visual.load_state_dict(tower_state)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    out = []
    with torch.inference_mode():
        for im in images:
            inputs = processor(images=[im], do_resize=False, return_tensors="pt")
            feats = model.model.get_image_features(inputs["pixel_values"].cuda(), inputs["image_grid_thw"].cuda())
            merged = feats.pooler_output[0]
            levels = [torch.cat(level) for level in getattr(feats, "deepstack_features", None) or []]
            out.append((merged.float().mean(0).cpu().numpy(),
                        torch.cat([merged, *levels], -1).float().cpu().numpy()))
    del model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", default=os.environ.get("IMAGES"))
    ap.add_argument("--model", default="qwen2.5-vl-7b", help="qwen2.5-vl-7b or qwen3-vl-8b (benchmarks/model7b.py)")
    ap.add_argument("--model-dir", default=None, help="default: /tmp/vlmstream-MODEL")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-pixels", type=int, default=1280 * 28 * 28)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8, help="images per vision-tower forward")
    ap.add_argument("--modes", default="embeds,pixels",
                    help="comma list of embeds, pixels")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "engine_smoke.json"))
    args = ap.parse_args()

    from benchmarks.model7b import GPU_MODELS
    import torch

    from consumers.infer.prompts import OutputSchema
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.encoder import VisionEncoder
    from consumers.infer.vllm_engine import VllmEngine
    from vlmstream.config import InferSettings
    from vlmstream.models.registry import family_of

    model_dir = GPU_MODELS[args.model](args.model_dir or f"/tmp/vlmstream-{args.model}")
    family = family_of(model_dir)
    images = load_images(args.images, args.n + 4, args.max_pixels, family.factor)
    warm, images = images[:4], images[4:]
    report: dict = {"model": args.model, "n": args.n, "max_pixels": args.max_pixels, "tokens": args.tokens,
                    "mean_mp": round(float(np.mean([im.shape[0] * im.shape[1] for im in images])) / 1e6, 3)}
    print("SETUP", json.dumps(report), flush=True)
    settings = InferSettings(max_new_tokens=args.tokens, batch_size=args.batch_size,
                             max_model_len=20480, gpu_memory_utilization=0.85, publish_embeddings=True)

    texts: dict[str, list] = {}
    for mode in args.modes.split(","):
        engine = None
        try:
            t = time.perf_counter()
            try:
                engine = VllmEngine(model_dir, settings.model_copy(update={"mode": mode}), load_format="dummy",
                                    ignore_eos=True)
            except Exception as exc:
                if mode != "embeds":
                    raise
                # Fall back to the configuration bench.py measured (vLLM keeps its own tower).
                print("EMBEDS_ONLY_START_FAILED", repr(exc)[:500], flush=True)
                report["embeds_only_error"] = repr(exc)[:500]
                engine = VllmEngine(model_dir, settings.model_copy(update={"mode": mode}), load_format="dummy",
                                    embeds_only_engine=False, ignore_eos=True)
            entry: dict = {"start_s": round(time.perf_counter() - t, 1),
                           "vision_attention": engine.encoder.attention if engine.encoder else None,
                           "engine_tower": engine.engine_tower_report}
            _, warm_run = run_all(engine, requests_for(warm, args.tokens, f"warm-{mode}-", family=family))
            if warm_run["failed"] and mode == "embeds":
                # Embedding-only vLLM (no tower of its own) rejected the inputs: measure the bench.py setup.
                print("EMBEDS_ONLY_REQUESTS_FAILED", warm_run["first_failure"], flush=True)
                report["embeds_only_error"] = warm_run["first_failure"]
                engine.close()
                engine = VllmEngine(model_dir, settings.model_copy(update={"mode": mode}), load_format="dummy",
                                    embeds_only_engine=False, ignore_eos=True)
                run_all(engine, requests_for(warm, args.tokens, f"warm2-{mode}-", family=family))
            entry["embeds_only_engine"] = "embeds_only_error" not in report if mode == "embeds" else None
            # pixels mode: pure vLLM path, no extra tower pass
            want = mode == "embeds"
            results, entry["run"] = run_all(engine, requests_for(images, args.tokens, f"{mode}-", want, family))
            texts[mode] = [getattr(results.get(f"{mode}-{i}/0"), "text", None) for i in range(len(images))]
            first = next(iter(results.values()))
            entry["timings_ms_first"] = {k: round(v, 1) for k, v in getattr(first, "timings_ms", {}).items()}
            print("RESULT", mode, json.dumps(entry), flush=True)

            if mode == "embeds":
                check = images[:4]
                got = [results[f"embeds-{i}/0"].embedding.astype(np.float32) for i in range(len(check))]
                # Guided decoding on the same engine (schema swapped in after the throughput run).
                # Bounded fields only: with random weights an unbounded integer or string never ends, and a
                # document cut at the token limit is (rightly) a schema violation, not a guided-decoding failure.
                engine.schema = OutputSchema.from_dict({
                    "type": "object", "additionalProperties": False, "required": ["kind", "people", "caption"],
                    "properties": {"kind": {"enum": ["photo", "drawing", "screenshot", "text"]},
                                   "people": {"type": "boolean"},
                                   "caption": {"type": "string", "maxLength": 12}}})
                structured, entry["structured"] = run_all(engine, requests_for(check, 96, "json-", False, family))
                entry["structured_sample"] = [getattr(r, "parsed_json", None) or repr(r)[:200]
                                              for r in list(structured.values())[:2]]
                engine.close()
                engine = None
                # The tower the engine ran (the checkpoint's, or for a folder without weights the same seeded
                # random one) and the whole image_embeds our encoder makes with it (DeepStack levels included), one
                # image at a time.
                tower, _ = load_vision_tower(model_dir, "cpu", torch.float32)
                tower_state = {k: v.detach().clone() for k, v in tower.state_dict().items()}
                encoder = VisionEncoder(tower, "cuda", torch.bfloat16, family=family)
                got_embeds = [encoder.encode([im])[0].tokens.float().cpu().numpy() for im in check]
                del encoder
                ref = reference_embeddings(model_dir, tower_state, check)
                ref_means, ref_embeds = [r[0] for r in ref], [r[1] for r in ref]
                diffs = [float(np.max(np.abs(g - r)) / (np.max(np.abs(r)) + 1e-6)) for g, r in zip(got, ref_means)]
                cos = [cosine(g, r) for g, r in zip(got, ref_means)]
                # Per visual token of image_embeds: cosine of ours against transformers' (every DeepStack column).
                token_cos = [float(np.min(np.sum(g * r, -1) / (np.linalg.norm(g, axis=-1) * np.linalg.norm(r, axis=-1)
                                                              + 1e-12)))
                             for g, r in zip(got_embeds, ref_embeds) if g.shape == r.shape]
                shapes_equal = all(g.shape == r.shape for g, r in zip(got_embeds, ref_embeds))
                entry["embedding_vs_transformers"] = {
                    "max_rel_diff": round(max(diffs), 5), "min_cosine": round(min(cos), 6),
                    "image_embeds_shape": list(got_embeds[0].shape), "image_embeds_shapes_equal": shapes_equal,
                    "image_embeds_min_token_cosine": round(min(token_cos), 6) if token_cos else None,
                    "pass": bool(min(cos) > 0.999 and max(diffs) < 0.05 and shapes_equal
                                 and token_cos and min(token_cos) > 0.99)}
                print("RESULT embeds-check", json.dumps(entry["embedding_vs_transformers"]),
                      json.dumps(entry["structured"]), entry["structured_sample"], flush=True)
            report[mode] = entry
        except Exception as exc:
            traceback.print_exc()
            report[f"{mode}_error"] = repr(exc)[:1000]
        finally:
            if engine is not None:
                engine.close()
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    # vLLM's own tower (pixels mode) has other random weights than ours, so most texts differ; the share is kept as
    # a record of how far the two modes' outputs agree.
    if "embeds" in texts and "pixels" in texts:
        pairs = list(zip(texts["embeds"], texts["pixels"]))
        report["pixels_same_text_as_embeds"] = round(sum(a == b for a, b in pairs) / len(pairs), 3)
    if "embeds" in report and "pixels" in report:
        report["embeds_over_pixels"] = round(report["embeds"]["run"]["img_per_s"] / report["pixels"]["run"]["img_per_s"], 2)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print("ALLRESULTS", json.dumps(report), flush=True)


if __name__ == "__main__":
    # vLLM may spawn its EngineCore: the guard keeps the child from re-running main().
    try:
        main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
