"""`vlmstream produce`: publish DocumentRef messages from a manifest, a folder or stdin."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import orjson
import typer
from rich.console import Console


def produce(
    ctx: typer.Context,
    manifest: Optional[Path] = typer.Option(None, "--manifest", "-m", help="JSONL manifest ({doc_id, image_uris "
                                            "| images, metadata} per line), a .json list of such objects, or CSV/TSV "
                                            "(doc_id, image_uri | image_uris, extra columns = metadata; ',', tab, "
                                            "';' or '|'). Relative paths resolve against its folder."),
    folder: Optional[Path] = typer.Option(None, "--folder", "-f", help="Folder of images: each subfolder is a "
                                          "document, each image directly inside is its own document."),
    per_file: bool = typer.Option(False, "--per-file", help="With --folder: every image file is a document."),
    stdin: bool = typer.Option(False, "--stdin", help="Read stdin: JSON objects as in a manifest, or bare "
                               "paths/URIs (one image = one document, id = the text). Streams until EOF."),
    watch: bool = typer.Option(False, "--watch", "-w", help="With --folder or a JSONL --manifest: keep following "
                               "it for new documents until Ctrl-C/SIGTERM or --max-seconds."),
    force: bool = typer.Option(False, "--force", help="Publish again documents the ledger says were published."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar (it is off anyway when stderr "
                               "is not a terminal)."),
    settle_s: float = typer.Option(2.0, "--settle-s", help="Watch: a folder document goes out once its files "
                                   "have not changed for this long."),
    max_seconds: Optional[float] = typer.Option(None, "--max-seconds", help="Watch: stop after this long."),
    documents_topic: Optional[str] = typer.Option(None, "--documents-topic", help="Override topics.documents."),
    id_prefix: str = typer.Option("", "--id-prefix", help="Put this before every document id (e.g. 'scans-2024/'). "
                                  "A folder's ids are paths relative to it, so two folders holding the same file "
                                  "names share ids, and on the results topic (compacted by id) the later one's "
                                  "results replace the earlier one's."),
) -> None:
    """Publish documents (DocumentRef, key doc_id) to the documents topic, skipping those already published.

    A summary goes to stderr and a JSON summary to stdout.

    Exit 0: every document is on the topic (sent now or before).
    Rejected input lines do not change that: they are listed with their line numbers and dead-lettered.
    Exit 1: the broker did not acknowledge a send; that document goes out on the next run.
    Exit 2: bad usage.
    """
    from vlmstream.images.fetch import Fetcher
    from producers.folder import scan_folder, skipped_files_line
    from producers.items import with_id_prefix, with_pdf_pages
    from producers.manifest import read_manifest
    from producers.publisher import publish_documents
    from producers.stdin import read_lines
    from producers.watch import follow_jsonl, watch_folder
    from vlmstream.cli.support import bootstrap, settings_from
    from vlmstream.kafka.errors import FatalPipelineError
    from vlmstream.kafka.topics import create_topics
    from vlmstream.stopping import Stop

    console = Console(stderr=True)
    chosen = [name for name, given in (("--manifest", manifest), ("--folder", folder), ("--stdin", stdin)) if given]
    if len(chosen) != 1:
        raise typer.BadParameter("give exactly one of --manifest, --folder, --stdin")
    if watch and stdin:
        raise typer.BadParameter("--stdin already streams until EOF; --watch is for --folder or --manifest")
    if per_file and not folder:
        raise typer.BadParameter("--per-file goes with --folder")
    # Watch mode may start before the folder or manifest exists; a one-shot run may not.
    if manifest is not None and (manifest.is_dir() or (not watch and not manifest.is_file())):
        raise typer.BadParameter(f"--manifest {manifest} is not a file")
    if folder is not None and (folder.is_file() or (not watch and not folder.is_dir())):
        raise typer.BadParameter(f"--folder {folder} is not a folder")
    if watch and manifest is not None and manifest.suffix.lower() in (".csv", ".tsv", ".json"):
        raise typer.BadParameter("--watch follows JSON-lines manifests only (a CSV document's rows span lines; a "
                                 ".json list is one value)")

    settings = bootstrap(settings_from(ctx, {"topics": {"documents": documents_topic}}))
    create_topics(settings)

    # First Ctrl-C/SIGTERM: stop reading, finish the sends in flight, write the ledger. Second: at once.
    stop = Stop("vlmstream produce", on_first=lambda _reason: console.print(
        "stopping: finishing the sends in flight (again to abort)")).install()
    items: Iterator[Any]
    skipped: list[Path] = []  # a one-shot folder scan's files of other types, said at the end
    # A remote PDF is fetched here once, with the decode stage's rules, to publish each of its pages.
    fetcher = Fetcher.from_settings(settings.decode)
    if manifest is not None:
        items = with_pdf_pages(follow_jsonl(manifest, stop=stop, max_seconds=max_seconds) if watch
                               else read_manifest(manifest), settings.decode.max_pdf_pages, fetcher.fetch)
    elif folder is not None:
        pdf_pages = settings.decode.max_pdf_pages
        items = (watch_folder(folder, per_file=per_file, settle_s=settle_s, stop=stop, max_seconds=max_seconds,
                              max_pdf_pages=pdf_pages)
                 if watch else scan_folder(folder, per_file=per_file, skipped=skipped, max_pdf_pages=pdf_pages))
    else:
        items = with_pdf_pages(read_lines(sys.stdin.buffer, stop=stop), settings.decode.max_pdf_pages, fetcher.fetch)
    items = with_id_prefix(items, id_prefix)

    try:
        with _progress(console, enabled=not quiet and console.is_terminal) as on_progress:
            if settings.metrics_port > 0:
                from producers.metrics import serve

                latest: list[Any] = [None]
                shown = on_progress

                def on_progress(summary: Any) -> None:
                    latest[0] = summary
                    if shown is not None:
                        shown(summary)

                serve(lambda: latest[0], settings.metrics_port)
            summary = publish_documents(settings, items, force=force, stop=stop, on_progress=on_progress)
    except FatalPipelineError as exc:
        # The broker is unreachable: acknowledged documents are in the ledger, the rest go out next run.
        console.print(f"[red]fatal:[/] {exc}")
        raise typer.Exit(1) from None
    finally:
        fetcher.close()
    console.print(summary.render(), highlight=False, markup=False, soft_wrap=True)
    if skipped:
        console.print(skipped_files_line(skipped, folder), highlight=False, markup=False, soft_wrap=True)
    sys.stdout.write(orjson.dumps(summary.as_dict()).decode() + "\n")
    if not summary.ok:
        raise typer.Exit(1)


class _progress:
    """A rich progress line (documents handled and rate), or nothing when disabled."""

    def __init__(self, console: Console, *, enabled: bool):
        self.console, self.enabled = console, enabled
        self._progress = None

    def __enter__(self) -> Callable[[Any], None] | None:
        if not self.enabled:
            return None
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                  console=self.console, transient=True)
        self._progress.start()
        task = self._progress.add_task("starting")

        def update(summary: Any) -> None:
            self._progress.update(task, description=(
                f"sent {summary.sent}  skipped {summary.skipped}  rejected {len(summary.rejected)}  "
                f"failed {len(summary.failed)}  {summary.docs_per_s():,.0f} docs/s"))

        return update

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
