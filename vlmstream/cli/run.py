"""`vlmstream run` (the whole pipeline on one machine) and `vlmstream bench` (the benchmark scripts).

A run is these steps, in this order: read the source, settle the settings, prepare the broker and topics (and say
what earlier runs left queued), start the workers, publish, follow the progress until every document is in, stop the
workers, summarize."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from vlmstream.cli.run_follow import PROGRESS_EVERY_S, RunFollower, print_summary
from vlmstream.cli.run_setup import (TINY_MODEL_MAX_PIXELS, RunSource, fresh_settings, read_source,
                                     with_allowed_roots, with_model, with_model_family, with_pixel_budget)
from vlmstream.cli.run_workers import METRICS_PORT_OFFSET, Workers, as_stage
from vlmstream.stopping import Stop, exit_status, signal_label

console = Console(stderr=True)
REPO_ROOT = Path(__file__).resolve().parents[1]


def run(
    ctx: typer.Context,
    folder: Optional[Path] = typer.Argument(None, help="Folder of images (a subfolder per document, or one "
                                            "document per file), or a manifest file (JSON lines, JSON, CSV; "
                                            "local images in it may be read). Default: a small built-in sample "
                                            "folder."),
    model: Optional[str] = typer.Option(None, "--model", help="HF id or local folder (default: the built-in "
                                        "tiny random-weight model, whose text is meaningless)."),
    engine: Optional[str] = typer.Option(None, "--engine", help="auto (vLLM on a GPU, else transformers), vllm, "
                                         "transformers."),
    mode: Optional[str] = typer.Option(None, "--mode", help="vLLM input: embeds or pixels."),
    per_file: bool = typer.Option(False, "--per-file", help="Every image file is its own document."),
    decode_workers: Optional[int] = typer.Option(None, "--decode-workers", help="Decode processes (default: one "
                                                 "per core)."),
    max_pixels: Optional[int] = typer.Option(None, "--max-pixels", help="Pixel budget per image (a real model's "
                                             "default: its checkpoint's, 12845056 for Qwen2/2.5-VL; the built-in tiny model's, when neither this nor "
                                             f"decode.max_pixels is set, {TINY_MODEL_MAX_PIXELS}; e.g. 1003520 = "
                                             "1280*28*28)."),
    prompt: Optional[str] = typer.Option(None, "--prompt"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens"),
    force: bool = typer.Option(False, "--force", help="Publish documents again even if already published, and wait "
                               "for new results (without it, documents that have a result are done)."),
    show: int = typer.Option(40, "--show", help="Print at most this many descriptions as they arrive."),
    timeout_s: Optional[float] = typer.Option(None, "--timeout-s", help="Give up after this long."),
    fresh: bool = typer.Option(False, "--fresh", help="Keep this run's work apart: topics and consumer groups of "
                               "its own (the configured names + '.run-<id>'), so records earlier runs left queued on "
                               "the shared topics are neither waited for nor touched (they stay for `vlmstream "
                               "decode`/`infer`). The run's topics stay on the cluster; their names are printed."),
    id_prefix: str = typer.Option("", "--id-prefix", help="Put this before every document id (e.g. 'scans-2024/'). "
                                  "A folder's ids are paths relative to it: give two folders holding the same file "
                                  "names different prefixes, or the later run's results replace the earlier one's on "
                                  "the results topic (compacted by id)."),
    condense: bool = typer.Option(False, "--condense", help="Also run the condense stage (`vlmstream condense`, "
                                  "condense.* settings): one structured answer per document, from its descriptions; "
                                  "the run then waits for every document's answer too."),
) -> None:
    """Run the whole pipeline on this machine: broker, topics, producer, decode workers, inference, results.

    First says what earlier runs left queued ahead of this run's documents, and about how long it takes.

    --fresh keeps the run apart from that backlog (topics and groups of its own).

    Prints a progress line every few seconds, descriptions as they arrive, and a summary at the end.

    SIGTERM or Ctrl-C: the workers drain, flush and commit, for up to 180 s whether or not the cluster answers.
    Each flush, commit and close waits at most kafka.request_timeout_ms; nothing a worker could not flush is committed.
    A second SIGTERM or Ctrl-C stops them at once. The workers stop with `vlmstream run` however it ends (SIGKILL
    too): each drains, for at most 180 s.
    """
    from vlmstream.cli.support import settings_from

    source = read_source(folder, per_file=per_file, id_prefix=id_prefix, decode=settings_from(ctx, {}).decode)
    overrides: dict[str, Any] = {
        "decode": {"max_pixels": max_pixels, "workers": decode_workers},
        "infer": {"model": model, "engine": engine, "mode": mode, "prompt": prompt,
                  "max_new_tokens": max_new_tokens},
    }
    shared, settings = settle_settings(ctx, overrides, source, fresh=fresh)
    backlog, rate_memory = prepare_topics(settings, shared, fresh=fresh)
    stages = ("decode", "infer") + (("condense",) if condense else ())
    log_dir = Path(settings.broker.home).expanduser() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    workers = Workers(settings, stages, log_dir, f"{{stage}}-{time.strftime('%Y%m%d-%H%M%S')}.log")
    # First SIGTERM/Ctrl-C: the workers drain; a second: they are killed at once.
    stop = Stop("vlmstream run", now=workers.kill).install()
    started = time.monotonic()
    follower = None
    finished = False  # every expected result arrived before any signal
    try:
        follower = RunFollower(settings, backlog, condense=condense, force=force, show=show)
        if not stop.is_set():
            start_workers(workers, settings, log_dir)
        publish(settings, source, force, stop, follower)
        if follow_progress(follower, workers, stop, started, timeout_s, lambda items: publish_again(settings, items)):
            follower.settle(started)
            if rate := follower.probe.infer_rate(window_s=float("inf")):
                from vlmstream.cli.backlog import RememberedRate

                rate_memory.save(RememberedRate(rate, settings.decode.max_pixels, settings.infer.model))
            finished = not stop.is_set()
    finally:
        try:
            # The workers first: the live view's clients may wait on a cluster that does not answer.
            codes = workers.stop(stop)
        finally:
            stop.restore()
        if follower is not None:
            follower.close()
    summarize(follower, workers, codes, stop, started, finished=finished, condense=condense)


def settle_settings(ctx: typer.Context, overrides: dict[str, Any], source: RunSource, *, fresh: bool
                    ) -> tuple[Any, Any]:
    """The settings the command's flags, file and environment give (``shared``), and the run's own: the pixel budget,
    --fresh's topics and groups, the source's folders readable by decode, the model and its family."""
    from vlmstream.cli.support import settings_from

    settings, said = with_pixel_budget(settings_from(ctx, overrides))
    console.print(said)
    shared = settings
    if fresh:
        settings = fresh_settings(settings)
    settings = with_model(with_allowed_roots(settings, source.image_roots))
    settings, said = with_model_family(settings)
    console.print(said)
    return shared, settings


def prepare_topics(settings: Any, shared: Any, *, fresh: bool) -> tuple[Any, Any]:
    """The broker (started here if local) and the topics; then what earlier runs left queued ahead of this run's
    documents (with --fresh: on the shared topics, left there). Returns that backlog and the remembered rate."""
    from kafka.errors import KafkaError

    from vlmstream.cli.backlog import RateMemory, measure_backlog
    from vlmstream.cli.support import bootstrap
    from vlmstream.kafka.topics import create_topics

    bootstrap(settings)
    create_topics(settings)
    console.print(f"Kafka: {settings.kafka.bootstrap_servers}; topics: {settings.topics.documents} → "
                  f"{settings.topics.images} → {settings.topics.descriptions} / {settings.topics.results}")
    rate_memory = RateMemory(settings)
    backlog = measure_backlog(settings)
    if fresh:
        try:
            left = f"{measure_backlog(shared).images_ahead} images"
        except KafkaError as exc:
            left = f"whatever is ({type(exc).__name__})"
        console.print(f"--fresh: topics and groups of this run's own ({settings.topics.documents}, ...; groups "
                      f"{settings.decode.group_id}, {settings.infer.group_id}); {left} queued on the shared "
                      "topics are left there")
    elif notice := backlog.notice(rate_memory.load()):
        console.print(f"[bold yellow]{notice}[/]")
        console.print("[yellow]  `vlmstream run --fresh` keeps a run apart from them (they stay queued); "
                      "`vlmstream status` shows every stage's lag[/]")
    else:
        console.print("nothing from earlier runs is queued ahead of yours")
    return backlog, rate_memory


def start_workers(workers: Workers, settings: Any, log_dir: Path) -> None:
    port = settings.metrics_port
    workers.start(port)
    console.print(f"{', '.join(workers.stages)} workers started (logs in {log_dir}; pids "
                  f"{', '.join(f'{stage} {pid}' for stage, pid in workers.pids().items())})")
    if port > 0:
        console.print("Prometheus metrics: " + ", ".join(
            f"{stage} on :{port + METRICS_PORT_OFFSET[stage]}" for stage in workers.stages))


def publish(settings: Any, source: RunSource, force: bool, stop: Stop, follower: RunFollower) -> None:
    """The source's documents onto the documents topic (those already published skipped, unless ``force``); the
    follower waits for those the cluster acknowledged."""
    from producers.publisher import publish_documents

    summary = publish_documents(as_stage(settings, "producer"), source.items, force=force, stop=stop,
                                track_sent=True)
    follower.expect(source.items, summary)
    console.print(f"published {summary.sent} documents ({summary.skipped} already published, "
                  f"{len(summary.rejected)} rejected, {len(summary.failed)} not acknowledged); "
                  f"waiting for {len(follower.expected)} document results")
    for rejection in summary.rejected[:20]:
        console.print(f"  [yellow]rejected[/] {rejection.where()}: {rejection.reason}: {rejection.detail}")
    if summary.replaced_ids:
        example = escape(repr(sorted(summary.replaced_ids)[0]))
        console.print(f"[yellow]{len(summary.replaced_ids)} of these documents were published before under the "
                      f"same ids with other images or metadata (e.g. {example}): their new results will replace "
                      f"the earlier ones on {settings.topics.results}. If those were another folder's with the "
                      f"same file names, give each folder its own prefix (here: --id-prefix "
                      f"{escape(shlex.quote(source.path.stem + '/'))}; running the earlier one again with its own "
                      "prefix brings its results back).[/]")


def publish_again(settings: Any, items: list[Any]) -> Any:
    """Documents whose results came from another model, published again to be described with this run's."""
    from producers.publisher import publish_documents

    return publish_documents(as_stage(settings, "producer"), items, force=True, track_sent=True)


