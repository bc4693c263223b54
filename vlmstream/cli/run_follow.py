"""What `vlmstream run` reads while its workers work: the output topics (descriptions, results, answers, dead
letters) from a watcher of its own, which earlier results count as done (``FoldedResults``), the progress lines and
the summary."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vlmstream.cli.run_workers import as_stage

console = Console(stderr=True)
PROGRESS_EVERY_S = 5.0
# The longest the last progress line waits for the workers' last commits (inference commits at most once a second).
COMMITS_SETTLE_S = 3.0


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


class RunFollower:
    """The run's view of its outputs: positioned before anything is published (so no description is missed), it
    reads results from the beginning (documents that already have one are done: a rerun resumes; with ``force``
    only results published from now on count) and tells when every expected document has its result (and, with
    ``condense``, its answer)."""

    def __init__(self, settings: Any, backlog: Any, *, condense: bool, force: bool, show: int):
        from vlmstream.cli.backlog import LiveView, StageProbe
        from vlmstream.kafka.clients import make_consumer
        from vlmstream.kafka.group import topic_partitions

        self.settings, self.condense, self.show = settings, condense, show
        topics = settings.topics
        self.watcher = make_consumer(as_stage(settings, "tap"), None)  # reads the outputs only
        # The topics were created a moment ago: a watcher assigned before they list partitions would see nothing.
        watched = [topics.descriptions, topics.results, topics.deadletter] + ([topics.summaries] if condense else [])
        tps = topic_partitions(self.watcher, watched)
        self.watcher.assign(tps)
        from_now = [tp for tp in tps if tp.topic not in (topics.results, topics.summaries) or force]
        for tp, end in self.watcher.end_offsets(from_now).items():
            self.watcher.seek(tp, end)
        if earlier := [tp for tp in tps if tp not in from_now]:  # (no argument would mean every partition)
            self.watcher.seek_to_beginning(*earlier)
        # Where the results (and answers) published before this run end: once the watcher is past them, a document
        # whose only results came from another model is known to need describing again.
        self.folded = FoldedResults(self.watcher.end_offsets(earlier) if earlier else {}, settings.infer.model)
        self.probe = StageProbe(settings, backlog)
        self.view = LiveView(self.probe)
        self.view.update()  # where the topics and groups stand before anything of this run is published
        self.results: dict[str, Any] = {}
        self.condensed: set[str] = set()  # documents with an answer (a summary) or a condense dead letter
        self.items: list[Any] = []
        self.expected: set[str] = set()
        self.images_expected = 0
        self.shown = 0
        self.images_described = 0
        self.dead_letters = 0
        self.earlier_dead_letters = 0  # of documents this run did not publish: earlier work its workers took first

    def expect(self, items: list[Any], summary: Any) -> None:
        """The documents published (``summary`` of publishing ``items``) are the ones waited for."""
        from schemas import DocumentRef

        self.items = items
        self.folded.sent_now(summary.sent_ids)
        failed_ids = {failure.doc_id for failure in summary.failed}
        docs = [item for item in items if isinstance(item, DocumentRef)]
        self.expected = {item.doc_id for item in docs} - failed_ids
        self.images_expected = sum(len(item.image_uris) for item in docs if item.doc_id in self.expected)

    def waiting(self) -> bool:
        """Documents still without a result, or (with condense) a described one still without its answer."""
        condensing = ({d for d, r in self.results.items() if r.succeeded} - self.condensed) if self.condense else set()
        return bool(self.expected - self.results.keys() or condensing)

    def read(self, timeout_ms: int = 500) -> None:
        """What the outputs brought since the last read."""
        from schemas import DeadLetter, Description, DocumentResult, DocumentSummary, SchemaError
        from vlmstream.kafka.records import poll_past_unreadable

        topics = self.settings.topics
        for tp, records in poll_past_unreadable(self.watcher, timeout_ms=timeout_ms).items():
            for record in records:
                try:
                    if tp.topic == topics.results:
                        result = DocumentResult.decode(record.value)
                        if result.doc_id in self.expected and self.folded.counts(result, self.results, tp,
                                                                                 record.offset):
                            self.results[result.doc_id] = result
                    elif tp.topic == topics.summaries:
                        summary = DocumentSummary.decode(record.value)
                        if summary.doc_id in self.expected and self.folded.current(summary.doc_id, tp, record.offset):
                            self.condensed.add(summary.doc_id)
                            console.print(f"[bold]{escape(summary.doc_id)}[/] answer: "
                                          f"{escape(json.dumps(summary.answer)[:200])}", highlight=False)
                    elif tp.topic == topics.deadletter:
                        letter = DeadLetter.decode(record.value)
                        if letter.stage == "condense" and letter.doc_id is not None:
                            self.condensed.add(letter.doc_id)
                        self.dead_letters += letter.doc_id in self.expected
                        self.earlier_dead_letters += letter.doc_id not in self.expected
                    else:
                        self._described(Description.decode(record.value))
                except SchemaError as exc:
                    console.print(f"[red]unreadable record on {tp.topic}: {exc}[/]")

    def _described(self, description: Any) -> None:
        if description.doc_id not in self.expected:
            return
        self.images_described += 1
        if self.shown < self.show:
            self.shown += 1
            text = description.text.replace("\n", " ")
            console.print(f"[bold]{description.doc_id}[/][{description.image_index}] {text[:160]}")
        elif self.shown == self.show:
            self.shown += 1
            console.print("[dim](further descriptions not shown; --show to change)[/]")

    def redo_other_models(self, publish: Any) -> None:
        """Documents whose results all came from another model, once known: published again (``publish(items)``
        returns its summary) and waited for."""
        redo = self.folded.to_redo(self.watcher)
        if not redo:
            return
        console.print(f"{len(redo)} documents have results only from another model "
                      f"({', '.join(sorted(set(redo.values()))[:3])}), not from {self.settings.infer.model}: "
                      "publishing them again to describe them with it (--force does so for every document)")
        again = publish([item for item in self.items if getattr(item, "doc_id", None) in redo])
        self.folded.sent_now(again.sent_ids)
        self.condensed.difference_update(redo)  # their earlier answers were of the other model's results
        if again.failed:
            lost = {failure.doc_id for failure in again.failed}
            self.expected -= lost
            console.print(f"[red]{len(lost)} of them were not acknowledged by the cluster; not waited for[/]")

    def show_progress(self, started: float) -> None:
        console.print(progress_line(self.view, started, len(self.expected & self.results.keys()), len(self.expected),
                                    self.images_described, self.images_expected, self.dead_letters,
                                    self.earlier_dead_letters), markup=False, highlight=False)

    def settle(self, started: float) -> None:
        """The live view once more, at the end, once the stages' last commits are in: a run shorter than
        PROGRESS_EVERY_S would otherwise show none, and a longer one would end on a line up to that old."""
        await_commits(self.view, COMMITS_SETTLE_S)
        self.show_progress(started)
        self.watcher.close()

    def close(self) -> None:
        try:
            self.probe.close()
        except Exception as exc:  # noqa: BLE001 - the live view only; the workers have stopped
            console.print(f"[yellow]closing the live view failed: {exc!r}[/]")


def await_commits(view: Any, within_s: float) -> None:
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


def progress_line(view: Any, started: float, docs_done: int, docs: int, described: int, images: int,
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


def print_summary(results: dict[str, Any], elapsed: float, codes: dict[str, int | None], described_now: int) -> None:
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
