"""`vlmstream estimate SOURCE`: how long `vlmstream run SOURCE [same options]` will take, from a sample run.

1. The job's shape, without fetching every image: its documents and images per document; each local image's size
   from its file header (Pillow reads no pixels), the size the model takes it at (the family's resize rule and the
   budget), hence its size class. Images it cannot size so cheaply (remote ones) are counted as of unknown size.
   A PDF is its pages, as the producer publishes it: a manifest's PDFs named by URL are fetched to count them, a
   few spread over the job and then the sample's own; the others' pages are assumed (said, and in the range).
2. A sample of whole documents that covers the heavy tail: stratified by images per document (1, 2-3, 4-7, ...) and
   by the documents' size classes, at least one document from each stratum, the rest in proportion to the images.
3. The sample through the real pipeline: `vlmstream run SAMPLE [same options]` on this machine's broker and workers,
   on topics and groups of its own, timed from start to exit.
4. Its descriptions give each image's decode time and inference batch; until the first batch starts is warm-up
   (start-up, model loading), from there to the last description the steady window. ``vlmstream.projection`` fits
   the costs per size class (a batch's fixed part apart from each image's own), calibrates them into wall time
   (inference's batches' wall over cost, decode's steady window) and projects the whole job with its batches as full
   as they will run, and a range from what the sample varied in and the machine's other load.

The job's shape and the sample: ``estimate_job``; the sample run and its costs per image: ``estimate_sample``; the
projection: ``vlmstream.projection``; this module: the command, its steps and its report.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from vlmstream.cli.estimate_job import (JobDocument, JobShape, count_remote_pdfs, draw_sample, job_documents,
                                        read_shape, settle_sample_pdfs)
from vlmstream.cli.estimate_sample import SampleRun, run_sample
from vlmstream.cli.run_setup import with_model_family, with_pixel_budget
from vlmstream.cli.run_workers import as_stage

# Piped into a file or a log, rich would assume 80 columns and wrap every line.
console = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=200)


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
    overrides: dict[str, Any] = {
        "decode": {"max_pixels": max_pixels, "workers": decode_workers},
        "infer": {"model": model, "engine": engine, "mode": mode, "prompt": prompt, "max_new_tokens": max_new_tokens},
    }
    settings, documents, what, tiny = settle_job(ctx, overrides, source, topic, per_file)
    shape, sample, shape_s = shape_and_sample(settings, documents, what, sample_images, seed)
    sampled = measure_sample(sample, settings, timeout_s, shape_s, condense)
    est = project_job(settings, shape, sampled, gpus=gpus, decode_cores=decode_cores)
    est.projection.assumptions = assumptions(est, shape, sample, tiny=tiny, condense=condense)
    print_estimate(est, shape_s)
    if sample_report is not None:
        write_sample_report(sample_report, est, shape)
    if as_json:
        print(json.dumps(json_report(est, shape, sample, condense=condense)))


def settle_job(ctx: typer.Context, overrides: dict[str, Any], source: Path | None, topic: bool, per_file: bool
               ) -> tuple[Any, list[Any], str, bool]:
    """The settings as `vlmstream run` settles them (the pixel budget, the model, the family and pixel limits decode
    resizes for) and the job's documents. Returns the settings, the documents, what they are, and whether the model
    is the built-in tiny one."""
    from vlmstream.cli.support import settings_from

    settings, said = with_pixel_budget(settings_from(ctx, overrides))
    console.print(said)
    documents, what = job_documents(settings, source, topic, per_file)
    if not documents:
        console.print(f"[red]{what} holds no documents to estimate[/]")
        raise typer.Exit(2)
    tiny = not settings.infer.model
    if tiny:
        from consumers.infer.tiny_model import default_tiny_model_dir

        settings = settings.model_copy(update={"infer": settings.infer.model_copy(
            update={"model": str(default_tiny_model_dir())})})
    settings, said = with_model_family(settings)
    console.print(said)
    return settings, documents, what, tiny


def shape_and_sample(settings: Any, documents: list[Any], what: str, sample_images: int | None, seed: int
                     ) -> tuple[JobShape, list[JobDocument], float]:
    """The job's shape from its images' headers and the stratified sample drawn from it (default: 5% of the job's
    images, 16 to 300), both said; returns them and the seconds they took."""
    from consumers.decode.stage import decode_family

    family = decode_family(settings.decode)
    shaping = time.monotonic()
    documents, remote_pdfs = count_remote_pdfs(documents, settings.decode)
    shape = read_shape(documents, family, family.min_pixels, family.max_pixels,
                       pdf_dpi=settings.decode.pdf_dpi, remote_pdfs=remote_pdfs)
    target = sample_images or max(16, min(300, shape.images // 20))
    sample = draw_sample(shape, target, seed)
    settle_sample_pdfs(shape, sample, settings.decode)
    shape_s = time.monotonic() - shaping
    per_doc = shape.per_document()
    assumed_pdfs, assumed_images = shape.assumed_pdfs()
    console.print(f"job: {what}: {len(shape.documents)} documents, {shape.images} images "
                  f"({min(per_doc)}-{max(per_doc)} per document, mean {shape.images / len(shape.documents):.1f})"
                  + (f"; {assumed_images} of them pages of {assumed_pdfs} remote PDF(s) not fetched, their page "
                     "counts assumed" if assumed_pdfs else ""))
    console.print("  size classes (e: pixels the model takes, s: source pixels; bins of 4x from 0.05 MP): " +
                  ", ".join(f"{c} {n}" for c, n in sorted(shape.classes().items())))
    console.print(f"sample: {len(sample)} documents, {sum(len(d.images) for d in sample)} images, from "
                  f"{len({d.stratum for d in sample})} strata (images per document x size class)")
    return shape, sample, shape_s


@dataclass
class MeasuredSample:
    result: SampleRun
    load_before: float  # the machine's load average before the sample run
    load_after: float


def measure_sample(sample: list[JobDocument], settings: Any, timeout_s: float, shape_s: float, condense: bool
                   ) -> MeasuredSample:
    """The sample run on this machine's broker and workers (started here if local), with the load around it."""
    from vlmstream.cli.support import bootstrap

    bootstrap(settings)
    load_before = os.getloadavg()[0]
    result = run_sample(sample, settings, timeout_s, own_s=shape_s, condense=condense)
    load_after = os.getloadavg()[0]
    if len(result.images) < 2:
        console.print(f"[red]the sample run described {len(result.images)} images: nothing to measure[/]")
        raise typer.Exit(1)
    return MeasuredSample(result, load_before, load_after)


