"""Builds a Qwen2.5-VL-7B-Instruct model folder (the released config, the tiny model's synthetic tokenizer with the
real special-token ids 151643-151656, no weights) for vLLM ``load_format="dummy"`` (random weights, same compute):
``consumers/infer/model7b.py``, whose numbers come from the model family (vlmstream/models/qwen2_vl.py).

Usage: python3 mk_model.py OUTDIR
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's packages

from consumers.infer.model7b import write_qwen25vl_7b_config

if __name__ == "__main__":
    out = write_qwen25vl_7b_config(sys.argv[1] if len(sys.argv) > 1 else "qwen25vl7b")
    print("ok", out)
