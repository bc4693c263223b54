"""`vlmstream estimate SOURCE`: how long `vlmstream run SOURCE [same options]` will take, from a sample run.

1. The job's shape, without fetching every image: its documents and images per document; each local image's size
   from its file header (Pillow reads no pixels), the size the model takes it at (the family's resize rule and the
   budget), hence its size class. Images it cannot size so cheaply (remote ones) are counted as of unknown size.
2. A sample of whole documents that covers the heavy tail: stratified by images per document (1, 2-3, 4-7, ...) and
   by the documents' size classes, at least one document from each stratum, the rest in proportion to the images.
3. The sample through the real pipeline: `vlmstream run SAMPLE [same options]` on this machine's broker and workers,
   on topics and groups of its own, timed from start to exit.
4. Its descriptions give each image's decode time and inference batch; the first batch (the model loading ends with
   it) is warm-up, the rest the steady window. ``vlmstream.projection`` calibrates the per-image costs by size
   class against the steady window's wall time and projects the whole job.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

# Piped into a file or a log, rich would assume 80 columns and wrap every line.
console = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=200)

# Images per document, the strata's edges: 1, 2-3, 4-7, 8-15, 16-31, 32+.
_IPD_EDGES = (1, 2, 4, 8, 16, 32)
SIZE_HEADERS_WITHIN_S = 20.0


@dataclass
class JobImage:
    uri: str
    size_class: str
    source_px: int | None
    effective_px: int | None


@dataclass
class JobDocument:
    doc: Any  # DocumentRef
    images: list[JobImage]

    @property
    def stratum(self) -> tuple[int, str]:
        n = len(self.images)
        bucket = max(i for i, edge in enumerate(_IPD_EDGES) if n >= edge) if n else 0
        classes = Counter(im.size_class for im in self.images)
        return bucket, classes.most_common(1)[0][0] if classes else "-"


@dataclass
class JobShape:
    documents: list[JobDocument]
    unseen: list[str] = field(default_factory=list)  # what could not be seen without fetching

    @property
    def images(self) -> int:
        return sum(len(d.images) for d in self.documents)

    def classes(self) -> Counter:
        return Counter(im.size_class for d in self.documents for im in d.images)

    def per_document(self) -> Counter:
        return Counter(len(d.images) for d in self.documents)


def _local_path(uri: str) -> tuple[Path | None, int]:
    """(path, page from 1) of a local image URI; (None, 0) for a remote one."""
    path, _, fragment = uri.removeprefix("file://").partition("#")
    if "://" in path:
        return None, 0
    page = int(fragment.removeprefix("page=")) if fragment.startswith("page=") and fragment[5:].isdigit() else 1
    return Path(path), page


def read_shape(documents: list[Any], family: Any, min_pixels: int, max_pixels: int,
               within_s: float = SIZE_HEADERS_WITHIN_S) -> JobShape:
    """Each document's images with their size class, from file headers only; past within_s (or for remote and
    unreadable images) the size is unknown ('?')."""
    from PIL import Image

    from vlmstream.projection import size_class

    deadline = time.monotonic() + within_s
    out, unknown_remote, unknown_late, unknown_bad = [], 0, 0, 0
    sizes: dict[str, tuple[int, int] | None] = {}
    for doc in documents:
        images = []
        for uri in doc.image_uris:
            if uri not in sizes:
                path, page = _local_path(uri)
                size = None
                if path is None:
                    unknown_remote += 1
                elif time.monotonic() > deadline:
                    unknown_late += 1
                else:
                    try:
                        with Image.open(path) as im:
                            if page > 1:
                                im.seek(page - 1)
                            size = im.size
                    except (OSError, ValueError, EOFError, Image.DecompressionBombError):
                        unknown_bad += 1
                sizes[uri] = size
            size = sizes[uri]
            if size is None:
                images.append(JobImage(uri, size_class(None, None), None, None))
                continue
            width, height = size
            try:
                th, tw = family.target_size(height, width, min_pixels, max_pixels)
                effective = th * tw
            except ValueError:  # an aspect ratio the model refuses: decode dead-letters it, cheaply
                effective = None
            images.append(JobImage(uri, size_class(width * height, effective), width * height, effective))
        out.append(JobDocument(doc, images))
    unseen = []
    if unknown_remote:
        unseen.append(f"{unknown_remote} remote images: sizes not read (fetching them is the job); costed at the "
                      "sample's mean")
    if unknown_late:
        unseen.append(f"{unknown_late} images past the {within_s:.0f} s spent reading headers: sizes not read; "
                      "costed at the sample's mean")
    if unknown_bad:
        unseen.append(f"{unknown_bad} local images whose header could not be read (decode will dead-letter or "
                      "decode them): costed at the sample's mean")
    return JobShape(out, unseen)


def draw_sample(shape: JobShape, target_images: int, seed: int = 0) -> list[JobDocument]:
    """Whole documents, stratified by images per document and size class: each stratum gets a share of the target in
    proportion to its images, and at least one document, so the heavy tail is always in."""
    rng = random.Random(seed)
    strata: dict[tuple[int, str], list[JobDocument]] = defaultdict(list)
    for doc in shape.documents:
        if doc.images:
            strata[doc.stratum].append(doc)
    total = max(1, shape.images)
    chosen: list[JobDocument] = []
    for key in sorted(strata):
        docs = strata[key]
        rng.shuffle(docs)
        share = target_images * sum(len(d.images) for d in docs) / total
        taken, images = [], 0
        for doc in docs:
            if taken and images + len(doc.images) / 2 > share:
                break
            taken.append(doc)
            images += len(doc.images)
        chosen += taken
    # Every size class of the job in the sample, where a document has it.
    have = {im.size_class for d in chosen for im in d.images}
    for name in sorted(set(shape.classes()) - have):
        candidates = [d for d in shape.documents if d not in chosen and any(im.size_class == name for im in d.images)]
        if candidates:
            chosen.append(min(candidates, key=lambda d: len(d.images)))
    return chosen


# --- the sample run ------------------------------------------------------------------------------------------------


@dataclass
class SampleRun:
    wall_s: float
    returncode: int
    output: str
    images: list[Any]  # projection.SampleImage
    first_at: float | None  # seconds from the run's start to its first description
    missing: int  # sample images without a description (dead letters, or the run stopped)


def run_sample(docs: list[JobDocument], run_args: list[str], env_overrides: dict[str, str], config: str | None,
               settings: Any, timeout_s: float) -> SampleRun:
    """`vlmstream run MANIFEST` of the sample, on topics and groups of its own; then its descriptions, read back."""
    from schemas import Description, SchemaError

    suffix = f"estimate-{uuid.uuid4().hex[:10]}"
    names = {name: f"{getattr(settings.topics, name)}.{suffix}"
             for name in ("documents", "images", "descriptions", "embeddings", "results", "deadletter")}
    env = dict(os.environ, **env_overrides, **{f"VLMSTREAM_TOPICS__{k.upper()}": v for k, v in names.items()})
    env.update({"VLMSTREAM_DECODE__GROUP_ID": f"{settings.decode.group_id}.{suffix}",
                "VLMSTREAM_INFER__GROUP_ID": f"{settings.infer.group_id}.{suffix}",
                "VLMSTREAM_PRODUCER__STATE_DIR": tempfile.mkdtemp(prefix="vlmstream-estimate-ledger-")})
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", prefix="vlmstream-estimate-", delete=False) as handle:
        for d in docs:
            handle.write(json.dumps(d.doc.to_dict()) + "\n")
        manifest = handle.name
    cmd = [sys.executable, "-m", "vlmstream.cli", *(["--config", config] if config else []), "run", manifest,
           *run_args, "--show", "0", "--timeout-s", str(int(timeout_s))]
    started_wall = time.time()
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s + 240)
    finally:
        os.unlink(manifest)
    wall = time.monotonic() - started

    sample_settings = settings.model_copy(update={"topics": settings.topics.model_copy(update=names)})
    classes = {im.uri: im.size_class for d in docs for im in d.images}
    wanted = sum(len(d.images) for d in docs)
    rows = []
    for record in _read_all(sample_settings, names["descriptions"], wanted):
        try:
            rows.append((record.timestamp / 1000, Description.decode(record.value)))
        except SchemaError:
            continue
    decoded = {record.key: record.timestamp / 1000 for record in _read_all(sample_settings, names["images"], wanted)}
    _delete_topics(settings, list(names.values()))
    images = _sample_images(rows, classes, decoded)
    first = min((at for at, _ in rows), default=None)
    return SampleRun(wall, proc.returncode, proc.stdout + proc.stderr, images,
                     first - started_wall if first is not None else None, wanted - len(images))


def _read_all(settings: Any, topic: str, wanted: int) -> list[Any]:
    """The records of a topic the sample run wrote (up to ``wanted``, or until 5 s bring nothing new)."""
    from vlmstream.kafka.clients import make_consumer
    from vlmstream.kafka.group import topic_partitions
    from vlmstream.kafka.records import poll_past_unreadable

    consumer = make_consumer(settings, None)
    out = []
    try:
        consumer.assign(topic_partitions(consumer, [topic]))
        consumer.seek_to_beginning()
        deadline, quiet_since = time.monotonic() + 60, time.monotonic()
        while time.monotonic() < deadline and len(out) < wanted and time.monotonic() - quiet_since < 5:
            for _tp, records in poll_past_unreadable(consumer, timeout_ms=500).items():
                quiet_since = time.monotonic()
                out += records
    finally:
        consumer.close()
    return out


def _sample_images(rows: list[tuple[float, Any]], classes: dict[str, str], decoded: dict[bytes, float]) -> list[Any]:
    """Each described image's decode time and its share of its inference batch. A transformers batch's images
    carry the same batch_ms: that batch's time is shared out by tokens (prompt, visual tokens included, plus
    output). An engine without batch times (vLLM): engine_ms over the images in flight with it, by tokens too."""
    from schemas import image_key
    from vlmstream.projection import SampleImage

    batches: dict[tuple, list[tuple[float, Any]]] = defaultdict(list)
    for at, d in rows:
        t = d.timings_ms or {}
        key = ("batch", t["batch_ms"], t.get("vision_ms")) if "batch_ms" in t else ("one", d.doc_id, d.image_index)
        batches[key].append((at, d))
    out = []
    for n, (key, members) in enumerate(batches.items()):
        tokens = [(d.prompt_tokens or 0) + (d.output_tokens or 0) or 1 for _, d in members]
        for (at, d), tok in zip(members, tokens):
            t = d.timings_ms or {}
            if key[0] == "batch":
                infer_s = t["batch_ms"] / 1000 * tok / sum(tokens)
            else:
                infer_s = t.get("engine_ms", 0.0) / 1000
            out.append(SampleImage(classes.get(d.source_uri or "", "e?/s?"), t.get("decode_ms", 0.0) / 1000,
                                   infer_s, at, decoded.get(image_key(d.doc_id, d.image_index)),
                                   f"b{n}" if key[0] == "batch" else ""))
    return out


def _delete_topics(settings: Any, topics: list[str]) -> None:
    from vlmstream.kafka.clients import make_admin

    admin = make_admin(settings)
    try:
        admin.delete_topics(topics)
    except Exception:  # noqa: BLE001 - the sample's topics are uuid-named: one left behind harms nothing
        pass
    finally:
        admin.close()


# --- the command ------------------------------------------------------------------------------------------------


def estimate(
    ctx: typer.Context,
    source: Optional[Path] = typer.Argument(None, help="A folder of images (as `vlmstream run` takes it), a manifest "
                                            "file, or nothing with --topic."),
    topic: bool = typer.Option(False, "--topic", help="Estimate the documents topic's backlog (the decode group's "
                               "lag) instead of a folder or manifest."),
    model: Optional[str] = typer.Option(None, "--model", help="As `vlmstream run --model`."),
    engine: Optional[str] = typer.Option(None, "--engine", help="As `vlmstream run --engine`."),
    mode: Optional[str] = typer.Option(None, "--mode", help="As `vlmstream run --mode`."),
    per_file: bool = typer.Option(False, "--per-file", help="As `vlmstream run --per-file`."),
    decode_workers: Optional[int] = typer.Option(None, "--decode-workers", help="As `vlmstream run`."),
    max_pixels: Optional[int] = typer.Option(None, "--max-pixels", help="As `vlmstream run --max-pixels`."),
    prompt: Optional[str] = typer.Option(None, "--prompt"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens"),
    gpus: int = typer.Option(1, "--gpus", min=1, help="Inference processes (GPUs) the job will run on; the "
                             "inference rate measured here is scaled by it."),
    decode_cores: Optional[int] = typer.Option(None, "--decode-cores", min=1, help="Decode processes the job will "
                                               "run with in all; the decode rate measured here is scaled by it."),
    sample_images: Optional[int] = typer.Option(None, "--sample-images", help="About how many images the sample "
                                                "runs (default: 5% of the job, 16 to 300)."),
    seed: int = typer.Option(0, "--seed", help="The sample's random draw within each stratum."),
    as_json: bool = typer.Option(False, "--json", help="End with one line: the estimate as a JSON object "
                                 "(predicted_s, low_s, high_s, images, documents, bottleneck, ...)."),
    timeout_s: float = typer.Option(1200.0, "--timeout-s", help="Give the sample run up after this long."),
) -> None:
    """Predict how long `vlmstream run SOURCE [same options]` takes on this machine (or, with --gpus/--decode-cores,
    on more), from a stratified sample run through the real pipeline; prints the job's shape, the sample, the
    measured costs per size class, the projection with its range, and its assumptions."""
    from vlmstream.cli.run import with_pixel_budget
    from vlmstream.cli.support import bootstrap, settings_from
    from vlmstream.models.registry import family_named, family_of
    from vlmstream.projection import calibrate, project, rate_spread, sample_windows

    overrides: dict[str, Any] = {
        "decode": {"max_pixels": max_pixels, "workers": decode_workers},
        "infer": {"model": model, "engine": engine, "mode": mode, "prompt": prompt, "max_new_tokens": max_new_tokens},
    }
    settings = settings_from(ctx, overrides)
    settings, said = with_pixel_budget(settings)
    console.print(said)
    documents, what = _job_documents(settings, source, topic, per_file)
    if not documents:
        console.print(f"[red]{what} holds no documents to estimate[/]")
        raise typer.Exit(2)
    try:
        family = family_of(settings.infer.model) if settings.infer.model else family_named("qwen2_vl")
    except (ValueError, OSError):
        family = family_named("qwen2_vl")
    shape = read_shape(documents, family, settings.decode.min_pixels, settings.decode.max_pixels)
    target = sample_images or max(16, min(300, shape.images // 20))
    sample = draw_sample(shape, target, seed)
    sample_count = sum(len(d.images) for d in sample)
    per_doc = shape.per_document()
    console.print(f"job: {what}: {len(shape.documents)} documents, {shape.images} images "
                  f"({min(per_doc)}-{max(per_doc)} per document, mean {shape.images / len(shape.documents):.1f})")
    console.print("  size classes (e: pixels the model takes, s: source pixels; bins of 4x from 0.05 MP): " +
                  ", ".join(f"{c} {n}" for c, n in sorted(shape.classes().items())))
    console.print(f"sample: {len(sample)} documents, {sample_count} images, from "
                  f"{len({d.stratum for d in sample})} strata (images per document x size class)")

    run_args = _run_args(per_file=False, decode_workers=decode_workers, max_pixels=max_pixels, model=model,
                         engine=engine, mode=mode, prompt=prompt, max_new_tokens=max_new_tokens)
    bootstrap(settings)
    state = ctx.find_root().obj
    env = {"VLMSTREAM_BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers}
    result = run_sample(sample, run_args, env, getattr(state, "config_file", None), settings, timeout_s)
    if result.returncode != 0 or len(result.images) < 2:
        console.print(f"[red]the sample run failed (exit {result.returncode}, {len(result.images)} images described)"
                      f"[/]\n{result.output[-3000:]}")
        raise typer.Exit(1)

    decode_parallel = settings.decode.workers or os.cpu_count() or 1
    on_cpu = _inference_on_cpu(settings)
    windows = sample_windows(result.images)
    costs = calibrate(result.images, windows, decode_parallel=decode_parallel, shared_cores=on_cpu)
    spread = rate_spread(result.images, windows.steady_start)
    projection = project(dict(shape.classes()), len(shape.documents), costs, windows, result.wall_s, spread=spread,
                         gpus=gpus, decode_cores=decode_cores)
    fixed, warm, steady_wall = projection.fixed_s, windows.warmup_images, windows.steady_s
    steady = [im for im in result.images if im.done_at > windows.steady_start]
    decode_per_image = statistics.fmean(im.decode_s for im in result.images)
    infer_per_image = statistics.fmean(im.infer_s for im in result.images)
    assumptions = [
        f"the sample ran as `vlmstream run` does here: {decode_parallel} decode process(es), inference on "
        f"{'the CPU, sharing its cores with decode (their costs add)' if on_cpu else 'its accelerator (decode overlaps it)'}",
        "the cost of an image depends on its size class only (not on its document, its place in the job or the "
        "time of day); the steady rate does not drift past what the sample saw",
        f"fixed cost {fixed:.1f} s (start-up, model loading, the first batch of {warm} images, results and stopping) "
        "is the same for the whole job",
        f"the range is the steady rate's spread between the sample's two halves ({spread:.0%}, at least 5%)",
        f"decoding done while the model loads is free: the sample decoded {windows.decoded_in_warmup} images then"
        + (" and ran out of work; the job's count is decode's rate then times that time"
           if windows.decode_exhausted else ""),
        *projection.assumptions, *shape.unseen,
    ]
    if result.missing:
        assumptions.append(f"{result.missing} sample images were not described (dead letters): costed like the rest")
    if not settings.infer.model:
        assumptions.append("the built-in tiny random-weight model: figures for a real model differ")
    projection.assumptions = assumptions

    console.print(f"sample run: {result.wall_s:.1f} s wall; warm-up {result.first_at or 0:.1f} s to the first "
                  f"description, first batch of {warm} images excluded; steady window {steady_wall:.1f} s for "
                  f"{len(steady)} images ({len(steady) / steady_wall if steady_wall else 0:.2f} img/s)")
    console.print(f"  per image: decode {decode_per_image * 1000:.0f} ms of one worker, inference "
                  f"{infer_per_image * 1000:.0f} ms of its batch; busy seconds to wall seconds here: x{costs.scale:.2f}")
    console.print("  per size class (decode ms / inference ms): " + ", ".join(
        f"{c} {costs.decode_s[c] * 1000:.0f}/{costs.infer_s[c] * 1000:.0f}" for c in sorted(costs.decode_s)))
    if projection.decode_cores_per_gpu is not None:
        console.print(f"  decode cores per inference process to keep it busy: {projection.decode_cores_per_gpu:.2f} "
                      "(decode s per image / inference s per image)")
    console.print(f"[bold]predicted: {_dur(projection.predicted_s)} ({_dur(projection.low_s)} - "
                  f"{_dur(projection.high_s)}) for {projection.images} images in {projection.documents} documents; "
                  f"bottleneck {projection.bottleneck} ({projection.bottleneck_share:.0%} of the busy time)[/]")
    for line in projection.scaled:
        console.print(f"  scaled: {line}")
    console.print("assumptions and what the estimate could not see:")
    for line in assumptions:
        console.print(f"  - {line}")
    if as_json:
        data = projection.as_dict()
        data.update({"sample_documents": len(sample), "sample_images": sample_count,
                     "sample_images_per_document": sorted(len(d.images) for d in sample),
                     "sample_wall_s": round(result.wall_s, 1), "warmup_s": round(result.first_at or 0.0, 1),
                     "warmup_images": warm, "steady_window_s": round(steady_wall, 1)})
        print(json.dumps(data))


def _job_documents(settings: Any, source: Path | None, topic: bool, per_file: bool) -> tuple[list[Any], str]:
    from schemas import DocumentRef

    if topic:
        return _backlog_documents(settings), f"the backlog of {settings.topics.documents}"
    if source is None:
        raise typer.BadParameter("give a folder, a manifest file, or --topic")
    source = source.resolve()
    if source.is_file():
        from producers.manifest import read_manifest

        return [d for d in read_manifest(source) if isinstance(d, DocumentRef)], str(source)
    if source.is_dir():
        from producers.folder import scan_folder

        return [d for d in scan_folder(source, per_file=per_file) if isinstance(d, DocumentRef)], str(source)
    raise typer.BadParameter(f"{source} is not a folder or a manifest file")


def _backlog_documents(settings: Any, within_s: float = 60.0) -> list[Any]:
    """The documents the decode group has not committed past (read without a group)."""
    from schemas import DocumentRef, SchemaError
    from vlmstream.cli.backlog import _lag
    from vlmstream.kafka.clients import make_admin, make_consumer
    from vlmstream.kafka.records import poll_past_unreadable

    admin = make_admin(settings)
    try:
        spans = _lag(admin, settings.decode.group_id, settings.topics.documents)
    finally:
        admin.close()
    docs: list[Any] = []
    if not spans:
        return docs
    consumer = make_consumer(settings, None)
    try:
        consumer.assign(list(spans))
        for tp, (start, _end) in spans.items():
            consumer.seek(tp, start)
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for tp, records in poll_past_unreadable(consumer, timeout_ms=300).items():
                for record in records:
                    if record.offset < spans[tp][1]:
                        try:
                            docs.append(DocumentRef.decode(record.value))
                        except SchemaError:
                            pass
            if all(consumer.position(tp) >= end for tp, (_s, end) in spans.items()):
                break
    finally:
        consumer.close()
    return docs


def _run_args(**options: Any) -> list[str]:
    args = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value not in (None, False):
            args += [flag, str(value)]
    return args


def _inference_on_cpu(settings: Any) -> bool:
    """Whether inference will share this machine's cores with decode (the transformers engine without a GPU)."""
    if settings.infer.engine == "vllm":
        return False
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


def _dur(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
