"""Does `vlmstream estimate` hold? For each job: `vlmstream estimate JOB --json` (a sample run), then the whole job
with `vlmstream run JOB` (at least 10x the sample), timed from start to exit; predicted against actual, and the
naive estimate for contrast: documents per second over the first N documents done (N = the sample's documents: what
one would time by watching the run start), from the first result to the N-th, times the documents.

Jobs (real images from the corpus, the built-in tiny model on this machine's CPU and broker):
  a  a folder of uniform documents (3 images each) of real photos and screenshots
  b  a manifest of 1-40 images per document (heavy-tailed), the heavy documents at the end
  c  a mix of small (0.1 MP) images and large photos taken at up to 12.8 MP (--max-pixels 12845056)
  d  job a with --condense (each document's descriptions condensed into one answer)
  p  photos nobody tuned it on: a folder of documents of 1-4 generated photos of mixed sizes (0.3-12 MP, six aspect
     ratios, JPEG qualities 78-95, some progressive), in no order, 0.2 MP
  q  a manifest of 1-40 images per document (Pareto) with the heavy documents clustered in the middle of the job
     (multi-page scans of one size), the light ones generated photos up to 3 MP or small scans, 0.2 MP
  s  a folder of small grayscale scans (0.06-0.4 MP, PNG and JPEG), one per document, 0.2 MP: a job of under a minute
  g  for a GPU: job b's shape (1-40 images per document, the heavy ones last) over any folder of images
     (--images), 2,000 x --scale documents at 0.2 MP; with --run-options naming the model (and --sample-fraction
     0.05) it is the "sample of at most 5% of a run of 20 minutes or more" check on one H200
  h  for a GPU at 1 MP: 700 x --scale documents of 1-40 images (Pareto), the heavy ones clustered mid-job, every
     image a distinct crop (0.5-4 MP, re-encoded) of a photo in --images, so that no cache of the engine can make
     a repeated image cheap

p, q and s draw on images this script generates once (``generated``: 1/f-noise photos and text-like scans, seeded) into
the broker's home, so they are images no earlier version of the estimate was tuned on.

    python benchmarks/estimate_honesty.py --cases pqs --sample-fraction 0.02   (each job 10x its sample or more)
    python benchmarks/estimate_honesty.py [--cases abc] [--scale 1.0] [--diagnose]
    python benchmarks/estimate_honesty.py --cases g --images /root/imgs --scale 13 --sample-fraction 0.05 \
        --run-options "--model /root/model --max-new-tokens 64" --timeout-s 2400

Prints one table; each row also as a JSON line. The machine may be shared: say how busy it was with the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.soak_run import sustained  # noqa: E402 - after the path insert
from benchmarks.topics import read_topic  # noqa: E402

CORPUS = Path(os.environ.get("VLMSTREAM_TEST_IMAGES", REPO.parent / "shared" / "corpus"))
if not CORPUS.is_dir():
    CORPUS = Path("/work/shared/corpus")
COMMON = ["--max-new-tokens", "4"]  # both commands' options; --run-options replaces them
RUN_TIMEOUT_S = 1500
# What --deadline keeps back from the run: stopping its workers (about 10 s) and reading its topics back, so that
# a run cut by the deadline still prints its row (how far it got: a bound on the actual).
DEADLINE_MARGIN_S = 60
# The jobs link to the corpus's files: decode may read there.
ENV = {"OMP_NUM_THREADS": "1", "VLMSTREAM_INFER__BATCH_SIZE": "4",
       "VLMSTREAM_DECODE__ALLOWED_ROOTS": json.dumps([str(CORPUS.resolve())])}
# Jobs run as a new user runs them: the product's own batch size and threads (`run` gives a CPU engine one thread).
AS_SHIPPED = {"p", "q", "s"}


def corpus(kind: str) -> list[Path]:
    from PIL import Image

    files = sorted(p for p in CORPUS.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp"))
    sized = []
    for p in files:
        with Image.open(p) as im:
            sized.append((p, im.size[0] * im.size[1]))
    if kind == "small":
        return [p for p, px in sized if px < 300_000]
    if kind == "large":  # photos the tiny model takes in seconds at their own size (9 MP ones take ~40 s here)
        return [p for p, px in sized if 900_000 <= px <= 2_500_000]
    return [p for p, _ in sized]


GENERATED = Path(os.environ.get("VLMSTREAM_HOME", Path.home() / ".cache" / "vlmstream")) / "honesty-images"
ENV["VLMSTREAM_DECODE__ALLOWED_ROOTS"] = json.dumps([str(CORPUS.resolve()), str(GENERATED)])


def env_for(case: str) -> dict[str, str]:
    """Both commands' environment for a job: ENV, less the benchmark's own batch size and threads for AS_SHIPPED."""
    return {k: v for k, v in ENV.items()
            if case not in AS_SHIPPED or k not in ("OMP_NUM_THREADS", "VLMSTREAM_INFER__BATCH_SIZE")}
_ASPECTS = (4 / 3, 3 / 2, 16 / 9, 1.0, 3 / 4, 2 / 3)


def _photo(width: int, height: int, rng):
    """A photo-like picture: 1/f noise (the power spectrum of natural images) in three correlated channels, a
    lit-from-above gradient, a few soft-edged blobs and sensor grain."""
    import numpy as np
    from PIL import Image, ImageFilter

    w, h = max(16, width // 4), max(16, height // 4)
    fy, fx = np.meshgrid(np.fft.fftfreq(h), np.fft.rfftfreq(w), indexing="ij")
    falloff = 1 / np.maximum(np.hypot(fx, fy), 1 / max(w, h)) ** rng.uniform(0.9, 1.3)
    base = np.fft.irfft2(falloff * np.exp(2j * np.pi * rng.random(falloff.shape)), s=(h, w))
    base = (base - base.mean()) / (base.std() + 1e-9)
    tint = rng.uniform(0.4, 1.0, size=3)
    small = np.stack([base * 40 * t + rng.normal(0, 12, size=(h, w)) for t in tint], axis=-1)
    small += np.linspace(rng.uniform(60, 140), rng.uniform(110, 200), h)[:, None, None] * tint
    img = Image.fromarray(np.clip(small, 0, 255).astype(np.uint8), "RGB").resize((width, height), Image.BICUBIC)
    blobs = Image.new("L", (width, height), 0)
    from PIL import ImageDraw

    draw = ImageDraw.Draw(blobs)
    for _ in range(int(rng.integers(2, 7))):
        x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
        r = rng.uniform(0.05, 0.3) * min(width, height)
        draw.ellipse([x0 - r, y0 - r, x0 + r, y0 + r], fill=int(rng.integers(60, 200)))
    blobs = blobs.filter(ImageFilter.GaussianBlur(max(2, min(width, height) // 80)))
    colour = Image.new("RGB", (width, height), tuple(int(c) for c in rng.integers(0, 255, size=3)))
    img = Image.composite(colour, img, blobs)
    grain = rng.normal(0, rng.uniform(2, 6), size=(height, width, 1)).astype(np.float32)
    return Image.fromarray(np.clip(np.asarray(img, dtype=np.float32) + grain, 0, 255).astype(np.uint8), "RGB")


def _scan(width: int, height: int, rng):
    """A small grayscale scan of a typed page: paper tone, lines of word-sized dark strokes, a slight blur."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    img = Image.new("L", (width, height), int(rng.integers(225, 250)))
    draw = ImageDraw.Draw(img)
    margin, line = int(width * 0.08), max(6, int(height / rng.uniform(35, 60)))
    y = margin
    while y < height - margin:
        x = margin
        while x < width - margin:
            word = int(rng.integers(line, line * 5))
            draw.rectangle([x, y, min(x + word, width - margin), y + int(line * 0.6)], fill=int(rng.integers(10, 80)))
            x += word + int(line * 0.6)
        y += int(line * rng.uniform(1.4, 2.2))
    arr = np.asarray(img.filter(ImageFilter.GaussianBlur(0.8)), dtype=np.float32)
    arr += rng.normal(0, 6, size=arr.shape)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "L")