@dataclass
class Estimate:
    """The sample's costs, calibrated, and the job projected from them."""
    result: SampleRun  # the sample run, each image's inference cost its engine share where the engine shares out
    load_before: float
    load_after: float
    windows: Any  # projection.sample.SampleWindows
    costs: Any  # projection.costs.ClassCosts
    projection: Any  # projection.job.Projection
    on_cpu: bool
    shared_out: bool
    decode_parallel: int
    cores: int
    infer_threads: int
    spread: float
    batches: int
    extra: float  # warm-up seconds the job's decoding adds on shared cores

    @property
    def cost_kinds(self) -> dict[str, str]:
        return {"decode": "cpu" if all(im.decode_cpu for im in self.result.images) else "wall",
                "inference": "engine share" if self.shared_out else self.costs.infer_cost}

    @property
    def warmup_s(self) -> float:
        return self.result.ready_at - self.result.started_at

    def infer_per_image(self, size_class: str) -> float:
        """Inference's cost for one image of a class in the job: its own part and its share of its batch's fixed
        part, at the images the job's batches hold."""
        return self.costs.infer_s[size_class] + self.costs.per_batch_s / (self.projection.batch_images or 1)

    @property
    def steady(self) -> list[Any]:
        return [im for im in self.result.images if im.done_at > self.windows.steady_start]


