"""`vlmstream estimate SOURCE`: how long `vlmstream run SOURCE [same options]` will take, from a sample run.

1. The job's shape, without fetching every image: its documents and images per document; each local image's size
   from its file header (Pillow reads no pixels), the size the model takes it at (the family's resize rule and the
   budget), hence its size class. Images it cannot size so cheaply (remote ones) are counted as of unknown size.
2. A sample of whole documents that covers the heavy tail: stratified by images per document (1, 2-3, 4-7, ...) and
   by the documents' size classes, at least one document from each stratum, the rest in proportion to the images.
3. The sample through the real pipeline: `vlmstream run SAMPLE [same options]` on this machine's broker and workers,
   on topics and groups of its own, timed from start to exit.
4. Its descriptions give each image's decode time and inference batch; until the first batch starts is warm-up
   (start-up, model loading), from there to the last description the steady window. ``vlmstream.projection`` calibrates the per-image costs by size
   class against the steady window's wall time and projects the whole job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
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
# The command's start, as near as this module knows it (`vlmstream`'s main imports it at start-up): `vlmstream run`'s
# time counts from its process start too.
PROCESS_STARTED = time.time()


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
    """Whole documents, stratified by images per document and size class: one document from every stratum first (so
    the heavy tail is always in), then the rest of the target shared out over the strata in proportion to their
    images; then a document for any size class still missing. Returned in the job's order."""
    rng = random.Random(seed)
    strata: dict[tuple[int, str], list[JobDocument]] = defaultdict(list)
    for doc in shape.documents:
        if doc.images:
            strata[doc.stratum].append(doc)
    for docs in strata.values():
        rng.shuffle(docs)
    chosen = [docs[0] for _key, docs in sorted(strata.items())]
    left = max(0, target_images - sum(len(d.images) for d in chosen))
    total = max(1, shape.images)
    for _key, docs in sorted(strata.items()):
        share = left * sum(len(d.images) for d in docs) / total
        images = 0
        for doc in docs[1:]:
            if images + len(doc.images) / 2 > share:
                break
            chosen.append(doc)
            images += len(doc.images)
    have = {im.size_class for d in chosen for im in d.images}
    for name in sorted(set(shape.classes()) - have):
        candidates = [d for d in shape.documents if d not in chosen and any(im.size_class == name for im in d.images)]
        if candidates:
            chosen.append(min(candidates, key=lambda d: len(d.images)))
    # In the job's order: what runs together (a large image padding its batch's small ones, heavy documents
    # clustered at the end) runs together in the sample too.
    position = {id(d): i for i, d in enumerate(shape.documents)}
    return sorted(chosen, key=lambda d: position[id(d)])


# --- the sample run ------------------------------------------------------------------------------------------------


@dataclass
class SampleRun:
    images: list[Any]  # projection.SampleImage
    started_at: float  # epoch seconds: the command's start
    workers_at: float  # the workers started
    ready_at: float  # the warm-up document described: the model is loaded and answering
    measured_at: float  # the rest of the sample published: the steady window starts
    done_at: float  # the last sample image described (or dead-lettered)
    stop_s: float  # stopping the workers took
    missing: int  # sample images without a description (dead letters, or the time ran out)
    answers: dict[str, tuple[float, float]] = field(default_factory=dict)  # with condense: doc id -> (written, model s)

    @property
    def condensed(self) -> int:
        return len(self.answers)

    @property
    def condense_s_per_document(self) -> float:
        return statistics.fmean(s for _at, s in self.answers.values()) if self.answers else 0.0

    @property
    def fixed_s(self) -> float:
        """What `vlmstream run` spends whatever the job: up to the workers, their warm-up, and stopping them."""
        return (self.ready_at - self.started_at) + self.stop_s


