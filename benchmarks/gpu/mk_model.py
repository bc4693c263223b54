"""Builds a Qwen2.5-VL-7B-Instruct, Qwen3-VL-8B-Instruct, Qwen3-VL-30B-A3B-Instruct, Qwen3.5 (397B-A17B, 27B) Gemma 3 4B or LLaVA-OneVision-Qwen2-7B model folder (the released config, the tiny model's
synthetic tokenizer with the real special-token ids 151643-151656, no weights) for vLLM ``load_format="dummy"``
(random weights, same compute): ``benchmarks/model7b.py``, whose numbers come from the model families
(vlmstream/models/).

Usage: python3 mk_model.py OUTDIR [qwen2.5-vl-7b | qwen3-vl-8b | qwen3-vl-30b-a3b | qwen3.5-397b-a17b | qwen3.5-27b | gemma3-4b | llava-onevision-7b]   (default qwen2.5-vl-7b)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's packages

from benchmarks.model7b import GPU_MODELS

if __name__ == "__main__":
    name = sys.argv[2] if len(sys.argv) > 2 else "qwen2.5-vl-7b"
    if name not in GPU_MODELS:
        sys.exit(f"unknown model {name!r}; one of {', '.join(GPU_MODELS)}")
    out = GPU_MODELS[name](sys.argv[1] if len(sys.argv) > 1 else name.replace(".", "").replace("-", ""))
    print("ok", out)