def generated(kind: str) -> list[Path]:
    """The generated pool of ``kind`` ("photo": 40 photos of 0.3-12 MP; "scan": 60 scans of 0.06-0.4 MP), written
    once into GENERATED (seeded: the same files on every machine)."""
    import numpy as np

    folder = GENERATED / kind
    marker = folder / ".complete"
    if not marker.exists():
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng({"photo": 11, "scan": 12}[kind])
        for n in range(40 if kind == "photo" else 60):
            aspect = _ASPECTS[int(rng.integers(len(_ASPECTS)))]
            px = float(np.exp(rng.uniform(np.log(0.3e6), np.log(12e6)) if kind == "photo"
                              else rng.uniform(np.log(0.06e6), np.log(0.4e6))))
            width, height = int((px * aspect) ** 0.5), int((px / aspect) ** 0.5)
            if kind == "photo":
                _photo(width, height, rng).save(folder / f"photo{n:03d}.jpg", quality=int(rng.integers(78, 96)),
                                                progressive=bool(rng.random() < 0.3))
            elif n % 2:
                _scan(width, height, rng).save(folder / f"scan{n:03d}.png")
            else:
                _scan(width, height, rng).save(folder / f"scan{n:03d}.jpg", quality=85)
        marker.write_text("ok\n")
    return sorted(p for p in folder.iterdir() if p.suffix in (".jpg", ".png"))


def job_p(root: Path, scale: float) -> tuple[Path, list[str]]:
    """A folder of documents of 1-4 generated photos of mixed sizes (0.3-12 MP), in no order of size."""
    photos = generated("photo")
    rng = random.Random(21)
    folder = root / "p"
    for d in range(int(160 * scale)):
        (folder / f"doc{d:04d}").mkdir(parents=True)
        for i in range(rng.randint(1, 4)):
            src = rng.choice(photos)
            (folder / f"doc{d:04d}" / f"{i:02d}{src.suffix}").symlink_to(src)
    return folder, ["--max-pixels", str(256 * 28 * 28)]


