"""The chaos run's documents: small generated JPEG/PNG images, a few real ones, heavy-tailed image counts with the
heavy documents clustered, and planted bad inputs whose dead letters the checker expects (and no others).

``make_plan`` writes the images and returns the plan: the manifest lines in the order they go out, and per
document its image count and, per planted bad image, the dead-letter kinds that count as its expected outcome.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import orjson
from PIL import Image, ImageDraw

REAL_IMAGES = ["plasma/Autumn-screenshot.jpg", "plasma/Cascade-screenshot.png", "gnome/vnc-d.webp"]

# What a planted bad image may come back as (the decode stage's error kinds, README's dead-letter table).
PLANTED = {
    "missing": ("fetch_not_found",),
    "truncated": ("decode_truncated", "decode_corrupt"),
    "not_an_image": ("decode_not_an_image", "decode_unsupported"),
}
BAD_MANIFEST_KINDS = ("invalid_json",)


def _image(rng: random.Random, fmt: str) -> bytes:
    w, h = rng.choice([(96, 72), (128, 96), (160, 120), (200, 150), (120, 160), (256, 192)])
    im = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(im)
    for _ in range(6):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        draw.rectangle([x0, y0, x0 + rng.randrange(10, 60), y0 + rng.randrange(10, 60)],
                       fill=tuple(rng.randrange(256) for _ in range(3)))
    out = io.BytesIO()
    im.save(out, format=fmt, **({"quality": 85} if fmt == "JPEG" else {}))
    return out.getvalue()


def image_counts(rng: random.Random, docs: int, max_images: int = 40) -> list[int]:
    """Heavy-tailed (Pareto, alpha 1.3) between 1 and ``max_images``, and the heavy documents clustered: every
    ~110 documents a run of 3-6 documents of 20 to ``max_images`` images."""
    counts = [min(max_images, max(1, int(rng.paretovariate(1.3)))) for _ in range(docs)]
    start = rng.randrange(10, 40)
    while start < docs:
        for i in range(start, min(docs, start + rng.randrange(3, 7))):
            counts[i] = rng.randrange(20, max_images + 1)
        start += rng.randrange(90, 130)
    return counts


def make_plan(folder: Path, docs: int, *, seed: int, run_id: str, corpus: Path | None = None,
              pool: int = 48) -> dict[str, Any]:
    rng = random.Random(seed)
    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    uris: list[str] = []
    for i in range(pool):
        fmt = "JPEG" if i % 3 else "PNG"
        path = images / f"gen-{i:03d}.{'jpg' if fmt == 'JPEG' else 'png'}"
        path.write_bytes(_image(rng, fmt))
        uris.append(str(path))
    real = [corpus / name for name in REAL_IMAGES] if corpus else []
    real = [p for p in real if p.is_file()]
    # Planted bad files: a missing one, a JPEG cut in half, a text file named .jpg.
    whole = _image(rng, "JPEG")
    (images / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    (images / "not-an-image.jpg").write_bytes(b"this is a text file, not a JPEG\n" * 20)
    bad_uri = {"missing": str(images / "missing-does-not-exist.jpg"), "truncated": str(images / "truncated.jpg"),
               "not_an_image": str(images / "not-an-image.jpg")}

    counts = image_counts(rng, docs)
    plan_docs: list[dict[str, Any]] = []
    lines: list[bytes] = []
    bad_docs = set(rng.sample(range(docs), k=min(docs, max(3, docs // 40))))
    bad_order = {d: j for j, d in enumerate(sorted(bad_docs))}
    real_docs = set(rng.sample(range(docs), k=min(docs, max(2, docs // 50)))) if real else set()
    for d, count in enumerate(counts):
        doc_id = f"{run_id}-doc-{d:05d}"
        doc_uris = [rng.choice(uris) for _ in range(count)]
        planted: dict[str, list[str]] = {}
        if d in bad_docs:
            index = rng.randrange(count)
            kind = list(PLANTED)[bad_order[d] % len(PLANTED)]  # round robin: every kind is planted
            doc_uris[index] = bad_uri[kind]
            planted[str(index)] = list(PLANTED[kind])
        if d in real_docs:
            index = rng.randrange(count)
            if str(index) not in planted:
                doc_uris[index] = str(rng.choice(real))
        plan_docs.append({"doc_id": doc_id, "image_count": count, "planted": planted})
        lines.append(orjson.dumps({"doc_id": doc_id, "image_uris": doc_uris, "metadata": {"chaos": run_id}}))
    # Bad manifest lines, in the first quarter (so a producer restart re-reads them as well).
    bad_lines = [b'{"doc_id": "' + run_id.encode() + b'-bad-line", "image_uris": [', b"not json at all {"]
    for j, raw in enumerate(bad_lines):
        lines.insert(min(len(lines), 3 + j * max(1, docs // 8)), raw)
    return {"run_id": run_id, "seed": seed, "documents": plan_docs, "bad_manifest_lines": len(bad_lines),
            "images": sum(counts), "planted_images": sum(len(d["planted"]) for d in plan_docs),
            "max_images_per_doc": max(counts), "lines": [line.decode() for line in lines],
            "real_images": [str(p) for p in real]}


def save_plan(plan: dict[str, Any], path: Path) -> None:
    path.write_bytes(orjson.dumps({k: v for k, v in plan.items() if k != "lines"}))


def load_plan(path: Path) -> dict[str, Any]:
    return orjson.loads(Path(path).read_bytes())
