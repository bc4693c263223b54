"""Exact-size RGB arrays for the inference benchmarks: real images from a folder, or synthetic ones.

One rule for every script: each source image resized (bicubic) to the pipeline's own ``smart_resize`` size at
the budget, reused in order to reach ``n``. Scripts run from the repository root (or put it on sys.path).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from vlmstream.models.qwen2_vl import smart_resize

SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def link_documents(files: list, folder: Path, prefix: str, n: int, link=os.link) -> None:
    """n one-image documents in folder, cycling through files: distinct names (so distinct document ids), the
    same pixels, no copying. link=os.link when the decode fleet's allowed root must hold the files themselves
    (a hard link across devices falls back to a copy); os.symlink when the sources are on another device."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        src = Path(files[i % len(files)])
        dst = folder / f"{prefix}{i:06d}{src.suffix.lower()}"
        try:
            link(src, dst)
        except OSError:
            if link is not os.link:
                raise
            dst.write_bytes(src.read_bytes())


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


def exact_size_images(folder: str | Path | None, n: int | None, max_pixels: int, factor: int = 28) -> list[np.ndarray]:
    """``factor``: the model family's (28 for Qwen2/2.5-VL, 32 for Qwen3-VL and Qwen3.5); ``n`` None: one of each
    source image."""
    from PIL import Image

    bases = source_images(folder)
    n = len(bases) if n is None else n
    sized = []
    for base in bases[:n]:
        h, w = smart_resize(base.size[1], base.size[0], factor=factor, max_pixels=max_pixels)
        sized.append(np.asarray(base.resize((w, h), Image.BICUBIC)))
    return [sized[i % len(sized)].copy() for i in range(n)]