def job_q(root: Path, scale: float) -> tuple[Path, list[str]]:
    """1-40 images per document (Pareto), the heavy documents (8 images or more) clustered in the middle of the job:
    multi-page scans, every page of a document the size of its first (as a scanner makes them); the light ones photos
    up to 3 MP or scans."""
    from PIL import Image

    def px(path: Path) -> int:
        with Image.open(path) as im:
            return im.size[0] * im.size[1]

    photos = [p for p in generated("photo") if px(p) <= 3e6]
    scans: dict[int, list[Path]] = {}
    for p in generated("scan"):
        scans.setdefault(min(2, px(p) // 125_000), []).append(p)
    rng = random.Random(22)
    sizes = [min(40, max(1, int(rng.paretovariate(1.2)))) for _ in range(int(460 * scale))]
    light, heavy = [s for s in sizes if s < 8], sorted(s for s in sizes if s >= 8)
    middle = len(light) // 2
    order = light[:middle] + heavy + light[middle:]
    largest_group = max(scans.values(), key=len)
    manifest = root / "q.jsonl"
    with manifest.open("w") as handle:
        for d, size in enumerate(order):
            if size >= 8:
                pool = largest_group
            else:
                pool = photos if rng.random() < 0.5 else scans[rng.choice(sorted(scans))]
            uris = [str(rng.choice(pool)) for _ in range(size)]
            handle.write(json.dumps({"doc_id": f"q{d:04d}", "image_uris": uris}) + "\n")
    return manifest, ["--max-pixels", str(256 * 28 * 28)]


def job_s(root: Path, scale: float) -> tuple[Path, list[str]]:
    """A folder of small scans, one per document (each file its own document): a job of under a minute here."""
    scans = generated("scan")
    folder = root / "s"
    folder.mkdir(parents=True)
    for d in range(int(240 * scale)):
        src = scans[d % len(scans)]
        (folder / f"scan{d:04d}{src.suffix}").symlink_to(src)
    return folder, ["--max-pixels", str(256 * 28 * 28)]


def job_a(root: Path, scale: float) -> tuple[Path, list[str]]:
    """Uniform documents: a subfolder per document, 3 images each, photos and screenshots mixed."""
    images = corpus("all")
    rng = random.Random(1)
    folder = root / "a"
    for d in range(int(80 * scale)):
        (folder / f"doc{d:04d}").mkdir(parents=True)
        for i, src in enumerate(rng.sample(images, 3)):
            (folder / f"doc{d:04d}" / f"{i:02d}{src.suffix}").symlink_to(src)
    return folder, ["--max-pixels", str(256 * 28 * 28)]


def job_b(root: Path, scale: float) -> tuple[Path, list[str]]:
    """1-40 images per document, heavy-tailed (most documents have 1-3), the heavy ones clustered at the end."""
    images = corpus("small") + corpus("large")[:6]
    rng = random.Random(2)
    sizes = sorted(min(40, max(1, int(rng.paretovariate(1.2)))) for _ in range(int(240 * scale)))
    manifest = root / "b.jsonl"
    with manifest.open("w") as handle:
        for d, size in enumerate(sizes):  # sorted: the heavy documents come last
            uris = [str(images[rng.randrange(len(images))]) for _ in range(size)]
            handle.write(json.dumps({"doc_id": f"b{d:04d}", "image_uris": uris}) + "\n")
    return manifest, ["--max-pixels", str(256 * 28 * 28)]


def job_c(root: Path, scale: float) -> tuple[Path, list[str]]:
    """Small screenshots (0.1 MP: the model takes them as they are) and large photos (1-2.1 MP, under the 12.8 MP
    budget the model takes them at their own size: 10-20x the small ones' pixels), one image per document,
    interleaved."""
    small, large = corpus("small"), corpus("large")
    rng = random.Random(3)
    manifest = root / "c.jsonl"
    with manifest.open("w") as handle:
        for d in range(int(150 * scale)):
            src = rng.choice(large) if d % 10 == 0 else rng.choice(small)
            handle.write(json.dumps({"doc_id": f"c{d:04d}", "image_uris": [str(src)]}) + "\n")
    return manifest, ["--max-pixels", "12845056"]


def job_g(root: Path, scale: float) -> tuple[Path, list[str]]:
    """Job b's heavy tail (1-40 images per document, the heavy documents last) over every image of the corpus (on a
    GPU host: --images), 2,000 x scale documents, 0.2 MP."""
    images = corpus("all")
    rng = random.Random(7)
    sizes = sorted(min(40, max(1, int(rng.paretovariate(1.2)))) for _ in range(int(2000 * scale)))
    manifest = root / "g.jsonl"
    with manifest.open("w") as handle:
        for d, size in enumerate(sizes):
            uris = [str(images[rng.randrange(len(images))]) for _ in range(size)]
            handle.write(json.dumps({"doc_id": f"g{d:05d}", "image_uris": uris}) + "\n")
    return manifest, ["--max-pixels", str(256 * 28 * 28)]


def _crop(task: tuple[str, str, int]) -> None:
    """One distinct crop of a photo: a random window of 0.5-4 MP (or the whole photo if smaller), JPEG quality 80-95."""
    from PIL import Image

    src, dst, seed = task
    rng = random.Random(seed)
    with Image.open(src) as im:
        im = im.convert("RGB")
        side = min(1.0, (rng.uniform(0.5e6, 4e6) / (im.size[0] * im.size[1])) ** 0.5)
        w, h = max(64, int(im.size[0] * side)), max(64, int(im.size[1] * side))
        x, y = rng.randrange(im.size[0] - w + 1), rng.randrange(im.size[1] - h + 1)
        im.crop((x, y, x + w, y + h)).save(dst, quality=rng.randrange(80, 96))


def job_h(root: Path, scale: float) -> tuple[Path, list[str]]:
    """Documents of 1-40 images (Pareto), the heavy ones clustered mid-job, every image a distinct crop of a photo of
    the corpus (--images), written into the generated folder (decode may read there), 1 MP."""
    from multiprocessing import Pool

    photos = corpus("all")
    rng = random.Random(8)
    sizes = [min(40, max(1, int(rng.paretovariate(1.2)))) for _ in range(int(700 * scale))]
    light, heavy = [s for s in sizes if s < 8], sorted(s for s in sizes if s >= 8)
    order = light[: len(light) // 2] + heavy + light[len(light) // 2:]
    folder = GENERATED / f"crops-h-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    tasks, manifest = [], root / "h.jsonl"
    with manifest.open("w") as handle:
        for d, size in enumerate(order):
            uris = []
            for i in range(size):
                dst = folder / f"h{d:05d}_{i:02d}.jpg"
                tasks.append((str(rng.choice(photos)), str(dst), rng.randrange(1 << 30)))
                uris.append(str(dst))
            handle.write(json.dumps({"doc_id": f"h{d:05d}", "image_uris": uris}) + "\n")
    with Pool(os.cpu_count()) as pool:
        pool.map(_crop, tasks, chunksize=16)
    return manifest, ["--max-pixels", str(1280 * 28 * 28)]


def job_d(root: Path, scale: float) -> tuple[Path, list[str]]:
    """Job a's documents (a folder of their own: both can run in one invocation), each also condensed into one answer
    (`--condense`)."""
    folder, options = job_a(root / "d", scale)
    return folder, [*options, "--condense"]


JOBS = {"a": job_a, "b": job_b, "c": job_c, "d": job_d, "g": job_g, "h": job_h, "p": job_p, "q": job_q, "s": job_s}


def documents_in(job: Path) -> list[tuple[str, int]]:
    """(doc id, images) in the job's order, as `vlmstream run` publishes them."""
    if job.is_dir():
        from producers.folder import scan_folder

        return [(d.doc_id, len(d.image_uris)) for d in scan_folder(job) if hasattr(d, "image_uris")]
    return [(json.loads(line)["doc_id"], len(json.loads(line)["image_uris"])) for line in job.open()]


def run_full(job: Path, options: list[str], profile: Path | None = None, log: Path | None = None,
             decode_times: bool = True, case_env: dict[str, str] | None = None) -> tuple[float, dict[str, float], dict]:
    """`vlmstream run JOB` on topics and groups of its own: (wall s from start to exit, each document's result time in
    seconds from the start, what decode did: ``decode_costs``). With ``profile`` the inference consumer samples its
    own memory and CPU there each minute; with ``log`` the run's whole progress view is kept there (this script's
    own output keeps only its end). A run that fails (its --timeout-s passed) gives its wall time with
    ``decode_costs``'s ``failed`` set to why, so the caller still reports the estimate and what the run reached.
    ``decode_times=False`` leaves out when each image record was written (reading the images topic back, payloads
    and all: tens of GB for a GPU-sized job)."""
    from vlmstream.config import load_settings

    settings = load_settings()
    suffix = f"honesty-{uuid.uuid4().hex[:8]}"
    names = {k: f"{getattr(settings.topics, k)}.{suffix}"
             for k in ("documents", "images", "descriptions", "embeddings", "results", "summaries", "deadletter")}
    env = dict(os.environ, **(ENV if case_env is None else case_env), **{f"VLMSTREAM_TOPICS__{k.upper()}": v for k, v in names.items()},
               VLMSTREAM_DECODE__GROUP_ID=f"decode-{suffix}", VLMSTREAM_INFER__GROUP_ID=f"infer-{suffix}",
               VLMSTREAM_CONDENSE__GROUP_ID=f"condense-{suffix}",
               VLMSTREAM_PRODUCER__STATE_DIR=tempfile.mkdtemp(prefix="honesty-ledger-"))
    if profile is not None:
        env["VLMSTREAM_PROFILE_OUT"] = str(profile)
    started_wall, started = time.time(), time.monotonic()
    with tempfile.TemporaryFile("w+") if log is None else open(log, "w+") as progress:
        proc = subprocess.run([sys.executable, "-m", "vlmstream.cli", "run", str(job), *options, *COMMON,
                               "--show", "0", "--timeout-s", str(RUN_TIMEOUT_S)], env=env, stdout=subprocess.DEVNULL,
                              stderr=progress, text=True)
        wall = time.monotonic() - started
        progress.seek(0)
        stderr = progress.read()
    sys.stderr.write(stderr[-6000:])  # its last progress lines: where the run spent its time at the end
    results, failed = _result_times(settings, names["results"], started_wall)
    costs = decode_costs(settings, names, started_wall, decode_times)
    if proc.returncode != 0:
        costs["failed"] = f"run exited {proc.returncode}: {stderr.strip().splitlines()[-1:] or ''}"
    elif failed:
        raise SystemExit(f"{failed} images failed in the full run: the job is not what was estimated")
    return wall, results, costs


def decode_costs(settings, names: dict[str, str], started_wall: float, decode_times: bool = True) -> dict:
    """The full run's decode, image by image: each description's decode cost as the estimate reads it (the worker's
    CPU time, else its wall time) by source URI, and when each image record was written (seconds from the start;
    empty without ``decode_times``)."""
    from schemas import Description, SchemaError

    by_uri: dict[str, list[float]] = {}
    rows = []
    for record in read_topic(settings, names["descriptions"]):
        try:
            d = Description.decode(record.value)
        except SchemaError:
            continue
        rows.append((record.timestamp / 1000, d))
        t = d.timings_ms or {}
        ms = t.get("prepare_cpu_ms", t.get("decode_ms"))  # what the estimate reads
        if ms is not None:
            by_uri.setdefault(d.source_uri or "", []).append(ms)
    images = read_topic(settings, names["images"]) if decode_times else []
    decoded_at = sorted(r.timestamp / 1000 - started_wall for r in images)
    return {"decode_ms_by_uri": by_uri, "decoded_at": decoded_at, "rows": rows, "failed": None,
            "described_at": sorted(t - started_wall for t, _ in rows),
            "decoded_by_key": {r.key: r.timestamp / 1000 for r in images}}


def full_calibration(report: dict, full: dict, predicted: dict) -> dict:
    """The estimate's own arithmetic applied to the full run (its images' costs by class and its steady window's
    busy-to-wall scale), to split the error into the costs per image and the scale."""
    from vlmstream.cli.estimate_sample import sample_images
    from vlmstream.projection.costs import calibrate
    from vlmstream.projection.sample import sample_windows

    images = sample_images(full["rows"], report["uri_classes"], full["decoded_by_key"])
    windows = sample_windows(images)
    costs = calibrate(images, windows, decode_parallel=2, shared_cores=True, cores=os.cpu_count() or 1,
                      infer_threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
    job = {c: v["job_images"] for c, v in predicted["costs_by_class"].items()}
    sample_costs = {c: (v["decode_ms"] / 1000, v["infer_ms"] / 1000) for c, v in predicted["costs_by_class"].items()}
    d_s = sum(n * sample_costs[c][0] for c, n in job.items())
    i_s = sum(n * sample_costs[c][1] for c, n in job.items())
    d_f = sum(n * costs.decode_s.get(c, 0.0) for c, n in job.items())
    i_f = sum(n * costs.infer_s.get(c, 0.0) for c, n in job.items())
    busy = decode_concurrency([(im.decoded_at - im.decode_s, im.decoded_at) for im in images
                               if im.decoded_at is not None], windows.steady_start, windows.steady_end)
    return {"full_steady_s": round(windows.steady_s, 1), "full_busy_to_wall": round(costs.scale, 3),
            "infer_cost": costs.infer_cost,
            "infer_wall_over_cpu": {"sample": _wall_over_cpu(report["images"]), "full": _wall_over_cpu(
                [dataclasses.asdict(im) for im in images])},
            "full_decoders_busy": busy,
            "job_busy_s": {"sample_costs": [round(d_s, 1), round(i_s, 1)], "full_costs": [round(d_f, 1), round(i_f, 1)]},
            "full_infer_ms_by_class": {c: round(v * 1000, 1) for c, v in costs.infer_s.items()},
            "full_wall_from_own_costs": round(costs.wall(d_f, i_f), 1),
            "full_wall_from_sample_costs_own_scale": round(costs.wall(d_s, i_s), 1)}


def _wall_over_cpu(images: list[dict]) -> float | None:
    """Inference's batches' wall time over the CPU time shared out of them (how much the cores' crowding stretched
    them); None where the costs are not CPU time."""
    if not images or not all(im.get("infer_cpu") for im in images):
        return None
    walls = {im["batch"]: im["batch_s"] for im in images}
    cpu = sum(im["infer_s"] for im in images)
    return round(sum(walls.values()) / cpu, 3) if cpu else None


def decode_concurrency(spans: list[tuple[float, float]], start: float, end: float) -> dict:
    """Over [start, end]: the share of the time with 0, 1, 2, ... images being decoded at once (each image from its
    record's time less its decode seconds to its record's time), and the mean."""
    events = sorted([(max(a, start), 1) for a, b in spans if b > start and a < end] +
                    [(min(b, end), -1) for a, b in spans if b > start and a < end])
    share: dict[int, float] = {}
    level, at = 0, start
    for t, step in events:
        share[level] = share.get(level, 0.0) + max(0.0, t - at)
        level, at = level + step, max(at, t)
    share[level] = share.get(level, 0.0) + max(0.0, end - at)
    total = max(end - start, 1e-9)
    return {"mean": round(sum(k * v for k, v in share.items()) / total, 2),
            "share": {str(k): round(v / total, 2) for k, v in sorted(share.items())}}


def decode_diagnosis(report: dict, full: dict, predicted: dict) -> dict:
    """The estimate's decode figures against the full run's: per size class, per source file (the same file in the
    sample and in the job), and the sample's images decoded during its warm-up against those decoded in its steady
    window."""
    import statistics as st

    classes = report["uri_classes"]
    full_by_class: dict[str, list[float]] = {}
    for uri, values in full["decode_ms_by_uri"].items():
        full_by_class.setdefault(classes.get(uri, "?"), []).extend(values)
    per_class = {c: {"estimate_ms": v["decode_ms"], "sample_images": v["sample_images"],
                     "full_ms": round(st.fmean(full_by_class[c]), 1) if full_by_class.get(c) else None,
                     "full_images": len(full_by_class.get(c, []))}
                 for c, v in predicted["costs_by_class"].items()}
    sample = report["images"]
    warm = [im for im in sample if im["decoded_at"] is not None and im["decoded_at"] <= report["steady_start"]]
    steady = [im for im in sample if im["decoded_at"] is not None and im["decoded_at"] > report["steady_start"]]
    ratios, warm_ratios, steady_ratios = [], [], []
    for im in sample:
        full_ms = full["decode_ms_by_uri"].get(im["uri"])
        if full_ms:
            r = im["decode_s"] * 1000 / st.fmean(full_ms)
            ratios.append(r)
            (warm_ratios if im in warm else steady_ratios).append(r)
    total_full = sum(sum(v) for v in full["decode_ms_by_uri"].values())
    total_est = sum(v["decode_ms"] * v["job_images"] for v in predicted["costs_by_class"].values())
    at = full["decoded_at"]
    start = report["steady_start"]
    done = max(im["done_at"] for im in sample)
    decoded_in = sorted(im["decoded_at"] for im in steady)
    window = {"steady_s": round(done - start, 2),
              "to_first_decoded_s": round(decoded_in[0] - start, 2) if decoded_in else None,
              "last_decoded_to_last_described_s": round(done - decoded_in[-1], 2) if decoded_in else None}
    window["decoders_busy"] = decode_concurrency(
        [(im["decoded_at"] - im["decode_s"], im["decoded_at"]) for im in sample if im["decoded_at"] is not None],
        start, done)
    return {
        "sample_window": window,
        "per_class": per_class,
        "sample_decode_ms": {"warmup": round(st.fmean(im["decode_s"] for im in warm) * 1000, 1) if warm else None,
                             "warmup_images": len(warm),
                             "steady": round(st.fmean(im["decode_s"] for im in steady) * 1000, 1) if steady else None,
                             "steady_images": len(steady)},
        "sample_over_full_same_file": {"all": round(st.median(ratios), 2) if ratios else None,
                                       "warmup": round(st.median(warm_ratios), 2) if warm_ratios else None,
                                       "steady": round(st.median(steady_ratios), 2) if steady_ratios else None},
        "job_decode_s": {"estimate": round(total_est / 1000, 1), "full": round(total_full / 1000, 1)},
        "full_decoded": {"first_s": round(at[0], 1) if at else None, "last_s": round(at[-1], 1) if at else None,
                         "images": len(at)},
    }


def _input_end(full: dict, shared_cores: bool = True) -> float | None:
    """Where the sustained check's last span ends: when decode published its last image (s from the start), since
    after it inference has the cores decode shared with it (on a CPU engine); on an accelerator decode's end
    changes nothing for inference, so the whole run counts (None)."""
    if not shared_cores:
        return None
    return full["decoded_at"][-1] if full["decoded_at"] else None


def finish_at_last_rate(described_at: list[float], images: int, stopped_s: float, window_s: float = 60.0
                        ) -> float | None:
    """When a run cut short would have ended: its stop, plus the images it had left at the rate of its last minute of
    descriptions (s from the start; None without a rate). A projection, not a measurement: the row says which."""
    last = [t for t in described_at if t > described_at[-1] - window_s] if described_at else []
    if len(last) < 2 or last[-1] <= last[0]:
        return None
    rate = (len(last) - 1) / (last[-1] - last[0])
    return round(stopped_s + (images - len(described_at)) / rate, 1)


def run_memory(profile: Path) -> dict | None:
    """The inference consumer's resident memory (MB) each minute of the full run, and its children's (the engine's
    process where there is one), from its self-profile; None without one."""
    if not profile.exists():
        return None
    windows = json.loads(profile.read_text()).get("windows", [])
    children: dict[str, list[float]] = {}
    for w in windows:
        for child in w.get("children", []):
            children.setdefault(str(child.get("process")), []).append(round(child.get("rss_mb", 0.0)))
    return {"infer_rss_mb": [round(w.get("rss_mb", 0.0)) for w in windows], "children_rss_mb": children}


def _result_times(settings, topic: str, started_wall: float) -> tuple[dict[str, float], int]:
    from schemas import DocumentResult

    out: dict[str, float] = {}
    failed = 0
    for r in read_topic(settings, topic):
        result = DocumentResult.decode(r.value)
        failed += result.failed
        out.setdefault(result.doc_id, r.timestamp / 1000 - started_wall)
    return out, failed


def estimate(job: Path, options: list[str], case_env: dict[str, str] | None = None) -> dict:
    env = dict(os.environ, **(ENV if case_env is None else case_env))
    proc = subprocess.run([sys.executable, "-m", "vlmstream.cli", "estimate", str(job), *options, *COMMON, "--json"],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"estimate failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    sys.stderr.write(proc.stderr)
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    if data["sample_missing"]:
        raise SystemExit(f"{data['sample_missing']} sample images were not described: see the estimate's output")
    return data


def configure(args: argparse.Namespace) -> None:
    """The corpus, both commands' options and the run's limit, from the command line."""
    global CORPUS, COMMON, RUN_TIMEOUT_S
    if args.images:
        CORPUS = Path(args.images).resolve()
        ENV["VLMSTREAM_DECODE__ALLOWED_ROOTS"] = json.dumps([str(CORPUS), str(GENERATED)])
    if args.run_options is not None:
        COMMON = args.run_options.split()
    RUN_TIMEOUT_S = args.timeout_s


def limit_run(seconds: float) -> None:
    global RUN_TIMEOUT_S
    RUN_TIMEOUT_S = int(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="abc")
    parser.add_argument("--scale", type=float, default=1.0, help="Job sizes times this.")
    parser.add_argument("--reports", help="Keep the estimates' sample reports (--sample-report) and the whole runs' "
                        "profiles and progress views in this folder.")
    parser.add_argument("--images", help="Folder of the images the jobs link to (default: the test corpus).")
    parser.add_argument("--run-options", help="Options for both `vlmstream estimate` and `vlmstream run` instead "
                        f"of {' '.join(COMMON)!r} (the tiny model on the CPU), e.g. \"--model /root/model "
                        "--max-new-tokens 64\" on a GPU host.")
    parser.add_argument("--sample-fraction", type=float, default=0.1,
                        help="The estimate's sample: this share of the job's images (at least 16).")
    parser.add_argument("--timeout-s", type=int, default=RUN_TIMEOUT_S, help="The full run's limit.")
    parser.add_argument("--deadline", type=float, help="Unix time by which this script must be done (a machine "
                        "reserved until then): the run's limit becomes the lesser of --timeout-s and the time left then, less "
                        f"{DEADLINE_MARGIN_S} s to stop it and read its results back.")
    parser.add_argument("--diagnose", action="store_true", help="Also hold the estimate's decode costs (per size "
                        "class, per source file, warm-up against steady) against the full run's, in each JSON row.")
    args = parser.parse_args()
    configure(args)
    root = Path(tempfile.mkdtemp(prefix="vlmstream-honesty-"))
    rows = []
    try:
        for case in args.cases:
            job, options = JOBS[case](root, args.scale)
            docs = documents_in(job)
            t0 = time.monotonic()
            images = sum(k for _, k in docs)
            report_file = (Path(args.reports) if args.reports else root) / f"{case}-sample.json"
            load_before = os.getloadavg()
            predicted = estimate(job, [*options, "--sample-images", str(max(16, int(images * args.sample_fraction))),
                                       "--sample-report", str(report_file)], env_for(case))
            estimate_s = time.monotonic() - t0
            load_between = os.getloadavg()
            if args.deadline:
                limit_run(min(args.timeout_s, args.deadline - DEADLINE_MARGIN_S - time.time()))
            out_dir = Path(args.reports) if args.reports else root
            shared_cores = (predicted.get("cost_kinds") or {}).get("inference") == "cpu"
            wall, results, full_decode = run_full(job, options, out_dir / f"{case}-run-profile.json",
                                                  out_dir / f"{case}-run.log", decode_times=args.diagnose or shared_cores,
                                                  case_env=env_for(case))
            load_after = os.getloadavg()
            # The full run as a sustained run: descriptions per minute, the first steady 5 minutes against the last 5
            # (while decode still had documents, on shared cores), and the inference consumer's memory by minute.
            as_sustained = {"sustained": sustained(full_decode["described_at"], input_end=_input_end(
                full_decode, shared_cores)), "memory": run_memory(out_dir / f"{case}-run-profile.json")}
            if full_decode["failed"]:  # no actual time: say what the run reached by its limit, a bound on it
                row = {"case": case, "documents": len(docs), "images": images,
                       "predicted_s": predicted["predicted_s"], "low_s": predicted["low_s"],
                       "high_s": predicted["high_s"], "actual_s": None, "run_failed": full_decode["failed"],
                       "stopped_after_s": round(wall, 1), "documents_done": len(results),
                       "images_described": len(full_decode["described_at"]),
                       "finish_at_last_rate_s": finish_at_last_rate(full_decode["described_at"], images, wall),
                       **as_sustained}
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            # The naive estimate: documents per second over the first N documents done (from the first result to
            # the N-th, start-up left out as a throughput benchmark does), times the documents.
            n = max(2, predicted["sample_documents"])
            first_n = sorted(results.values())[:n]
            naive = (first_n[-1] - first_n[0]) / (len(first_n) - 1) * len(docs) if len(first_n) > 1 else None
            row = {"case": case, "documents": len(docs), "images": images,
                   "sample_documents": predicted["sample_documents"], "sample_images": predicted["sample_images"],
                   "job_over_sample": round(images / predicted["sample_images"], 1),
                   "estimate_s": round(estimate_s, 1), "predicted_s": predicted["predicted_s"],
                   "low_s": predicted["low_s"], "high_s": predicted["high_s"], "actual_s": round(wall, 1),
                   "error": round(predicted["predicted_s"] / wall - 1, 3),
                   "inside_range": predicted["low_s"] <= wall <= predicted["high_s"],
                   "range_parts": predicted.get("range_parts"), "batch_images": predicted.get("batch_images"),
                   "batch_wall_over_cost": predicted.get("batch_wall_over_cost"),
                   "naive_s": round(naive, 1) if naive else None,
                   "naive_error": round(naive / wall - 1, 3) if naive else None,
                   "bottleneck": predicted["bottleneck"], "fixed_s": predicted["fixed_s"],
                   "predicted_steady_s": predicted["steady_s"], "busy_to_wall": predicted.get("busy_to_wall"),
                   "cost_kinds": predicted.get("cost_kinds"), **as_sustained,
                   "load_average": {"before_estimate": [round(x, 2) for x in load_before],
                                    "before_run": [round(x, 2) for x in load_between],
                                    "after_run": [round(x, 2) for x in load_after]}}
            if args.diagnose:
                report = json.loads(report_file.read_text())
                row["decode"] = decode_diagnosis(report, full_decode, predicted)
                row["full_calibration"] = full_calibration(report, full_decode, predicted)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for crops in GENERATED.glob("crops-h-*"):  # job h's distinct crops are written per run
            shutil.rmtree(crops, ignore_errors=True)
    print()
    print("| job | documents | images | sample (docs / images) | estimate took | predicted (range) | actual "
          "| error | in range | naive (first N docs' rate) | naive error | bottleneck | load average |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["actual_s"] is None:
            print(f"| {r['case']} | {r['documents']} | {r['images']} | - | - | {r['predicted_s']:.0f} s "
                  f"({r['low_s']:.0f}-{r['high_s']:.0f}) | stopped after {r['stopped_after_s']:.0f} s with "
                  f"{r['images_described']} images described (at its last minute's rate it would have ended at "
                  f"{r['finish_at_last_rate_s'] or '?'} s) | - | - | - | - | - | - |")
            continue
        naive = f"{r['naive_s']:.0f} s" if r["naive_s"] else "-"
        load = " / ".join(f"{r['load_average'][k][0]:.1f}" for k in ("before_estimate", "before_run", "after_run"))
        naive_error = f"{r['naive_error']:+.0%}" if r["naive_error"] is not None else "-"
        print(f"| {r['case']} | {r['documents']} | {r['images']} | {r['sample_documents']} / {r['sample_images']} "
              f"({r['job_over_sample']:.0f}x) "
              f"| {r['estimate_s']:.0f} s | {r['predicted_s']:.0f} s ({r['low_s']:.0f}-{r['high_s']:.0f}) "
              f"| {r['actual_s']:.0f} s | **{r['error']:+.0%}** | {'yes' if r['inside_range'] else '**no**'} "
              f"| {naive} | {naive_error} | {r['bottleneck']} | {load} |")


if __name__ == "__main__":
    main()