def project_job(settings: Any, shape: JobShape, sampled: MeasuredSample, *, gpus: int, decode_cores: int | None
                ) -> Estimate:
    """The per-image costs by size class, calibrated on the sample's steady window, and the job projected from them
    with its range."""
    from vlmstream.projection.costs import calibrate
    from vlmstream.projection.job import Load, contended_warmup, project
    from vlmstream.projection.sample import engine_shares, rate_spread, sample_windows

    result = sampled.result
    decode_parallel = settings.decode.workers or os.cpu_count() or 1
    on_cpu = _inference_on_cpu(settings)
    windows = sample_windows(result.images, steady_start=result.measured_at)
    images, shared_out = engine_shares(result.images, windows)
    result = dataclasses.replace(result, images=images)
    cores = os.cpu_count() or 1
    # torch's CPU threads in the sample's inference worker: infer.cpu_threads as `run` sets it, else OMP_NUM_THREADS
    # (the workers inherit this environment), else one per core.
    infer_threads = (as_stage(settings, "infer").infer.cpu_threads
                     or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or cores)
    # The most a batch holds in the job: the engine's batch size (a synchronous engine takes what is queued, up to
    # it); the sample's batches may have run emptier.
    costs = calibrate(result.images, windows, decode_parallel=decode_parallel, shared_cores=on_cpu, cores=cores,
                      infer_threads=infer_threads, batch_size=as_stage(settings, "infer").infer.batch_size)
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
        decode_busy = windows.decode_ran_out_at - result.workers_at
        extra = contended_warmup(warm_workers, decode_busy, cores=os.cpu_count() or 1,
                                 decode_parallel=decode_parallel,
                                 decode_niceness=as_stage(settings, "decode").decode.niceness) - warm_workers
    # The other load on shared cores: the load average around the sample, less what the sample's own processes
    # (their CPU seconds and the model's loading) added to it.
    own = Load.sample_share(sum(im.decode_s + im.infer_s for im in result.images) + warm_workers,
                            result.done_at - result.workers_at) if on_cpu else 0.0
    projection = project(dict(shape.classes()), len(shape.documents), costs, windows, result.fixed_s, spread=spread,
                         gpus=gpus, decode_cores=decode_cores, warmup_extra_s=extra,
                         load=Load(sampled.load_before, sampled.load_after, cores, own=own),
                         images_range=shape.images_range(), cached_compile_s=result.cold_compile_s or 0.0)
    return Estimate(result, sampled.load_before, sampled.load_after, windows, costs, projection, on_cpu, shared_out,
                    decode_parallel, cores, infer_threads, spread, batches, extra)


def assumptions(est: Estimate, shape: JobShape, sample: list[JobDocument], *, tiny: bool, condense: bool
                ) -> list[str]:
    """What the projection assumes, and what the estimate could not see."""
    result, costs, windows, projection = est.result, est.costs, est.windows, est.projection
    on_cpu, infer_threads, cores, extra = est.on_cpu, est.infer_threads, est.cores, est.extra
    cost_kinds, shared_out = est.cost_kinds, est.shared_out
    out = [
        f"the sample ran as `vlmstream run` does here: {est.decode_parallel} decode process(es), inference on "
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
        f"fixed cost {projection.fixed_s:.1f} s: start-up and model loading until a first image is described "
        f"({est.warmup_s:.1f} s"
        + (f", plus {extra:.1f} s: the sample's decoding ran out while the model loaded, a job's shares the "
           f"{os.cpu_count()} cores with it all along" if extra else "")
        + (f", less {result.cold_compile_s:.1f} s the sample's engine spent compiling the model into vLLM's compile "
           "cache, which a run on this machine loads instead: on a machine without that cache the run takes as much "
           "longer, the range's top holds it" if result.cold_compile_s else "")
        + f"), stopping the workers ({result.stop_s:.1f} s); the same for the whole job",
        "the range, from what the sample varied in: the steady part at a rate faster or slower by "
        f"{projection.range_parts['steady_rate']:.0%} (the larger of the spread between the sample's two halves and "
        f"1/sqrt({est.batches} batches in its steady window)), with twice the sampling error of the job's costs "
        f"({projection.range_parts['sampled_costs']:.0%}: the standard error of each size class's mean cost) and "
        f"the machine's wander ({projection.range_parts['machine_wander']:.0%}: how differently it stretched "
        "inference's batches one to the next, on the fixed part too)"
        + (", then the other load's move (below)" if "load_up" in projection.range_parts else ""),
        f"decoding done while the model loads is free: the sample decoded {windows.decoded_in_warmup} images then"
        + (" and ran out of work; the job's count is decode's rate then times that time"
           if windows.decode_exhausted else ""),
        *([] if on_cpu else [  # on shared cores the projection states the load it assumes, and its effect
            f"the machine's other load stays as it was during the sample (load average {est.load_before:.1f} before "
            f"it, {est.load_after:.1f} after, on {os.cpu_count()} cores)"]),
        *projection.assumptions, *shape.unseen,
        *([said] if (said := shape.pdfs_said()) else []),
    ]
    if result.missing:
        out.append(f"{result.missing} sample images were not described (dead letters): costed like the rest")
    if tiny:
        out.append("the built-in tiny random-weight model: figures for a real model differ")
    if condense:
        out.append(
            f"--condense: the condense worker ran in the sample ({result.condensed} of {len(sample)} documents "
            f"answered, {result.condense_s_per_document * 1000:.0f} ms of its model per document); each document's "
            "answer time is shared out over its images and counted with inference's (its model runs where "
            "inference's does), so a document's cost is taken as proportional to its images; the steady window "
            "ends at the last answer; a short sample hands condense few documents at a time, so its batches run "
            "emptier than a long job's and the cost per document is likely high")
    return out


