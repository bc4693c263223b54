"""The generic path's cap over many image sizes: does a tiling processor still decide as for the whole image?

For random image sizes, what decode ships on the generic path (``vlmstream.models.generic.processor_cap``) is run
through the deciding steps of transformers' own processors, against the whole image: LLaVA-OneVision's and
LLaVA-NeXT's best resolution (``select_best_resolution``), InternVL's tile grid (``get_optimal_tiled_canvas``), and
LLaVA-OneVision's count of image tokens (its processor's ``_get_number_of_features``, which works out the unpadded
feature rows from the size it sees). Sizes only: no pixels are resized, so a sweep of 20,000 sizes takes seconds.

    python benchmarks/generic_cap_sweep.py [--sizes 20000] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlavaOnevisionImageProcessor  # noqa: E402
from transformers.image_processing_utils import select_best_resolution  # noqa: E402
from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas  # noqa: E402
from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor  # noqa: E402

from vlmstream.models.generic import processor_cap  # noqa: E402

ONEVISION = {"image_processor_type": "LlavaOnevisionImageProcessor", "size": {"height": 384, "width": 384},
             "image_grid_pinpoints": LlavaOnevisionImageProcessor().image_grid_pinpoints}
NEXT = {"image_processor_type": "LlavaNextImageProcessor", "size": {"shortest_edge": 336},
        "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]}
INTERNVL = {"image_processor_type": "GotOcr2ImageProcessor", "size": {"height": 448, "width": 448},
            "crop_to_patches": True, "min_patches": 1, "max_patches": 12}


def onevision_tokens() -> callable:
    """LLaVA-OneVision's image-token count for (height, width), as its processor works it out (SigLIP 384 / 14:
    729 tokens a tile, `anyres_max_9`)."""
    owner = types.SimpleNamespace(image_processor=LlavaOnevisionImageProcessor(), num_image_tokens=729,
                                  vision_aspect_ratio="anyres_max_9")
    owner._get_unpadded_features = types.MethodType(LlavaOnevisionProcessor._get_unpadded_features, owner)
    return lambda height, width: LlavaOnevisionProcessor._get_number_of_features(owner, height, width, 384, 384)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tokens = onevision_tokens()
    counts = {key: 0 for key in ("shrunk_onevision", "shrunk_next", "shrunk_internvl", "choice_onevision",
                                 "choice_next", "choice_internvl", "tokens_onevision")}
    for _ in range(args.sizes):
        height, width = rng.randint(20, 9000), rng.randint(20, 9000)
        for name, config in (("onevision", ONEVISION), ("next", NEXT)):
            shipped = processor_cap(config)(height, width, 1, 1, 10**12)
            counts[f"shrunk_{name}"] += shipped != (height, width)
            pins = config["image_grid_pinpoints"]
            counts[f"choice_{name}"] += select_best_resolution(shipped, pins) != select_best_resolution(
                (height, width), pins)
            if name == "onevision":
                counts["tokens_onevision"] += tokens(*shipped) != tokens(height, width)
        shipped = processor_cap(INTERNVL)(height, width, 1, 1, 10**12)
        counts["shrunk_internvl"] += shipped != (height, width)
        counts["choice_internvl"] += (get_optimal_tiled_canvas(shipped, (448, 448), 1, 12)
                                      != get_optimal_tiled_canvas((height, width), (448, 448), 1, 12))
    print(f"{args.sizes} random sizes (20-9000 px a side, seed {args.seed})")
    for name in ("onevision", "next", "internvl"):
        print(f"  {name:9s}: shrunk {counts[f'shrunk_{name}']:6d}, choice changed {counts[f'choice_{name}']}")
    print(f"  LLaVA-OneVision image-token count changed: {counts['tokens_onevision']} of "
          f"{counts['shrunk_onevision']} shrunk")


if __name__ == "__main__":
    main()
