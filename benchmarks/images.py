"""Exact-size RGB arrays for the inference benchmarks: real images from a folder, or synthetic ones.

One rule for every script: each source image resized (bicubic) to the pipeline's own ``smart_resize`` size at
the budget, reused in order to reach ``n``. Scripts run from the repository root (or put it on sys.path).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from consumers.decode.resize import smart_resize

SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def source_images(folder: str | Path | None):
    """PIL images of every picture under folder; photo-like synthetic ones (gradients, noise, varied aspect
    ratios) when it has none, e.g. on a device without the corpus."""
    from PIL import Image

    bases = []
    if folder and Path(folder).is_dir():
        bases = [Image.open(p).convert("RGB") for p in sorted(Path(folder).rglob("*")) if p.suffix.lower() in SUFFIXES]
    if not bases:
        rng = np.random.default_rng(0)
        for w, h in [(1920, 1080), (1080, 1920), (2560, 1600), (1600, 1200), (3000, 2000), (800, 800)]:
            y, x = np.mgrid[0:h, 0:w].astype(np.float32)
            base = np.stack([x / w * 255, y / h * 255, (x + y) / (w + h) * 255], -1) + rng.normal(0, 12, (h, w, 3))
            bases.append(Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)))
    return bases


def exact_size_images(folder: str | Path | None, n: int, max_pixels: int) -> list[np.ndarray]:
    from PIL import Image

    bases = source_images(folder)
    sized = []
    for base in bases[:n]:
        h, w = smart_resize(base.size[1], base.size[0], max_pixels=max_pixels)
        sized.append(np.asarray(base.resize((w, h), Image.BICUBIC)))
    return [sized[i % len(sized)].copy() for i in range(n)]