def follow_progress(follower: RunFollower, workers: Workers, stop: Stop, started: float, timeout_s: float | None,
                    publish_again: Any) -> bool:
    """Descriptions as they arrive and a progress line every PROGRESS_EVERY_S, until every expected document is in
    (True) or the run is stopped (False). A worker that exits, or the timeout, ends the run with exit status 1."""
    next_progress = time.monotonic() + PROGRESS_EVERY_S
    while follower.waiting():
        if stop.is_set():
            return False
        if time.monotonic() >= next_progress:
            next_progress = time.monotonic() + PROGRESS_EVERY_S
            follower.show_progress(started)
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            console.print(f"[red]timeout after {timeout_s:.0f}s[/]")
            raise typer.Exit(1)
        if exited := workers.exited():
            console.print(f"[red]{exited[0]} worker exited with {exited[1]}; see {workers.log_dir}[/]")
            raise typer.Exit(1)
        follower.read()
        follower.redo_other_models(publish_again)
    return True


def summarize(follower: RunFollower | None, workers: Workers, codes: dict[str, int | None], stop: Stop,
              started: float, *, finished: bool, condense: bool) -> None:
    """The summary of a finished run (every result in before any signal), what stopped it, and its exit status:
    130 or 143 when a signal stopped it, else 0 when every worker exited cleanly."""
    if finished and follower is not None:
        print_summary(follower.results, time.monotonic() - started, codes, follower.images_described)
        if condense:
            console.print(f"answers (topic {follower.settings.topics.summaries}) or condense dead letters: "
                          f"{len(follower.condensed & follower.expected)} of {len(follower.expected)} documents")
    if stop.signals:
        stopped_by = signal_label(stop.signals[0])
        console.print(f"[yellow]stopped by {stopped_by}{' while its workers stopped' if finished else ''}: workers "
                      f"exited with {', '.join(f'{n} {c}' for n, c in codes.items()) or 'nothing started'}[/]")
        raise typer.Exit(exit_status(stop.signals[0]))
    # A worker stopped by our SIGTERM before it had set up its handlers ends with -SIGTERM: still clean.
    clean = all(code in (0, -signal.SIGTERM) for code in codes.values())
    raise typer.Exit(0 if clean else 1)


BENCHMARKS = {
    "producer": "bench_producer.py",
    "decode": "bench_decode.py",
    "decode-fleet": "bench_decode_fleet.py",
    "infer": "bench_infer_consumer.py",
    "gpu": "gpu/gpu_bench.py",
}


def bench(
    ctx: typer.Context,
    name: str = typer.Argument(..., help=f"One of: {', '.join(BENCHMARKS)}."),
    args: Optional[List[str]] = typer.Argument(None, help="Arguments for the benchmark script (after --)."),
) -> None:
    """Run one of the benchmark scripts in benchmarks/ (they print their figures and ratios)."""
    script = BENCHMARKS.get(name)
    if script is None:
        raise typer.BadParameter(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    path = REPO_ROOT / "benchmarks" / script
    if not path.exists():
        console.print(f"[red]{path} not found: benchmarks run from a source checkout[/]")
        raise typer.Exit(2)
    raise typer.Exit(subprocess.call([sys.executable, str(path), *(args or [])]))