def run_sample(docs: list[JobDocument], settings: Any, timeout_s: float, own_s: float = 0.0,
               condense: bool = False) -> SampleRun:
    """The sample through the real pipeline as `vlmstream run` runs it (its decode and inference workers, as child
    processes, with the same settings; with ``condense`` the condense worker too), on topics and groups of its own,
    in two steps: a one-image warm-up document plus about a quarter of the sample (decoded while the model loads, as a
    run's first documents are), then, once the warm-up document is described, the rest; the steady window runs from
    there to the last description (with ``condense``: to the last document's answer)."""
    from producers.publisher import publish_documents
    from schemas import DeadLetter, Description, DocumentRef, DocumentSummary, SchemaError
    from vlmstream.cli.run import _as_stage, _child, _kill, _manifest_roots, _settings_file, _stop_children
    from vlmstream.kafka.clients import make_consumer
    from vlmstream.kafka.group import topic_partitions
    from vlmstream.kafka.records import poll_past_unreadable
    from vlmstream.kafka.topics import create_topics

    suffix = f"estimate-{uuid.uuid4().hex[:10]}"
    names = {name: f"{getattr(settings.topics, name)}.{suffix}"
             for name in ("documents", "images", "descriptions", "embeddings", "results", "summaries", "deadletter")}
    roots = list(settings.decode.allowed_roots)
    roots += [r for r in _manifest_roots([d.doc for d in docs]) if r not in roots]
    settings = settings.model_copy(update={
        "topics": settings.topics.model_copy(update=names),
        "decode": settings.decode.model_copy(update={"group_id": f"{settings.decode.group_id}.{suffix}",
                                                     "allowed_roots": roots}),
        "infer": settings.infer.model_copy(update={"group_id": f"{settings.infer.group_id}.{suffix}"}),
        "condense": settings.condense.model_copy(update={"group_id": f"{settings.condense.group_id}.{suffix}"}),
        "producer": settings.producer.model_copy(update={
            "state_dir": tempfile.mkdtemp(prefix="vlmstream-estimate-ledger-")}),
    })
    create_topics(settings)
    smallest = min((im for d in docs for im in d.images), key=lambda im: im.effective_px or 1 << 40)
    warmup = DocumentRef(doc_id=f"estimate-warmup-{suffix}", image_uris=(smallest.uri,))
    first_part, rest, images = [], [], 0
    total = sum(len(d.images) for d in docs)
    for d in docs:
        (first_part if images < total / 4 else rest).append(d)
        images += len(d.images) if images < total / 4 else 0
    wanted = {(d.doc.doc_id, i) for d in docs for i in range(len(d.images))}
    seen: set[tuple[str, int]] = set()
    # With condense: each document's answer (or its condense dead letter) too; the warm-up document's is not waited for.
    to_condense = {d.doc.doc_id for d in docs} if condense else set()
    stages = ("decode", "infer") + (("condense",) if condense else ())

    watcher = make_consumer(_as_stage(settings, "tap"), None)
    tps = topic_partitions(watcher, [names["descriptions"], names["deadletter"]]
                           + ([names["summaries"]] if condense else []))
    watcher.assign(tps)
    watcher.seek_to_beginning()
    log_dir = Path(tempfile.mkdtemp(prefix="vlmstream-estimate-logs-"))
    config_files = {stage: _settings_file(_as_stage(settings, stage)) for stage in stages}
    children: dict[str, subprocess.Popen] = {}
    ready_at = measured_at = done_at = 0.0
    deadline = time.monotonic() + timeout_s
    interrupted: str | None = None
    try:
        workers_at = time.time()
        # _child gives the workers the sample's settings file and none of the settings variables of this
        # environment, which would send them to the real job's topics and groups.
        children["decode"] = _child(["decode"], config_files["decode"], log_dir / "decode.log")
        children["infer"] = _child(["infer"], config_files["infer"], log_dir / "infer.log")
        if condense:
            children["condense"] = _child(["condense"], config_files["condense"], log_dir / "condense.log")
        publish_documents(_as_stage(settings, "producer"), [warmup, *(d.doc for d in first_part)], force=True)
        warm_done = False
        while (not warm_done or wanted - seen or to_condense) and time.monotonic() < deadline:
            for name, proc in children.items():
                if proc.poll() is not None:
                    raise typer.BadParameter(f"the sample's {name} worker exited with {proc.returncode}: "
                                             f"{(log_dir / f'{name}.log').read_text()[-2000:]}")
            for tp, records in poll_past_unreadable(watcher, timeout_ms=300).items():
                for record in records:
                    try:
                        kind = {names["descriptions"]: Description, names["summaries"]: DocumentSummary}.get(
                            tp.topic, DeadLetter)
                        message = kind.decode(record.value)
                    except SchemaError:
                        continue
                    if kind is DocumentSummary or (kind is DeadLetter and message.stage == "condense"):
                        to_condense.discard(message.doc_id)
                    elif message.doc_id == warmup.doc_id:
                        warm_done = True
                    elif message.doc_id is not None and getattr(message, "image_index", None) is not None:
                        seen.add((message.doc_id, message.image_index))
            if warm_done and not ready_at:
                ready_at = time.time()
                publish_documents(_as_stage(settings, "producer"), [d.doc for d in rest], force=True)
                measured_at = time.time()
        done_at = time.time()
    except KeyboardInterrupt:
        interrupted = "Ctrl-C"  # the workers still drain; a second Ctrl-C stops them at once
        raise
    finally:
        watcher.close()
        stopping = time.monotonic()
        try:
            _stop_children(children, stopped_by=interrupted)
        except BaseException:  # a Ctrl-C after the second (which _stop_children answers by killing), or any other
            # error while it waits: the workers must not outlive the estimate
            for proc in children.values():
                _kill(proc)
            raise
        stop_s = time.monotonic() - stopping
        for config_file in config_files.values():
            config_file.unlink(missing_ok=True)
    if not ready_at:
        raise typer.BadParameter(f"the sample's warm-up document was not described within --timeout-s {timeout_s:g}; "
                                 f"worker logs in {log_dir}")
    classes = {im.uri: im.size_class for d in docs for im in d.images}
    rows = []
    for record in _read_all(settings, names["descriptions"], len(wanted) + 1):
        try:
            description = Description.decode(record.value)
        except SchemaError:
            continue
        if description.doc_id != warmup.doc_id:
            rows.append((record.timestamp / 1000, description))
    decoded = {record.key: record.timestamp / 1000
               for record in _read_all(settings, names["images"], len(wanted) + 1)}
    answers = {}
    if condense:
        for record in _read_all(settings, names["summaries"], len(docs) + 1):
            try:
                summary = DocumentSummary.decode(record.value)
            except SchemaError:
                continue
            if summary.doc_id == warmup.doc_id:
                continue
            t = summary.timings_ms or {}
            answers[summary.doc_id] = (record.timestamp / 1000,
                                       t.get("generate_cpu_ms", t.get("generate_ms", 0.0))  # as inference's
                                       / max(1.0, t.get("batch_documents", 1.0)) / 1000)
    _delete_topics(settings, list(names.values()))
    shutil.rmtree(log_dir, ignore_errors=True)
    # The run's time counts from the command's start, less ``own_s``: what only the estimate does before it (reading
    # every image's header, drawing the sample), which `vlmstream run` does not.
    return SampleRun(_with_answers(_sample_images(rows, classes, decoded), answers), PROCESS_STARTED + own_s,
                     workers_at, ready_at, measured_at,
                     done_at, stop_s, len(wanted) - len(rows), answers)


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
    """Each described image's decode time and its share of its inference batch. A transformers batch's images carry
    the same batch_ms: the vision tower's part is shared out by visual tokens (it runs on each image's own patches),
    the rest equally (the language model pads every sequence to the batch's longest). On the CPU the batch's cost
    is the process's CPU time over it (batch_cpu_ms, vision_cpu_ms), shared out the same way: like decode's, its
    wall time grows with whatever else runs on the cores (the sample's burst keeps every process busy at once, a
    long job less so) and the projection counts the cores' contention once, by itself. On an accelerator the batch's
    wall time is its cost (the accelerator's time; the process's CPU time there says nothing). An engine without
    batch times (vLLM): each image's own engine_ms."""
    from schemas import image_key
    from vlmstream.projection import SampleImage

    batches: dict[tuple, list[tuple[float, Any]]] = defaultdict(list)
    for at, d in rows:
        t = d.timings_ms or {}
        key = ("batch", t["batch_ms"], t.get("vision_ms")) if "batch_ms" in t else ("one", d.doc_id, d.image_index)
        batches[key].append((at, d))
    out = []
    for n, (key, members) in enumerate(batches.items()):
        tokens = sum(d.visual_tokens or 1 for _, d in members)
        for at, d in members:
            t = d.timings_ms or {}
            infer_cpu = key[0] == "batch" and "batch_cpu_ms" in t
            if key[0] == "batch":
                whole, vision = ((t["batch_cpu_ms"], t.get("vision_cpu_ms", 0.0)) if infer_cpu
                                 else (t["batch_ms"], t.get("vision_ms", 0.0)))
                infer_s = (vision * (d.visual_tokens or 1) / tokens + (whole - vision) / len(members)) / 1000
                batch, batch_s = f"b{n}", t["batch_ms"] / 1000
            else:
                infer_s, batch, batch_s = t.get("engine_ms", 0.0) / 1000, "", 0.0
            # Decode's CPU time, where the worker reports it: its wall time grows with whatever else runs on the
            # cores at that moment (the sample's short burst keeps every process busy at once, a long job less so),
            # and the projection adds the contention of the cores once, by itself.
            decode_ms = t.get("prepare_cpu_ms", t.get("decode_ms", 0.0))
            out.append(SampleImage(classes.get(d.source_uri or "", "e?/s?"), decode_ms / 1000,
                                   infer_s, at, decoded.get(image_key(d.doc_id, d.image_index)), batch, batch_s,
                                   d.source_uri or "", d.doc_id, infer_cpu, decode_cpu="prepare_cpu_ms" in t))
    return out


