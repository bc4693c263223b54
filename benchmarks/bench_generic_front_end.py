"""The generic path's front end on the CPU: what the model's own image processor costs per image when it gets the
full picture (naive vLLM: the user decodes, vLLM's front end runs the processor on it) against what it costs when
the decode fleet has already capped the image at what the processor keeps (the pipeline: the inference consumer
decodes the payload, vLLM's front end runs the processor on the capped image). CPU time of one thread, side by side
on the same files, alternating per file.

vLLM runs the model's Hugging Face image processor in its front-end process (the `LLM` process, or each API server),
so these per-image CPU costs are what that process spends; the decode fleet's cost (fetch, decode, cap, encode) is
printed beside them: it runs on other cores, on any machine.

    python benchmarks/bench_generic_front_end.py [--images DIR] [--model PATH] [--rounds 2]

--model: a checkpoint folder of a model no family describes (default: Gemma 3 4B's config and processor, 896 x 896,
written without weights by benchmarks/model7b.py; only its processor config is read).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def cpu_ms(call) -> tuple[float, object]:
    started = time.thread_time()
    out = call()
    return (time.thread_time() - started) * 1000, out


def _open_rgb(path: Path):
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", default=os.environ.get("VLMSTREAM_TEST_IMAGES", str(REPO.parent / "shared" / "corpus")))
    ap.add_argument("--model", help="checkpoint folder (default: Gemma 3 4B's config, no weights)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = "1"
    import numpy as np
    import torch
    from transformers import AutoImageProcessor

    from consumers.decode.stage import DecodeStage
    from benchmarks.model7b import GPU_MODELS
    from vlmstream.config import DecodeSettings
    from vlmstream.images.payload import decode as decode_payload

    torch.set_num_threads(1)
    model = args.model or str(GPU_MODELS["gemma3-4b"](Path(tempfile.mkdtemp()) / "gemma3-4b"))
    processor = AutoImageProcessor.from_pretrained(model)
    files = sorted(p for p in Path(args.images).rglob("*") if p.suffix.lower() in SUFFIXES)
    if not files:
        raise SystemExit(f"no images in {args.images}")
    stage = DecodeStage(DecodeSettings(allowed_roots=[str(Path(args.images).resolve())], model=model), "")
    naive, naive_decode, pipeline, fleet, payload_ms, source_mp, shipped_mp = [], [], [], [], [], [], []
    for round_ in range(args.rounds):
        for k, path in enumerate(files):
            def naive_front_end():
                decode_ms, picture = cpu_ms(lambda: _open_rgb(path))  # what a naive user hands vLLM
                naive_decode.append(decode_ms)
                return processor(images=[picture], return_tensors="pt")

            prepared = stage(str(path))
            if not hasattr(prepared, "data"):
                continue  # a dead letter in the pipeline; the naive side would fail on it too
            arms = [("naive", naive_front_end),
                    ("pipeline", lambda: processor(images=[decode_payload(prepared.data, prepared.codec,
                                                                         prepared.height, prepared.width)],
                                                   return_tensors="pt"))]
            if (k + round_) % 2:
                arms.reverse()  # alternate which runs first on each file
            for name, call in arms:
                ms, _ = cpu_ms(call)
                (naive if name == "naive" else pipeline).append(ms)
            payload_ms.append(cpu_ms(lambda: decode_payload(prepared.data, prepared.codec, prepared.height,
                                                            prepared.width))[0])
            fleet.append(prepared.prepare_cpu_ms)
            source_mp.append(prepared.orig_width * prepared.orig_height / 1e6)
            shipped_mp.append(prepared.width * prepared.height / 1e6)
    report = {"model": model, "processor": type(processor).__name__, "images": len(files), "rounds": args.rounds,
              "mean_source_mp": round(float(np.mean(source_mp)), 2),
              "mean_shipped_mp": round(float(np.mean(shipped_mp)), 3),
              "naive_front_end_ms": round(float(np.mean(naive)), 2),
              "of_which_pil_decode_ms": round(float(np.mean(naive_decode)), 2),
              "pipeline_front_end_ms": round(float(np.mean(pipeline)), 2),
              "of_which_payload_decode_ms": round(float(np.mean(payload_ms)), 2),
              "decode_fleet_ms": round(float(np.mean(fleet)), 2),
              "front_end_naive_over_pipeline": round(float(np.mean(naive)) / float(np.mean(pipeline)), 2)}
    print(json.dumps(report))
    print(f"\n| front end per image (CPU ms, one thread) | naive | pipeline | naive / pipeline |\n|---|---|---|---|\n"
          f"| {report['processor']}, {report['images']} images x {args.rounds}, mean {report['mean_source_mp']} MP "
          f"source, {report['mean_shipped_mp']} MP shipped | {report['naive_front_end_ms']} (PIL decode "
          f"{report['of_which_pil_decode_ms']}) | "
          f"{report['pipeline_front_end_ms']} (payload decode {report['of_which_payload_decode_ms']}) | "
          f"**{report['front_end_naive_over_pipeline']}x** |\n\nThe decode fleet, on its own cores: "
          f"{report['decode_fleet_ms']} ms CPU per image (fetch, decode, cap, encode).")


if __name__ == "__main__":
    main()