def print_estimate(est: Estimate, shape_s: float) -> None:
    """The sample run, the costs per size class, the prediction with its range, and its assumptions."""
    result, costs, windows, projection = est.result, est.costs, est.windows, est.projection
    cost_kinds, shared_out, steady, steady_wall = est.cost_kinds, est.shared_out, est.steady, windows.steady_s
    decode_per_image = statistics.fmean(im.decode_s for im in result.images)
    # An engine's shares are costs only inside the steady window (the first wave's waited through the start).
    infer_per_image = statistics.fmean(im.infer_s for im in (steady if shared_out and steady else result.images))
    console.print(f"sample run: warm-up {est.warmup_s:.1f} s from the command's start (less {shape_s:.1f} s reading "
                  "the job's headers and drawing the sample, which `vlmstream run` does not do) until a first image was "
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
                  f"seconds to wall seconds here: x{costs.scale:.2f} over the steady window"
                  + (f", x{costs.stretch:.2f} over inference's batches (their wall time over their CPU time)"
                     if costs.stretch is not None else ""))
    console.print(f"  per size class (decode {cost_kinds['decode']} ms / inference {cost_kinds['inference']} ms, "
                  "its batch's fixed part shared as the job's batches will hold them): "
                  + ", ".join(
        f"{c} {costs.decode_s[c] * 1000:.0f}/{est.infer_per_image(c) * 1000:.0f}" for c in sorted(costs.decode_s)))
    if projection.decode_cores_per_gpu is not None:
        console.print(f"  decode cores per inference process to keep it busy: {projection.decode_cores_per_gpu:.2f} "
                      "(decode s per image / inference s per image)")
    console.print(f"[bold]predicted: {_dur(projection.predicted_s)} ({_dur(projection.low_s)} - "
                  f"{_dur(projection.high_s)}) for {projection.images} images in {projection.documents} documents; "
                  f"bottleneck {projection.bottleneck} ({projection.bottleneck_share:.0%} of the busy time)[/]")
    for line in projection.scaled:
        console.print(f"  scaled: {line}")
    console.print("assumptions and what the estimate could not see:")
    for line in projection.assumptions:
        console.print(f"  - {line}")


def write_sample_report(path: Path, est: Estimate, shape: JobShape) -> None:
    """What the sample measured: each job image's size class, and each sample image's costs and times."""
    path.write_text(json.dumps({
        "uri_classes": {im.uri: im.size_class for d in shape.documents for im in d.images},
        "steady_start": est.windows.steady_start, "scale": est.costs.scale, "cost_kinds": est.cost_kinds,
        "images": [dataclasses.asdict(im) for im in est.result.images]}))


def json_report(est: Estimate, shape: JobShape, sample: list[JobDocument], *, condense: bool) -> dict[str, Any]:
    """The estimate as one JSON object: the projection's figures and the sample's."""
    result, costs = est.result, est.costs
    sampled = Counter(im.size_class for im in result.images)
    data = est.projection.as_dict()
    assumed_pdfs, assumed_images = shape.assumed_pdfs()
    data.update({"sample_documents": len(sample), "sample_images": sum(len(d.images) for d in sample),
                 "remote_pdfs_counted": len(shape.remote_pdfs.pages) if shape.remote_pdfs is not None else 0,
                 "remote_pdfs_assumed": assumed_pdfs, "images_assumed": assumed_images,
                 "images_range": shape.images_range(),
                 "stages": ["decode", "inference"] + (["condense"] if condense else []),
                 "condense_s_per_document": (round(result.condense_s_per_document, 3) if condense else None),
                 "sample_images_per_document": sorted(len(d.images) for d in sample),
                 "sample_missing": result.missing,
                 "sample_wall_s": round(result.done_at - result.started_at + result.stop_s, 1),
                 "warmup_s": round(est.warmup_s, 1), "stop_s": round(result.stop_s, 1),
                 "cold_compile_s": result.cold_compile_s,
                 "steady_window_s": round(est.windows.steady_s, 1),
                 "load_average": [round(est.load_before, 2), round(est.load_after, 2)],
                 "busy_to_wall": round(costs.scale, 3), "cost_kinds": est.cost_kinds,
                 "batch_wall_over_cost": round(costs.stretch, 3) if costs.stretch is not None else None,
                 "costs_by_class": {c: {"sample_images": sampled[c], "job_images": n,
                                        "decode_ms": round(costs.decode_s[c] * 1000, 1),
                                        "infer_ms": round(est.infer_per_image(c) * 1000, 1)}
                                    for c, n in sorted(shape.classes().items()) if c in costs.decode_s}})
    return data


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
