"""Images made on the fly for tests: a small corpus when no real folder is available, and edge cases."""

from __future__ import annotations

import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image


def _photo_like(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([(x / width) * 255, (y / height) * 255, ((x + y) / (width + height)) * 255], axis=-1)
    noise = rng.normal(0, 12, size=base.shape)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


@lru_cache(maxsize=1)
def generated_corpus() -> Path:
    """A few JPEG, PNG and WebP files of different sizes and aspect ratios."""
    root = Path(tempfile.mkdtemp(prefix="vlmstream-corpus-"))
    sizes = [(640, 480), (1024, 768), (480, 800), (2000, 1200), (300, 300), (1600, 900)]
    for i, (w, h) in enumerate(sizes):
        img = _photo_like(w, h, i)
        fmt = ("JPEG", "PNG", "WEBP")[i % 3]
        img.save(root / f"img{i}.{fmt.lower().replace('jpeg', 'jpg')}", format=fmt, quality=90)
    return root
