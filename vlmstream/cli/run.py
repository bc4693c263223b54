"""`vlmstream run` (the whole pipeline on one machine) and `vlmstream bench` (the benchmark scripts)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console
from rich.table import Table

from vlmstream.config import is_settings_variable
from vlmstream.models import qwen2_vl

console = Console(stderr=True)
REPO_ROOT = Path(__file__).resolve().parents[1]
# The built-in tiny model's text is meaningless at any size, and its CPU time grows with the pixels: at the
# checkpoint's 12.8 MP a folder of large photos takes minutes on two cores, at 0.4 MP about half a minute
# (benchmarks/first_run.py; figures per budget in benchmarks/RESULTS.md). 0.4 MP leaves room for a busier machine;
# --max-pixels or decode.max_pixels change it.
TINY_MODEL_MAX_PIXELS = 512 * qwen2_vl.FACTOR**2  # 401,408
PROGRESS_EVERY_S = 5.0
# The longest the last progress line waits for the workers' last commits (inference commits at most once a second).
COMMITS_SETTLE_S = 3.0


def _settings_file(settings: Any) -> Path:
    """The effective settings for child processes, secrets included, readable by this user only."""
    data = settings.model_dump(mode="python")

    def reveal(node: Any) -> Any:
        if hasattr(node, "get_secret_value"):
            return node.get_secret_value()
        if isinstance(node, dict):
            return {k: reveal(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [reveal(v) for v in node]
        if isinstance(node, Path):
            return str(node)
        return node

    fd, name = tempfile.mkstemp(prefix="vlmstream-run-", suffix=".json")
    with os.fdopen(fd, "w") as handle:
        json.dump(reveal(data), handle)
    os.chmod(name, 0o600)
    return Path(name)


# `run` and `estimate` start decode beside the inference consumer on one machine's cores: decode yields them (it
# only needs to stay ahead of inference, while inference's CPU work is what keeps the model busy), and an engine on
# the CPU runs one torch thread (its threads wait for each other at every operation, and lose whenever decode takes
# one's core; measured in benchmarks/RESULTS.md).
LOCAL_DECODE_NICENESS = 10
LOCAL_INFER_CPU_THREADS = 1


def _as_stage(settings: Any, stage: str) -> Any:
    """The settings a stage gets when `run` (or `estimate`) starts it on this machine: its own login, and the
    defaults for stages that share the machine's cores."""
    return _sharing_cores(settings.model_copy(update={"kafka": settings.kafka.as_principal(stage)}), stage)


def _sharing_cores(settings: Any, stage: str) -> Any:
    """Decode started beside inference runs at LOCAL_DECODE_NICENESS unless decode.niceness was set, and an
    inference engine on the CPU with LOCAL_INFER_CPU_THREADS unless infer.cpu_threads or OMP_NUM_THREADS says
    otherwise."""
    if stage == "decode" and "niceness" not in settings.decode.model_fields_set:
        return settings.model_copy(update={"decode": settings.decode.model_copy(
            update={"niceness": LOCAL_DECODE_NICENESS})})
    if (stage == "infer" and "cpu_threads" not in settings.infer.model_fields_set
            and not os.environ.get("OMP_NUM_THREADS")):
        return settings.model_copy(update={"infer": settings.infer.model_copy(
            update={"cpu_threads": LOCAL_INFER_CPU_THREADS})})
    return settings


# With metrics_port set, each worker process of a run serves its own endpoint: decode on the port, inference on the
# next one, condense on the one after (all on one machine, so one port each).
METRICS_PORT_OFFSET = {"decode": 0, "infer": 1, "condense": 2}


