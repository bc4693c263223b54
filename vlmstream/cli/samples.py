"""A small built-in folder of images, so `vlmstream run` works on a machine with no images of its own.

The pictures are synthetic (gradients, shapes and noise at several sizes and aspect ratios, in JPEG, PNG
and WebP): enough to exercise every stage. Point `vlmstream run` at a real folder for real work.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SAMPLE_DOCUMENTS = {
    "invoice-0001": [(1654, 2339, "JPEG"), (1654, 2339, "JPEG"), (800, 600, "PNG")],
    "catalogue-0002": [(1920, 1080, "JPEG"), (1080, 1920, "WEBP"), (640, 640, "PNG"), (3000, 2000, "JPEG")],
    "report-0003": [(1200, 900, "JPEG"), (2480, 3508, "JPEG")],
}


def _picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    tint = rng.uniform(0.3, 1.0, size=3)
    base = np.stack([x / width * 255 * tint[0], y / height * 255 * tint[1],
                     (1 - x / width) * 255 * tint[2]], axis=-1)
    base += rng.normal(0, 8, size=base.shape)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = int(rng.uniform(0, width * 0.8)), int(rng.uniform(0, height * 0.8))
        x1, y1 = x0 + int(rng.uniform(20, width * 0.3)), y0 + int(rng.uniform(20, height * 0.3))
        colour = tuple(int(c) for c in rng.integers(0, 255, size=3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=colour)
    return img


def sample_folder(root: str | Path | None = None) -> Path:
    """Write (once) the sample documents as one subfolder each; returns the folder."""
    home = Path(os.environ.get("VLMSTREAM_HOME", str(Path.home() / ".cache" / "vlmstream")))
    root = Path(root) if root else home / "sample-images"
    marker = root / ".complete"
    if marker.exists():
        return root
    seed = 0
    for doc_id, pages in SAMPLE_DOCUMENTS.items():
        folder = root / doc_id
        folder.mkdir(parents=True, exist_ok=True)
        for index, (width, height, fmt) in enumerate(pages):
            seed += 1
            suffix = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}[fmt]
            _picture(width, height, seed).save(folder / f"page-{index + 1:02d}.{suffix}", format=fmt, quality=90)
    marker.write_text("ok\n")
    return root
