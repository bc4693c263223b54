"""`vlmstream estimate`'s sample run: the sample through the real pipeline as `vlmstream run` runs it (its workers,
as child processes, with the same settings), on topics and groups of its own; then what its outputs say about each
image's costs."""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from vlmstream.cli.estimate_job import JobDocument
from vlmstream.cli.run_setup import manifest_roots, own_topics_and_groups, with_allowed_roots
from vlmstream.cli.run_workers import Workers, as_stage
from vlmstream.stopping import Stop, exit_status, signal_label

# The command's start, as near as this module knows it (`vlmstream`'s main imports it at start-up): `vlmstream run`'s
# time counts from its process start too.
PROCESS_STARTED = time.time()


@dataclass
class SampleRun:
    images: list[Any]  # projection.sample.SampleImage
    started_at: float  # epoch seconds: the command's start
    workers_at: float  # the workers started
    ready_at: float  # the warm-up document described: the model is loaded and answering
    measured_at: float  # the rest of the sample published: the steady window starts
    done_at: float  # the last sample image described (or dead-lettered)
    stop_s: float  # stopping the workers took
    missing: int  # sample images without a description (dead letters, or the time ran out)
    answers: dict[str, tuple[float, float]] = field(default_factory=dict)  # with condense: doc id -> (written, model s)
    # Seconds the inference worker's engine compiled the model for at its start, filling a compile cache a run on
    # this machine then loads (0.0: it loaded one; None: its log does not say, as on the CPU engine).
    cold_compile_s: float | None = None

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
    there to the last description (with ``condense``: to the last document's answer).

    SIGTERM or Ctrl-C: the workers drain (a second signal: they are killed), then the estimate exits with 143 or
    130."""
    from vlmstream.kafka.topics import create_topics

    suffix = f"estimate-{uuid.uuid4().hex[:10]}"
    settings = sample_settings(settings, docs, suffix)
    create_topics(settings)
    progress = SampleProgress(docs, suffix, condense)
    watcher = progress.watch(settings)
    stages = ("decode", "infer") + (("condense",) if condense else ())
    workers = Workers(settings, stages, Path(tempfile.mkdtemp(prefix="vlmstream-estimate-logs-")))
    stop = Stop("vlmstream estimate", now=workers.kill).install()
    try:
        workers_at = time.time()
        # The workers get the sample's settings file and none of the settings variables of this environment,
        # which would send them to the real job's topics and groups.
        workers.start()
        progress.run(settings, watcher, workers, stop, deadline=time.monotonic() + timeout_s)
        done_at = time.time()
    finally:
        watcher.close()
        stopping = time.monotonic()
        try:
            workers.stop(stop)
        finally:
            stop.restore()
        stop_s = time.monotonic() - stopping
    if stop.signals:
        typer.echo(f"stopped by {signal_label(stop.signals[0])}: the sample's workers stopped", err=True)
        raise typer.Exit(exit_status(stop.signals[0]))
    if not progress.ready_at:
        raise typer.BadParameter(f"the sample's warm-up document was not described within --timeout-s {timeout_s:g}; "
                                 f"worker logs in {workers.log_dir}")
    images, answers = read_sample_outputs(settings, docs, progress, condense)
    delete_topics(settings, [getattr(settings.topics, name) for name in OWN_TOPICS])
    cold_compile_s = compiled_at_start(workers.log_path("infer"))
    shutil.rmtree(workers.log_dir, ignore_errors=True)
    # The run's time counts from the command's start, less ``own_s``: what only the estimate does before it (reading
    # every image's header, drawing the sample), which `vlmstream run` does not.
    return SampleRun(images, PROCESS_STARTED + own_s, workers_at, progress.ready_at, progress.measured_at, done_at,
                     stop_s, len(progress.wanted) - len(images), answers, cold_compile_s)


def compiled_at_start(log: Path) -> float | None:
    """What the inference worker's log says its vLLM engine compiled for at start (vllm_adapter reads vLLM's lines);
    None without such a line or log."""
    from vlmstream.vllm_adapter import cold_compile_seconds as from_log

    try:
        return from_log(log.read_text(errors="replace"))
    except OSError:
        return None


OWN_TOPICS = ("documents", "images", "descriptions", "embeddings", "results", "summaries", "deadletter")


def sample_settings(settings: Any, docs: list[JobDocument], suffix: str) -> Any:
    """Topics and groups of the sample's own, decode allowed to read where a manifest's images lie, and a ledger of
    its own (the sample's documents are published whatever the job's ledger says)."""
    settings = with_allowed_roots(own_topics_and_groups(settings, suffix), manifest_roots([d.doc for d in docs]))
    return settings.model_copy(update={"producer": settings.producer.model_copy(update={
        "state_dir": tempfile.mkdtemp(prefix="vlmstream-estimate-ledger-")})})


class SampleProgress:
    """The sample in two parts behind a one-image warm-up document (the sample's smallest image), and what its
    outputs have shown so far."""

    def __init__(self, docs: list[JobDocument], suffix: str, condense: bool):
        from schemas import DocumentRef

        smallest = min((im for d in docs for im in d.images), key=lambda im: im.effective_px or 1 << 40)
        self.warmup = DocumentRef(doc_id=f"estimate-warmup-{suffix}", image_uris=(smallest.uri,))
        self.first_part: list[JobDocument] = []
        self.rest: list[JobDocument] = []
        images, total = 0, sum(len(d.images) for d in docs)
        for d in docs:
            (self.first_part if images < total / 4 else self.rest).append(d)
            images += len(d.images) if images < total / 4 else 0
        self.wanted = {(d.doc.doc_id, i) for d in docs for i in range(len(d.images))}
        self.seen: set[tuple[str, int]] = set()
        # With condense: each document's answer (or its condense dead letter) too; the warm-up document's is not
        # waited for.
        self.to_condense = {d.doc.doc_id for d in docs} if condense else set()
        self.condense = condense
        self.warm_done = False
        self.ready_at = self.measured_at = 0.0

    def watch(self, settings: Any) -> Any:
        """A consumer of the sample's outputs, from their start."""
        from vlmstream.kafka.clients import make_consumer
        from vlmstream.kafka.group import topic_partitions

        topics = settings.topics
        watcher = make_consumer(as_stage(settings, "tap"), None)
        watcher.assign(topic_partitions(watcher, [topics.descriptions, topics.deadletter]
                                        + ([topics.summaries] if self.condense else [])))
        watcher.seek_to_beginning()
        return watcher

    def run(self, settings: Any, watcher: Any, workers: Workers, stop: Stop, deadline: float) -> None:
        """Publish the warm-up document and the first part; once the warm-up document is described (the model
        answers), the rest; until every sample image is described (and answered), the deadline, or a stop."""
        from producers.publisher import publish_documents

        producer = as_stage(settings, "producer")
        publish_documents(producer, [self.warmup, *(d.doc for d in self.first_part)], force=True)
        while (not self.warm_done or self.wanted - self.seen or self.to_condense) and time.monotonic() < deadline \
                and not stop.is_set():
            if exited := workers.exited():
                name, code = exited
                raise typer.BadParameter(f"the sample's {name} worker exited with {code}: "
                                         f"{workers.log_path(name).read_text()[-2000:]}")
            self.read(settings, watcher)
            if self.warm_done and not self.ready_at:
                self.ready_at = time.time()
                publish_documents(producer, [d.doc for d in self.rest], force=True)
                self.measured_at = time.time()

    def read(self, settings: Any, watcher: Any) -> None:
        from schemas import DeadLetter, Description, DocumentSummary, SchemaError
        from vlmstream.kafka.records import poll_past_unreadable

        kinds = {settings.topics.descriptions: Description, settings.topics.summaries: DocumentSummary}
        for tp, records in poll_past_unreadable(watcher, timeout_ms=300).items():
            for record in records:
                try:
                    kind = kinds.get(tp.topic, DeadLetter)
                    message = kind.decode(record.value)
                except SchemaError:
                    continue
                if kind is DocumentSummary or (kind is DeadLetter and message.stage == "condense"):
                    self.to_condense.discard(message.doc_id)
                elif message.doc_id == self.warmup.doc_id:
                    self.warm_done = True
                elif message.doc_id is not None and getattr(message, "image_index", None) is not None:
                    self.seen.add((message.doc_id, message.image_index))


def read_sample_outputs(settings: Any, docs: list[JobDocument], progress: SampleProgress, condense: bool
                        ) -> tuple[list[Any], dict[str, tuple[float, float]]]:
    """Each sample image's costs, from its description and its image record; with condense, each document's answer
    (when it was written, and its model's seconds)."""
    from schemas import Description, DocumentSummary, SchemaError

    warmup = progress.warmup.doc_id
    wanted = len(progress.wanted) + 1
    classes = {im.uri: im.size_class for d in docs for im in d.images}
    rows = []
    for record in read_all(settings, settings.topics.descriptions, wanted):
        try:
            description = Description.decode(record.value)
        except SchemaError:
            continue
        if description.doc_id != warmup:
            rows.append((record.timestamp / 1000, description))
    decoded = {record.key: record.timestamp / 1000 for record in read_all(settings, settings.topics.images, wanted)}
    answers = {}
    if condense:
        for record in read_all(settings, settings.topics.summaries, len(docs) + 1):
            try:
                summary = DocumentSummary.decode(record.value)
            except SchemaError:
                continue
            if summary.doc_id == warmup:
                continue
            t = summary.timings_ms or {}
            answers[summary.doc_id] = (record.timestamp / 1000,
                                       t.get("generate_cpu_ms", t.get("generate_ms", 0.0))  # as inference's
                                       / max(1.0, t.get("batch_documents", 1.0)) / 1000)
    return with_answers(sample_images(rows, classes, decoded), answers), answers


def read_all(settings: Any, topic: str, wanted: int) -> list[Any]:
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


def sample_images(rows: list[tuple[float, Any]], classes: dict[str, str], decoded: dict[bytes, float]) -> list[Any]:
    """Each described image's decode time and its share of its inference batch. A transformers batch's images carry
    the same batch_ms: the vision tower's part is shared out by visual tokens (it runs on each image's own patches),
    the rest equally (the language model pads every sequence to the batch's longest). On the CPU the batch's cost
    is the process's CPU time over it (batch_cpu_ms, vision_cpu_ms), shared out the same way: like decode's, its
    wall time grows with whatever else runs on the cores (the sample's burst keeps every process busy at once, a
    long job less so) and the projection counts the cores' contention once, by itself. On an accelerator the batch's
    wall time is its cost (the accelerator's time; the process's CPU time there says nothing). An engine without
    batch times (vLLM): each image's own engine_ms."""
    from schemas import image_key
    from vlmstream.projection.sample import SampleImage

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
                                   d.source_uri or "", d.doc_id, infer_cpu, decode_cpu="prepare_cpu_ms" in t,
                                   tokens=d.visual_tokens or 0))
    return out


def with_answers(images: list[Any], answers: dict[str, tuple[float, float]]) -> list[Any]:
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


def delete_topics(settings: Any, topics: list[str]) -> None:
    from vlmstream.kafka.clients import make_admin

    admin = make_admin(settings)
    try:
        admin.delete_topics(topics)
    except Exception:  # noqa: BLE001 - the sample's topics are uuid-named: one left behind harms nothing
        pass
    finally:
        admin.close()