def _with_answers(images: list[Any], answers: dict[str, tuple[float, float]]) -> list[Any]:
    """With condense: each document's share of its answer's time added to its images' inference cost (condense's
    model runs where inference's does: the same cores here, the same accelerator on a GPU), shared out equally over
    its images, and each image done when its document's answer was written."""
    if not answers:
        return images
    counts = Counter(im.doc_id for im in images)
    out = []
    for im in images:
        at, seconds = answers.get(im.doc_id, (im.done_at, 0.0))
        out.append(dataclasses.replace(im, infer_s=im.infer_s + seconds / counts[im.doc_id],
                                       done_at=max(im.done_at, at)))
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
    condense: bool = typer.Option(False, "--condense", help="As `vlmstream run --condense` (each document's "
                                  "descriptions condensed into one answer): the sample runs the condense worker too "
                                  "and its time per document is in the prediction."),
    timeout_s: float = typer.Option(1200.0, "--timeout-s", help="Give the sample run up after this long."),
    sample_report: Optional[Path] = typer.Option(None, "--sample-report", help="Write what the sample measured to "
                                                 "this JSON file: each job image's size class, and each sample "
                                                 "image's decode and inference seconds and when it was decoded and "
                                                 "described (to hold against a full run's)."),
) -> None:
    """Predict how long `vlmstream run SOURCE [same options]` takes on this machine (or, with --gpus/--decode-cores,
    on more), from a stratified sample run through the real pipeline; prints the job's shape, the sample, the
    measured costs per size class, the projection with its range, and its assumptions."""
    from consumers.decode.stage import decode_family
    from vlmstream.cli.run import _as_stage, with_model_family, with_pixel_budget
    from vlmstream.cli.support import bootstrap, settings_from
    from vlmstream.projection import (calibrate, contended_warmup, engine_shares, project, rate_spread,
                                      sample_windows)

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
    tiny = not settings.infer.model
    if tiny:
        from consumers.infer.tiny_model import default_tiny_model_dir

        settings = settings.model_copy(update={"infer": settings.infer.model_copy(
            update={"model": str(default_tiny_model_dir())})})
    # The family and pixel limits decode resizes for, as `vlmstream run` settles them.
    settings, said = with_model_family(settings)
    console.print(said)
    family = decode_family(settings.decode)
    shaping = time.monotonic()
    shape = read_shape(documents, family, family.min_pixels, family.max_pixels)
    target = sample_images or max(16, min(300, shape.images // 20))
    sample = draw_sample(shape, target, seed)
    shape_s = time.monotonic() - shaping
    sample_count = sum(len(d.images) for d in sample)
    per_doc = shape.per_document()
    console.print(f"job: {what}: {len(shape.documents)} documents, {shape.images} images "
                  f"({min(per_doc)}-{max(per_doc)} per document, mean {shape.images / len(shape.documents):.1f})")
    console.print("  size classes (e: pixels the model takes, s: source pixels; bins of 4x from 0.05 MP): " +
                  ", ".join(f"{c} {n}" for c, n in sorted(shape.classes().items())))
    console.print(f"sample: {len(sample)} documents, {sample_count} images, from "
                  f"{len({d.stratum for d in sample})} strata (images per document x size class)")

    bootstrap(settings)
    load_before = os.getloadavg()[0]
    result = run_sample(sample, settings, timeout_s, own_s=shape_s, condense=condense)
    load_after = os.getloadavg()[0]
    if len(result.images) < 2:
        console.print(f"[red]the sample run described {len(result.images)} images: nothing to measure[/]")
        raise typer.Exit(1)

    decode_parallel = settings.decode.workers or os.cpu_count() or 1
    on_cpu = _inference_on_cpu(settings)
    windows = sample_windows(result.images, steady_start=result.measured_at)
    images, shared_out = engine_shares(result.images, windows)
    result = dataclasses.replace(result, images=images)
    cores = os.cpu_count() or 1
    # torch's CPU threads in the sample's inference worker: infer.cpu_threads as `run` sets it, else OMP_NUM_THREADS
    # (the workers inherit this environment), else one per core.
    infer_threads = (_as_stage(settings, "infer").infer.cpu_threads
                     or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or cores)
    costs = calibrate(result.images, windows, decode_parallel=decode_parallel, shared_cores=on_cpu, cores=cores,
                      infer_threads=infer_threads)
    # The range: the steady rate's wander between the window's halves, but no narrower than a window of n batches
    # can tell (1/sqrt(n)): a short window on a busy machine says little about the next ten minutes.
    # An engine that runs requests at once (no batches of its own): each request is one.
    batches = len({im.batch or n for n, im in enumerate(result.images) if im.done_at > windows.steady_start}) \
        or len(result.images)
    spread = max(rate_spread(result.images, windows.steady_start), 1 / batches ** 0.5)
    extra = 0.0
    warm_workers = result.ready_at - result.workers_at
    if on_cpu and windows.decode_exhausted:
        # The sample's decoding ran out before the model was ready; a job's keeps the cores busy all that time.
        decode_busy = max(im.decoded_at for im in result.images
                          if im.decoded_at is not None and im.decoded_at <= windows.steady_start) - result.workers_at
        extra = contended_warmup(warm_workers, decode_busy, cores=os.cpu_count() or 1,
                                 decode_parallel=decode_parallel) - warm_workers
    projection = project(dict(shape.classes()), len(shape.documents), costs, windows, result.fixed_s, spread=spread,
                         gpus=gpus, decode_cores=decode_cores, warmup_extra_s=extra)
    fixed, steady_wall = projection.fixed_s, windows.steady_s
    steady = [im for im in result.images if im.done_at > windows.steady_start]
    decode_per_image = statistics.fmean(im.decode_s for im in result.images)
    infer_per_image = statistics.fmean(im.infer_s for im in result.images)
    warmup_s = result.ready_at - result.started_at
    cost_kinds = {"decode": "cpu" if all(im.decode_cpu for im in result.images) else "wall",
                  "inference": "engine share" if shared_out else costs.infer_cost}
    assumptions = [
        f"the sample ran as `vlmstream run` does here: {decode_parallel} decode process(es), inference on "
        + (f"the CPU on {infer_threads} thread(s), sharing the {cores} cores with decode: the wall time is the "
           "largest of decode's time over its processes, inference's, and both stages' CPU seconds over the cores"
           if on_cpu else "its accelerator: decode overlaps it, the slower stage sets the pace"),
        "costs per image measured as: decode, "
        + ("the decode thread's CPU time (decode, resize, encode)" if cost_kinds["decode"] == "cpu"
           else "its wall time (the decode worker reported no CPU time)")
        + "; inference, "
        + (f"the inference process's CPU time over each batch (torch's {infer_threads} thread(s), and a little of "
           "the runner's and its Kafka clients'), shared out over the batch's images by visual tokens"
           + (" (condense's CPU time per answer added)" if condense else "")
           + f", as wall time on its {infer_threads} thread(s) with a core each; CPU time leaves out waiting for a "
           "core, so the cores' contention is counted once, by the CPU limit" if costs.infer_cpu
           else "its share of the steady window's wall time, by each request's time in the engine (the engine runs "
           "many requests at once: one request's time in it is its latency, not its cost)" if shared_out
           else "the batch's wall time on its accelerator (its time is what the job waits for; the process's CPU "
           "time there says nothing)" if not on_cpu
           else "the batch's wall time (the engine reported no CPU time), which grows with whatever else ran on the "
           "cores during the sample"),
        "the cost of an image depends on its size class only (not on its document, its place in the job or the "
        "time of day); the steady rate does not drift past what the sample saw",
        f"fixed cost {fixed:.1f} s: start-up and model loading until a first image is described ({warmup_s:.1f} s"
        + (f", plus {extra:.1f} s: the sample's decoding ran out while the model loaded, a job's shares the "
           f"{os.cpu_count()} cores with it all along" if extra else "")
        + f"), stopping the workers ({result.stop_s:.1f} s); the same for the whole job",
        f"the range: the steady part at a rate faster or slower by {min(max(spread, 0.05), 0.5):.0%} (the larger of "
        f"the spread between the sample's two halves and 1/sqrt({batches} batches in its steady window))",
        f"decoding done while the model loads is free: the sample decoded {windows.decoded_in_warmup} images then"
        + (" and ran out of work; the job's count is decode's rate then times that time"
           if windows.decode_exhausted else ""),
        f"the machine's other load stays as it was during the sample (load average {load_before:.1f} before it, "
        f"{load_after:.1f} after, on {os.cpu_count()} cores): on a shared machine it will not, and the run moves with "
        "it",
        *projection.assumptions, *shape.unseen,
    ]
    if result.missing:
        assumptions.append(f"{result.missing} sample images were not described (dead letters): costed like the rest")
    if tiny:
        assumptions.append("the built-in tiny random-weight model: figures for a real model differ")
    if condense:
        assumptions.append(
            f"--condense: the condense worker ran in the sample ({result.condensed} of {len(sample)} documents "
            f"answered, {result.condense_s_per_document * 1000:.0f} ms of its model per document); each document's "
            "answer time is shared out over its images and counted with inference's (its model runs where "
            "inference's does), so a document's cost is taken as proportional to its images; the steady window "
            "ends at the last answer; a short sample hands condense few documents at a time, so its batches run "
            "emptier than a long job's and the cost per document is likely high")
    projection.assumptions = assumptions

    console.print(f"sample run: warm-up {warmup_s:.1f} s from the command's start (less {shape_s:.1f} s reading the "
                  "job's headers and drawing the sample, which `vlmstream run` does not do) until a first image was "
                  f"described (the workers started after {result.workers_at - result.started_at:.1f} s); steady "
                  f"window {steady_wall:.1f} s for "
                  f"{len(steady)} images ({len(steady) / steady_wall if steady_wall else 0:.2f} img/s)")
    if windows.decode_rate_warmup:
        console.print(f"  decoded while the model loaded: {windows.decoded_in_warmup} images at "
                      f"{windows.decode_rate_warmup:.2f} img/s"
                      + (" (then it ran out of sample)" if windows.decode_exhausted else ""))
    console.print(f"  per image: decode {decode_per_image * 1000:.0f} ms ({cost_kinds['decode']} time) of one worker, "
                  f"inference {infer_per_image * 1000:.0f} ms ({cost_kinds['inference']}"
                  + (" of the steady window's wall time, by each request's time in the engine)" if shared_out
                     else " time) of its batch") + "; busy "
                  f"seconds to wall seconds here: x{costs.scale:.2f}")
    console.print(f"  per size class (decode {cost_kinds['decode']} ms / inference {cost_kinds['inference']} ms): "
                  + ", ".join(
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
    if sample_report is not None:
        sample_report.write_text(json.dumps({
            "uri_classes": {im.uri: im.size_class for d in shape.documents for im in d.images},
            "steady_start": windows.steady_start, "scale": costs.scale, "cost_kinds": cost_kinds,
            "images": [dataclasses.asdict(im) for im in result.images]}))
    if as_json:
        sampled = Counter(im.size_class for im in result.images)
        data = projection.as_dict()
        data.update({"sample_documents": len(sample), "sample_images": sample_count,
                     "stages": ["decode", "inference"] + (["condense"] if condense else []),
                     "condense_s_per_document": (round(result.condense_s_per_document, 3) if condense else None),
                     "sample_images_per_document": sorted(len(d.images) for d in sample),
                     "sample_missing": result.missing,
                     "sample_wall_s": round(result.done_at - result.started_at + result.stop_s, 1),
                     "warmup_s": round(warmup_s, 1), "stop_s": round(result.stop_s, 1),
                     "steady_window_s": round(steady_wall, 1), "load_average": [round(load_before, 2),
                                                                                 round(load_after, 2)],
                     "busy_to_wall": round(costs.scale, 3), "cost_kinds": cost_kinds,
                     "costs_by_class": {c: {"sample_images": sampled[c], "job_images": n,
                                            "decode_ms": round(costs.decode_s[c] * 1000, 1),
                                            "infer_ms": round(costs.infer_s[c] * 1000, 1)}
                                        for c, n in sorted(shape.classes().items()) if c in costs.decode_s}})
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