def _child(args: list[str], config: Path, log_path: Path, metrics_port: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vlmstream.cli", "--config", str(config), *args]
    # The settings file holds the run's effective settings (the environment's included); an exported settings
    # variable would outrank it in the child and send it elsewhere (--fresh's own topics and groups to the shared
    # ones), so the child gets none of them.
    env = {key: value for key, value in os.environ.items() if not is_settings_variable(key)}
    if metrics_port > 0:
        env["VLMSTREAM_METRICS_PORT"] = str(metrics_port + METRICS_PORT_OFFSET[args[0]])
    log = open(log_path, "ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env)


# How long `vlmstream run` waits for its workers to drain once stopped, whether or not the cluster answers: the
# decode fleet's drain_timeout_s (120 s, its workers' flush/commit/close each bounded by kafka.request_timeout_ms)
# and the inference process's (the engine finishes what it holds, then flush, commit and closes, each bounded the
# same way) fit in it with the defaults. What outlives it is killed: nothing it had not flushed was committed.
STOP_GRACE_S = 180.0


class _Stopped(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that the run's ``finally`` stops the workers."""


def _raise_stopped(signum: int, _frame: Any) -> None:
    raise _Stopped(signum)


def _stop_children(children: dict[str, subprocess.Popen], grace_s: float = STOP_GRACE_S,
                   stopped_by: str | None = None) -> tuple[dict[str, int | None], str | None]:
    """SIGTERM (drain, commit, leave the group), then SIGKILL whatever outlives the grace period, or everything at
    once on a second SIGTERM/Ctrl-C. ``stopped_by`` names the signal that stopped the run, if one did: a first
    signal that arrives while a finished run stops its workers is that run's first, and lets them drain. Returns
    the workers' exit codes and the signal that stopped the run, if any."""
    deadline = time.monotonic() + grace_s
    signalled = False
    while True:
        try:
            if not signalled:
                # Held while the workers are signalled: a signal raised between two of them would leave the rest
                # unsignalled (and, raised out of here, the run would not wait for any). Delivered on release, inside
                # this try.
                with _signals_held():
                    # Only the worker's main process: it drains and stops its own children (a vLLM EngineCore
                    # signalled directly would abort the requests in flight instead of finishing them).
                    for proc in children.values():
                        if proc.poll() is None:
                            proc.send_signal(signal.SIGTERM)
                    signalled = True
                    if any(proc.poll() is None for proc in children.values()):
                        console.print(f"stopping: the workers flush and commit (up to {grace_s:.0f} s, also when "
                                      "the cluster does not answer); Ctrl-C again to stop them at once")
            for proc in children.values():
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _kill(proc)
            break
        except KeyboardInterrupt as exc:
            if stopped_by is None:  # the first signal: the drain goes on
                stopped_by = _signal_name(exc)
                continue
            for proc in children.values():  # a second signal: at once (their next owners redo the uncommitted)
                _kill(proc)
            break
    return {name: proc.returncode for name, proc in children.items()}, stopped_by


@contextlib.contextmanager
def _signals_held():
    """SIGTERM and SIGINT wait (the kernel keeps them pending) until the block ends."""
    held = {signal.SIGTERM, signal.SIGINT}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _signal_name(exc: KeyboardInterrupt) -> str:
    return "SIGTERM" if isinstance(exc, _Stopped) else "Ctrl-C"


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the decode workers and any engine process too
        except ProcessLookupError:
            pass
        proc.wait()


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
    A second SIGTERM or Ctrl-C stops them at once.
    """
    from kafka.errors import KafkaError
    from rich.markup import escape

    from producers.folder import IMAGE_EXTENSIONS, scan_folder, skipped_files_line
    from producers.items import with_id_prefix, with_pdf_pages
    from producers.publisher import publish_documents
    from schemas import DeadLetter, Description, DocumentRef, DocumentResult, DocumentSummary, SchemaError
    from vlmstream.cli.backlog import LiveView, RateMemory, RememberedRate, StageProbe, measure_backlog
    from vlmstream.cli.support import bootstrap, settings_from
    from vlmstream.kafka.clients import make_consumer
    from vlmstream.kafka.group import topic_partitions
    from vlmstream.kafka.records import poll_past_unreadable
    from vlmstream.kafka.topics import create_topics

    if folder is None:
        from vlmstream.cli.samples import sample_folder

        folder = sample_folder()
        console.print(f"[dim]no folder given: using the built-in sample images in {folder}[/]")
    folder = folder.resolve()
    if folder.is_file():  # a manifest: its documents as they are
        from producers.manifest import read_manifest

        items = list(with_pdf_pages(read_manifest(folder), settings_from(ctx, {}).decode.max_pdf_pages))
        image_roots = _manifest_roots(items)
        if not any(isinstance(item, DocumentRef) for item in items):
            raise typer.BadParameter(f"{folder} holds no valid document (see the rejections: vlmstream produce "
                                     f"--manifest {folder} lists them)")
    elif not folder.is_dir():
        raise typer.BadParameter(f"{folder} is not a folder or a manifest file")
    else:
        # Read before anything starts: an empty or mistyped folder needs no broker, model or workers to say so.
        skipped: list[Path] = []
        items = list(scan_folder(folder, per_file=per_file, skipped=skipped,
                                 max_pdf_pages=settings_from(ctx, {}).decode.max_pdf_pages))
        image_roots = [str(folder)]
        if skipped:
            console.print(f"[yellow]{escape(skipped_files_line(skipped, folder))}[/]")
    items = list(with_id_prefix(items, id_prefix))
    if not items:
        extensions = " ".join(sorted(IMAGE_EXTENSIONS))
        raise typer.BadParameter(f"{folder} holds no image files (looked for {extensions}, in it and its "
                                 "subfolders; hidden ones are skipped)")
    overrides: dict[str, Any] = {
        "decode": {"max_pixels": max_pixels, "workers": decode_workers},
        "infer": {"model": model, "engine": engine, "mode": mode, "prompt": prompt,
                  "max_new_tokens": max_new_tokens},
    }
    settings = settings_from(ctx, overrides)
    settings, said = with_pixel_budget(settings)
    console.print(said)
    shared = settings
    if fresh:
        settings = _fresh_settings(settings)
    roots = list(settings.decode.allowed_roots)
    roots += [root for root in image_roots if root not in roots]
    settings = settings.model_copy(update={"decode": settings.decode.model_copy(update={"allowed_roots": roots})})
    if not settings.infer.model:
        from consumers.infer.tiny_model import default_tiny_model_dir

        tiny = default_tiny_model_dir()
        settings = settings.model_copy(update={"infer": settings.infer.model_copy(update={"model": str(tiny)})})
        console.print(f"[yellow]no --model: using the built-in tiny random-weight Qwen2.5-VL ({tiny}); "
                      "its descriptions are meaningless text. Pass --model for real ones.[/]")
    settings, said = with_model_family(settings)
    console.print(said)
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

    # Each stage's process gets a settings file with its own login only (kafka.principals; none: run's own login).
    stages = ("decode", "infer") + (("condense",) if condense else ())
    config_files = {stage: _settings_file(_as_stage(settings, stage)) for stage in stages}
    log_dir = Path(settings.broker.home).expanduser() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    children: dict[str, subprocess.Popen] = {}
    results: dict[str, DocumentResult] = {}
    condensed: set[str] = set()  # documents with an answer (a summary) or a condense dead letter
    started = time.monotonic()
    probe = None
    previous_handler = signal.signal(signal.SIGTERM, _raise_stopped)
    stopped_by: str | None = None
    finished = False  # every expected result arrived
    try:
        # Position the live view before anything is published, so no description is missed.
        watcher = make_consumer(_as_stage(settings, "tap"), None)  # reads the outputs only
        # The topics were created a moment ago: a watcher assigned before they list partitions would see nothing.
        watched = [settings.topics.descriptions, settings.topics.results, settings.topics.deadletter]
        tps = topic_partitions(watcher, watched + ([settings.topics.summaries] if condense else []))
        watcher.assign(tps)
        # Results from the beginning: documents that already have one are done (a rerun resumes). With --force
        # every document is described again, so only results published from now on count.
        from_now = [tp for tp in tps if tp.topic not in (settings.topics.results, settings.topics.summaries) or force]
        for tp, end in watcher.end_offsets(from_now).items():
            watcher.seek(tp, end)
        if earlier := [tp for tp in tps if tp not in from_now]:  # (no argument would mean every partition)
            watcher.seek_to_beginning(*earlier)
        # Where the results (and answers) published before this run end: once the watcher is past them, a document
        # whose only results came from another model is known to need describing again.
        earlier_results = FoldedResults(watcher.end_offsets(earlier) if earlier else {}, settings.infer.model)

        probe = StageProbe(settings, backlog)
        view = LiveView(probe)
        view.update()  # where the topics and groups stand before anything of this run is published
        port = settings.metrics_port
        for stage in stages:
            children[stage] = _child([stage], config_files[stage], log_dir / f"{stage}-{stamp}.log", port)
        console.print(f"{', '.join(stages)} workers started (logs in {log_dir})")
        if port > 0:
            console.print("Prometheus metrics: " + ", ".join(
                f"{stage} on :{port + METRICS_PORT_OFFSET[stage]}" for stage in stages))

        summary = publish_documents(_as_stage(settings, "producer"), items, force=force, track_sent=True)
        earlier_results.sent_now(summary.sent_ids)
        failed_ids = {failure.doc_id for failure in summary.failed}
        expected = {item.doc_id for item in items if isinstance(item, DocumentRef)} - failed_ids
        images_expected = sum(len(item.image_uris) for item in items
                              if isinstance(item, DocumentRef) and item.doc_id in expected)
        console.print(f"published {summary.sent} documents ({summary.skipped} already published, "
                      f"{len(summary.rejected)} rejected, {len(summary.failed)} not acknowledged); "
                      f"waiting for {len(expected)} document results")
        for rejection in summary.rejected[:20]:
            console.print(f"  [yellow]rejected[/] {rejection.where()}: {rejection.reason}: {rejection.detail}")
        if summary.replaced_ids:
            example = escape(repr(sorted(summary.replaced_ids)[0]))
            console.print(f"[yellow]{len(summary.replaced_ids)} of these documents were published before under the "
                          f"same ids with other images or metadata (e.g. {example}): their new results will replace "
                          f"the earlier ones on {settings.topics.results}. If those were another folder's with the "
                          f"same file names, give each folder its own prefix (here: --id-prefix "
                          f"{escape(shlex.quote(folder.stem + '/'))}; running the earlier one again with its own "
                          "prefix brings its results back).[/]")
        shown = 0
        images_described = 0
        dead_letters = 0
        earlier_dead_letters = 0  # of documents this run did not publish: earlier work its workers took first
        next_progress = time.monotonic() + PROGRESS_EVERY_S

        def show_progress() -> None:
            console.print(_progress_line(view, started, len(expected & results.keys()), len(expected),
                                         images_described, images_expected, dead_letters, earlier_dead_letters),
                          markup=False, highlight=False)

        def condensing() -> set[str]:  # documents whose answer is still to come (none without a description)
            return {d for d, r in results.items() if r.succeeded} - condensed if condense else set()

        while expected - results.keys() or condensing():
            if time.monotonic() >= next_progress:
                next_progress = time.monotonic() + PROGRESS_EVERY_S
                show_progress()
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                console.print(f"[red]timeout after {timeout_s:.0f}s[/]")
                raise typer.Exit(1)
            for name, proc in children.items():
                if proc.poll() is not None:
                    console.print(f"[red]{name} worker exited with {proc.returncode}; see {log_dir}[/]")
                    raise typer.Exit(1)
            for tp, records in poll_past_unreadable(watcher, timeout_ms=500).items():
                for record in records:
                    try:
                        if tp.topic == settings.topics.results:
                            result = DocumentResult.decode(record.value)
                            if result.doc_id in expected and earlier_results.counts(result, results, tp,
                                                                                    record.offset):
                                results[result.doc_id] = result
                            continue
                        if tp.topic == settings.topics.summaries:
                            summary = DocumentSummary.decode(record.value)
                            if summary.doc_id in expected and earlier_results.current(summary.doc_id, tp,
                                                                                      record.offset):
                                condensed.add(summary.doc_id)
                                console.print(f"[bold]{escape(summary.doc_id)}[/] answer: "
                                              f"{escape(json.dumps(summary.answer)[:200])}", highlight=False)
                            continue
                        if tp.topic == settings.topics.deadletter:
                            letter = DeadLetter.decode(record.value)
                            if letter.stage == "condense" and letter.doc_id is not None:
                                condensed.add(letter.doc_id)
                            dead_letters += letter.doc_id in expected
                            earlier_dead_letters += letter.doc_id not in expected
                            continue
                        description = Description.decode(record.value)
                    except SchemaError as exc:
                        console.print(f"[red]unreadable record on {tp.topic}: {exc}[/]")
                        continue
                    if description.doc_id not in expected:
                        continue
                    images_described += 1
                    if shown < show:
                        shown += 1
                        text = description.text.replace("\n", " ")
                        console.print(f"[bold]{description.doc_id}[/][{description.image_index}] {text[:160]}")
                    elif shown == show:
                        shown += 1
                        console.print("[dim](further descriptions not shown; --show to change)[/]")
            if redo := earlier_results.to_redo(watcher):
                console.print(f"{len(redo)} documents have results only from another model "
                              f"({', '.join(sorted(set(redo.values()))[:3])}), not from {settings.infer.model}: "
                              "publishing them again to describe them with it (--force does so for every document)")
                again = publish_documents(_as_stage(settings, "producer"),
                                          [item for item in items if getattr(item, "doc_id", None) in redo],
                                          force=True, track_sent=True)
                earlier_results.sent_now(again.sent_ids)
                condensed.difference_update(redo)  # their earlier answers were of the other model's results
                if again.failed:
                    lost = {failure.doc_id for failure in again.failed}
                    expected -= lost
                    console.print(f"[red]{len(lost)} of them were not acknowledged by the cluster; not waited for[/]")
        # The live view once more, at the end: a run shorter than PROGRESS_EVERY_S would otherwise show none, and a
        # longer one would end on a line up to that old.
        _await_commits(view, COMMITS_SETTLE_S)
        show_progress()
        watcher.close()
        rate = probe.infer_rate(window_s=float("inf"))
        if rate:
            rate_memory.save(RememberedRate(rate, settings.decode.max_pixels, settings.infer.model))
        finished = True
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (_Stopped)
        stopped_by = _signal_name(exc)
    finally:
        try:
            # The workers first: the live view's clients may wait on a cluster that does not answer.
            codes, stopped_by = _stop_children(children, stopped_by=stopped_by) if children else ({}, stopped_by)
        finally:
            signal.signal(signal.SIGTERM, previous_handler)
            for config_file in config_files.values():
                config_file.unlink(missing_ok=True)
        if probe is not None:
            try:
                probe.close()
            except Exception as exc:  # noqa: BLE001 - the live view only; the workers have stopped
                console.print(f"[yellow]closing the live view failed: {exc!r}[/]")
    if finished:  # every result was in before any signal: the run's summary stands
        _print_summary(results, time.monotonic() - started, codes, images_described)
        if condense:
            console.print(f"answers (topic {settings.topics.summaries}) or condense dead letters: "
                          f"{len(condensed & expected)} of {len(expected)} documents")
    if stopped_by is not None:
        console.print(f"[yellow]stopped by {stopped_by}{' while its workers stopped' if finished else ''}: workers "
                      f"exited with {', '.join(f'{n} {c}' for n, c in codes.items()) or 'nothing started'}[/]")
        raise typer.Exit(130 if stopped_by == "Ctrl-C" else 143)
    # A worker stopped by our SIGTERM before it had set up its handlers ends with -SIGTERM: still clean.
    clean = all(code in (0, -signal.SIGTERM) for code in codes.values())
    raise typer.Exit(0 if clean else 1)


def same_model(a: str | None, b: str | None) -> bool:
    """One model named twice: the same name, or two paths to one folder."""
    if a == b:
        return True
    if not a or not b:
        return False
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()


class FoldedResults:
    """The results published before a run, read back by it (``ends``: the end offsets, when the run began, of the
    results and answers partitions it reads from their start). A document that has one counts as done (a rerun
    resumes), unless the run sent the document itself (new, changed, or described again: only a result or answer
    published since counts), or every image its results describe was described by another model than the run's.
    Those are published again once the watcher has read past every earlier record, so that a later result of the
    run's own model, further down the topic, still counts instead."""

    def __init__(self, ends: dict[Any, int], model: str | None):
        self.ends = ends
        self.model = model
        self.elsewhere: dict[str, str] = {}  # document -> the other model its results came from
        self.redone: set[str] = set()
        self.sent: set[str] = set()  # documents this run published

    def sent_now(self, doc_ids: set[str] | None) -> None:
        self.sent |= doc_ids or set()

    def current(self, doc_id: str, tp: Any, offset: int) -> bool:
        """Whether a record of the document, read at ``offset`` of ``tp``, can be of what this run sent: not one
        published before the run sent the document."""
        return doc_id not in self.sent or offset >= self.ends.get(tp, 0)

    def counts(self, result: Any, results: dict[str, Any], tp: Any, offset: int) -> bool:
        """Whether ``result``, read at ``offset`` of ``tp``, makes its document done for this run."""
        if not self.current(result.doc_id, tp, offset):
            return False  # a result of what the document was before this run sent it
        models = {image.get("model") for image in result.images if image.get("status") == "ok"} - {None}
        if not models or any(same_model(m, self.model) for m in models):
            self.elsewhere.pop(result.doc_id, None)
            return True
        if result.doc_id not in results and result.doc_id not in self.redone:
            self.elsewhere[result.doc_id] = sorted(models)[0]
        return False

    def to_redo(self, watcher: Any) -> dict[str, str]:
        """The documents to publish again (and the model their results came from), once every earlier result has
        been read; each document once."""
        if not self.elsewhere or any(watcher.position(tp) < end for tp, end in self.ends.items()):
            return {}
        redo, self.elsewhere = self.elsewhere, {}
        self.redone |= redo.keys()
        return redo


def _manifest_roots(items: list[Any]) -> list[str]:
    """The folders a manifest's local images lie in: `vlmstream run MANIFEST` lets its decode workers read there."""
    from schemas import DocumentRef

    roots: set[str] = set()
    for item in items:
        if isinstance(item, DocumentRef):
            for uri in item.image_uris:
                path = uri.removeprefix("file://").split("#", 1)[0]
                if "://" not in path:
                    roots.add(str(Path(path).resolve().parent))
    return sorted(roots)


def with_model_family(settings: Any) -> tuple[Any, str]:
    """Decode resizes for the model that infers: a local checkpoint folder (infer.model) becomes decode.model unless
    that is set, so its config.json picks the family and its image processor settings bound the pixels. Fails here,
    before anything starts, when no family describes the checkpoint. Returns the settings and the line saying which."""
    from consumers.decode.stage import decode_family

    model = settings.infer.model
    if not settings.decode.model and model and (Path(model) / "config.json").is_file():
        settings = settings.model_copy(update={"decode": settings.decode.model_copy(update={"model": model})})
    family = decode_family(settings.decode)
    source = f"from {settings.decode.model}" if settings.decode.model else "decode.model_family"
    if not family.exact_size:
        # The generic path has no tower of ours to make image_embeds: vLLM runs the model's own (pixels mode).
        if settings.infer.mode == "embeds" and "mode" not in settings.infer.model_fields_set:
            settings = settings.model_copy(update={"infer": settings.infer.model_copy(update={"mode": "pixels"})})
        return settings, (f"model family: generic ({source}): the model's own processor; images decoded, oriented "
                          f"and capped at what it keeps (at most {family.max_pixels:,} px); infer.mode=pixels, "
                          "no embeddings")
    return settings, (f"model family: {family.name} ({source}): {family.factor} px blocks, "
                      f"{family.min_pixels:,} to {family.max_pixels:,} px per image")


def with_pixel_budget(settings: Any) -> tuple[Any, str]:
    """The built-in tiny model (no infer.model) gets TINY_MODEL_MAX_PIXELS unless decode.max_pixels was given (flag,
    file or environment); a real model keeps the configured budget. Returns the settings and the line saying which."""
    if not settings.infer.model and "max_pixels" not in settings.decode.model_fields_set:
        settings = settings.model_copy(update={"decode": settings.decode.model_copy(
            update={"max_pixels": TINY_MODEL_MAX_PIXELS})})
        return settings, (f"pixel budget: {TINY_MODEL_MAX_PIXELS:,} px per image ({TINY_MODEL_MAX_PIXELS / 1e6:.1f} MP, "
                          "the built-in tiny model's CPU default: about a minute for 25 large photos on 2 cores); "
                          "--max-pixels N or decode.max_pixels changes it")
    return settings, (f"pixel budget: {settings.decode.max_pixels:,} px per image "
                      f"({settings.decode.max_pixels / 1e6:.1f} MP; --max-pixels N or decode.max_pixels changes it)")


def _fresh_settings(settings: Any) -> Any:
    """Topics and consumer groups of this run's own: the configured names + '.run-<time>-<random>'."""
    import uuid

    suffix = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    t = settings.topics
    names = {name: f"{getattr(t, name)}.{suffix}"
             for name in ("documents", "images", "descriptions", "embeddings", "results", "summaries", "deadletter")}
    return settings.model_copy(update={
        "topics": t.model_copy(update=names),
        "decode": settings.decode.model_copy(update={"group_id": f"{settings.decode.group_id}.{suffix}"}),
        "infer": settings.infer.model_copy(update={"group_id": f"{settings.infer.group_id}.{suffix}"}),
        "condense": settings.condense.model_copy(update={"group_id": f"{settings.condense.group_id}.{suffix}"}),
    })


def _await_commits(view: Any, within_s: float) -> None:
    """Wait (at most ``within_s``) until the stages' groups have committed past every record on their input topics.
    The stage lines count committed offsets, and a worker commits what it finished at intervals (inference at most
    once a second): read the moment the last description arrives, they would show images as still waiting that
    were described."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            snap = view.update()
        except Exception:  # noqa: BLE001 - the progress line says the stages are not readable
            return
        if (snap.images_waiting == 0 and snap.documents_waiting == 0) or time.monotonic() >= deadline:
            return
        time.sleep(0.25)


def _progress_line(view: Any, started: float, docs_done: int, docs: int, described: int, images: int,
                   dead_letters: int, earlier_dead_letters: int = 0) -> str:
    """Where the run stands: its own documents and images and what each stage's group is doing, then a line per
    stage (images done / total, rate over a sliding window, ETA range, drift) and the stage that limits the run."""
    elapsed = time.monotonic() - started
    try:
        snap = view.update()
    except Exception as exc:  # noqa: BLE001 - a progress line must never stop the run
        return f"[{elapsed:4.0f}s] documents {docs_done}/{docs}, images described {described}/{images}; " \
               f"stages not readable now ({type(exc).__name__})"
    probe = view.probe
    rate = probe.infer_rate()
    first = probe.first
    decoded = snap.images_published - first.images_published
    if snap.infer_members == 0:
        inference = "inference starting (loading the model)"
    elif rate is None:
        inference = f"inference: {snap.images_waiting} images waiting, first ones in work"
    else:
        inference = f"inference: {snap.images_waiting} images waiting, {rate:.2f} img/s"
    line = (f"[{elapsed:4.0f}s] documents {docs_done}/{docs}, images described {described}/{images}, "
            f"dead letters {dead_letters} | decode: {snap.documents_waiting} documents waiting, {decoded} images "
            f"out since start | {inference}")
    backlog = probe.backlog
    if backlog is not None and backlog.images_ahead:
        # Of the earlier work measured at the start: images still below the start's end offsets, plus the images of
        # earlier documents not decoded yet (in proportion, about).
        per_doc = backlog.document_images / backlog.documents if backlog.documents else 0.0
        ahead = snap.earlier_ahead + round(snap.earlier_documents * per_doc)
        if ahead:
            eta = f", about {ahead / rate:.0f} s" if rate else ""
            line += f" | earlier runs' work still ahead: about {ahead} images{eta}"
    if earlier_dead_letters:
        line += f" | dead letters of earlier runs' documents: {earlier_dead_letters} (`vlmstream redrive` retries them)"
    return "\n".join([line, *(f"  {stage_line}" for stage_line in view.lines())])


def _print_summary(results: dict[str, Any], elapsed: float, codes: dict[str, int | None],
                   described_now: int) -> None:
    images = sum(r.image_count for r in results.values())
    ok = sum(r.succeeded for r in results.values())
    failed = sum(r.failed for r in results.values())
    kinds: dict[str, int] = {}
    for result in results.values():
        for image in result.images:
            if image.get("status") == "failed":
                key = f"{image.get('stage')}:{image.get('error_kind')}"
                kinds[key] = kinds.get(key, 0) + 1
    table = Table(title="vlmstream run")
    table.add_column("documents", justify="right")
    table.add_column("images", justify="right")
    table.add_column("described", justify="right")
    table.add_column("failed", justify="right")
    table.add_column("seconds", justify="right")
    table.add_column("described this run", justify="right")
    table.add_column("images/s this run", justify="right")
    table.add_row(str(len(results)), str(images), str(ok), str(failed), f"{elapsed:.1f}", str(described_now),
                  f"{described_now / elapsed:.2f}" if elapsed > 0 else "-")
    console.print(table)
    for key, count in sorted(kinds.items()):
        console.print(f"  failed {count} x {key}")
    console.print(f"workers stopped: {codes}")


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
