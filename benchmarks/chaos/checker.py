"""The chaos run's independent checker: what the pipeline's output topics hold, against the plan of what went in.

It shares nothing with the pipeline but the message schemas (``schemas`` parses the records): its own
``KafkaConsumer``, no group, ``isolation_level="read_committed"``, every partition of every topic read from the
beginning to its end. It never imports ``consumers/`` or the project's Kafka helpers, so a bug there cannot hide
a loss here.

    python -m benchmarks.chaos.checker --bootstrap HOST:PORT,... --prefix chaos-RUN --plan plan.json [--exactly-once]

Printed: documents in, documents with a complete result, images in, images described at least once, duplicates per
topic (split into reprocessing, the same source record handled twice, and records inherited from a duplicate input
record), dead letters by kind (planted or not), lost. Exit 1 on any loss or unplanned dead letter, and with
``--exactly-once`` on any duplicate that is not inherited from the producer's input duplicates.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from schemas import DeadLetter, Description, DocumentRef, DocumentResult, Embedding, SchemaError
from schemas import decode_image_payload

ROLES = ("documents", "images", "descriptions", "embeddings", "results", "deadletter")


def read_topic(bootstrap: str, topic: str, *, idle_s: float = 5.0, limit_s: float = 180.0) -> tuple[list[Any], list[str]]:
    """Every committed record of ``topic`` from the beginning; returns (records, notes). A partition that does not
    reach its end offset (an open transaction holds the last stable offset back) is named in the notes."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap.split(","), group_id=None, enable_auto_commit=False,
                             isolation_level="read_committed", auto_offset_reset="earliest",
                             client_id="chaos-checker", max_partition_fetch_bytes=32 * 1024 * 1024,
                             fetch_max_bytes=64 * 1024 * 1024, request_timeout_ms=30_000)
    try:
        deadline = time.monotonic() + 30
        partitions = consumer.partitions_for_topic(topic)
        while not partitions and time.monotonic() < deadline:
            time.sleep(0.5)
            partitions = consumer.partitions_for_topic(topic)
        tps = [TopicPartition(topic, p) for p in sorted(partitions or ())]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        records: list[Any] = []
        last_progress = time.monotonic()
        started = time.monotonic()
        while True:
            batch = consumer.poll(timeout_ms=500)
            for recs in batch.values():
                records.extend(recs)
            if batch:
                last_progress = time.monotonic()
            behind = [tp for tp in tps if consumer.position(tp) < ends[tp]]
            if not behind:
                return records, []
            if time.monotonic() - last_progress > idle_s or time.monotonic() - started > limit_s:
                # read_committed stops at the last stable offset; past it only aborted or open transactions remain
                # (their markers count as offsets too).
                notes = [f"{tp.topic}[{tp.partition}] stopped at {consumer.position(tp)} of {ends[tp]}"
                         for tp in behind]
                return records, notes
    finally:
        consumer.close()


@dataclass
class TopicCount:
    records: int = 0
    distinct: int = 0
    reprocessed: int = 0  # the same source record's output more than once: the pipeline's own duplicates
    inherited: int = 0  # copies that come from duplicate input records (the producer's at-least-once)
    unreadable: int = 0

    @property
    def duplicates(self) -> int:
        return self.records - self.distinct


@dataclass
class Report:
    docs_planned: int = 0
    docs_on_topic: int = 0
    docs_complete: int = 0
    docs_result_wrong: list[str] = field(default_factory=list)
    docs_missing_result: list[str] = field(default_factory=list)
    images_planned: int = 0
    images_planted: int = 0
    images_in: int = 0
    images_described: int = 0
    images_lost: list[tuple[str, int]] = field(default_factory=list)
    planted_without_dead_letter: list[tuple[str, int]] = field(default_factory=list)
    topics: dict[str, TopicCount] = field(default_factory=dict)
    dead_letters: Counter = field(default_factory=Counter)  # (stage, kind, planted?) -> records
    unplanned: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return len(self.images_lost) + len(self.planted_without_dead_letter) + len(self.docs_missing_result)

    def pipeline_duplicates(self) -> int:
        return sum(t.reprocessed for name, t in self.topics.items() if name != "documents")

    def render(self) -> str:
        out = [f"documents in (planned / on the topic)        {self.docs_planned} / {self.docs_on_topic}",
               f"documents with a complete result            {self.docs_complete}",
               f"images in (planned, of them planted bad)    {self.images_planned} ({self.images_planted})",
               f"images on the images topic (distinct)       {self.images_in}",
               f"images described at least once             {self.images_described} of "
               f"{self.images_planned - self.images_planted} good",
               "",
               f"{'topic':<14}{'records':>9}{'distinct':>10}{'duplicates':>12}{'reprocessed':>13}{'inherited':>11}"]
        for name in ROLES:
            t = self.topics.get(name, TopicCount())
            out.append(f"{name:<14}{t.records:>9}{t.distinct:>10}{t.duplicates:>12}{t.reprocessed:>13}"
                       f"{t.inherited:>11}")
        out += ["", f"{'dead letters: stage':<22}{'error_kind':<26}{'planted':>8}{'records':>9}"]
        for (stage, kind, planted), n in sorted(self.dead_letters.items()):
            out.append(f"{'':<2}{stage:<20}{kind:<26}{'yes' if planted else 'NO':>8}{n:>9}")
        out += ["",
                f"lost images (good, never described)         {len(self.images_lost)}",
                f"planted bad images without a dead letter    {len(self.planted_without_dead_letter)}",
                f"documents without a complete result         {len(self.docs_missing_result)}",
                f"documents whose result disagrees            {len(self.docs_result_wrong)}",
                f"unplanned dead letters                      {len(self.unplanned)}",
                f"LOST = {self.lost}"]
        for what, items in (("lost", self.images_lost[:10]), ("no result", self.docs_missing_result[:10]),
                            ("result disagrees", self.docs_result_wrong[:10]),
                            ("unplanned", [(u['stage'], u['error_kind'], u.get('doc_id'), u.get('image_index'),
                                            u['detail'][:120]) for u in self.unplanned[:10]])):
            if items:
                out.append(f"  first {what}: {items}")
        out += [f"  note: {n}" for n in self.notes]
        return "\n".join(out)


def check(bootstrap: str, topics: dict[str, str], plan: dict[str, Any]) -> Report:
    report = Report()
    docs = {d["doc_id"]: d for d in plan["documents"]}
    planted = {(d["doc_id"], int(i)): set(kinds) for d in plan["documents"] for i, kinds in d["planted"].items()}
    report.docs_planned = len(docs)
    report.images_planned = plan["images"]
    report.images_planted = len(planted)
    read: dict[str, list[Any]] = {}
    for role in ROLES:
        read[role], notes = read_topic(bootstrap, topics[role])
        report.notes += notes

    # documents: key doc_id; a copy is an input duplicate (the producer's at-least-once)
    count = TopicCount()
    doc_offsets: dict[str, set] = defaultdict(set)
    for r in read["documents"]:
        count.records += 1
        try:
            doc = DocumentRef.decode(r.value)
        except SchemaError:
            count.unreadable += 1
            continue
        doc_offsets[doc.doc_id].add((r.partition, r.offset))
    count.distinct = len(doc_offsets)
    count.inherited = count.records - count.unreadable - count.distinct
    report.topics["documents"] = count
    report.docs_on_topic = len(set(doc_offsets) & set(docs))

    def tally(role: str, parse) -> dict[tuple[str, int], Counter]:
        """(doc_id, index) -> Counter of source coordinates (the input record each copy was made from)."""
        seen: dict[tuple[str, int], Counter] = defaultdict(Counter)
        count = TopicCount()
        for r in read[role]:
            count.records += 1
            try:
                doc_id, index, source = parse(r)
            except SchemaError:
                count.unreadable += 1
                continue
            seen[(doc_id, index)][tuple(sorted((source or {}).items()))] += 1
        count.distinct = len(seen)
        count.reprocessed = sum(n - 1 for sources in seen.values() for n in sources.values())
        count.inherited = count.records - count.unreadable - count.distinct - count.reprocessed
        report.topics[role] = count
        return seen

    def image(r):
        meta = decode_image_payload(r.headers)
        return meta.doc_id, meta.image_index, meta.source

    def described(r):
        d = Description.decode(r.value)
        return d.doc_id, d.image_index, d.source

    def embedded(r):
        e = Embedding.decode(r.value)
        return e.doc_id, e.image_index, e.source

    images = tally("images", image)
    descriptions = tally("descriptions", described)
    tally("embeddings", embedded)
    report.images_in = len(set(images) & {(d, i) for d in docs for i in range(docs[d]["image_count"])})

    # dead letters: planted or not; duplicates = the same (stage, kind, doc, index) more than once
    letters: dict[tuple, Counter] = defaultdict(Counter)
    dl_count = TopicCount()
    dead_images: set[tuple[str, int]] = set()
    manifest_lines: set[str] = set()
    for r in read["deadletter"]:
        dl_count.records += 1
        try:
            dl = DeadLetter.decode(r.value)
        except SchemaError:
            dl_count.unreadable += 1
            continue
        if dl.stage == "produce":
            # A bad manifest line: no doc id; a producer restart re-reads the manifest and rejects it again.
            # A planted bad manifest line comes back as invalid_manifest_line, its detail naming invalid_json.
            ok = dl.error_kind == "invalid_manifest_line" and "invalid_json" in dl.detail
            if ok:
                manifest_lines.add(dl.detail.split(":")[0])
            # Each rejection is its own input: the producer's re-reads count as inherited copies, not reprocessing.
            ident = ("produce", dl.error_kind, dl.detail.split(":")[0])
            letters[ident][("copy", r.partition, r.offset)] += 1
        else:
            key = (dl.doc_id, dl.image_index)
            ok = dl.doc_id in docs and key in planted and dl.error_kind in planted[key]
            if ok:
                dead_images.add(key)
            ident = (dl.stage, dl.error_kind, dl.doc_id, dl.image_index)
            letters[ident][tuple(sorted((dl.source or {}).items()))] += 1
        report.dead_letters[(dl.stage, dl.error_kind, ok)] += 1
        if not ok:
            report.unplanned.append({"stage": dl.stage, "error_kind": dl.error_kind, "doc_id": dl.doc_id,
                                     "image_index": dl.image_index, "detail": dl.detail,
                                     "at": f"{r.partition}@{r.offset}"})
    dl_count.distinct = len(letters)
    dl_count.reprocessed = sum(n - 1 for sources in letters.values() for n in sources.values())
    dl_count.inherited = dl_count.records - dl_count.unreadable - dl_count.distinct - dl_count.reprocessed
    report.topics["deadletter"] = dl_count

    # every planned image: good ones described, planted ones dead-lettered
    for doc_id, d in docs.items():
        for i in range(d["image_count"]):
            key = (doc_id, i)
            if key in planted:
                if key not in dead_images:
                    report.planted_without_dead_letter.append(key)
            elif key in descriptions:
                report.images_described += 1
            else:
                report.images_lost.append(key)

    for missing in range(plan.get("bad_manifest_lines", 0) - len(manifest_lines)):
        report.planted_without_dead_letter.append(("bad manifest line", missing))

    # results: one per document, agreeing with the plan
    results: dict[str, list[DocumentResult]] = defaultdict(list)
    res_count = TopicCount()
    for r in read["results"]:
        res_count.records += 1
        try:
            res = DocumentResult.decode(r.value)
        except SchemaError:
            res_count.unreadable += 1
            continue
        results[res.doc_id].append(res)
    res_count.distinct = len(results)
    # Results carry no source coordinates: every extra copy of a document's result counts as reprocessing.
    res_count.reprocessed = res_count.records - res_count.unreadable - res_count.distinct
    report.topics["results"] = res_count
    for doc_id, d in docs.items():
        copies = results.get(doc_id)
        if not copies:
            report.docs_missing_result.append(doc_id)
            continue
        bad = len(d["planted"])
        last = copies[-1]
        if last.image_count == d["image_count"] and last.succeeded == d["image_count"] - bad and last.failed == bad:
            report.docs_complete += 1
        else:
            report.docs_result_wrong.append(doc_id)
            report.docs_missing_result.append(doc_id)
    return report


def topic_names(prefix: str) -> dict[str, str]:
    return {role: f"{prefix}.{role}" for role in ROLES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--prefix", required=True, help="Topic names are PREFIX.documents, PREFIX.images, ...")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--exactly-once", action="store_true", help="Also fail on any duplicate made by the pipeline.")
    args = ap.parse_args(argv)
    import orjson

    with open(args.plan, "rb") as fh:
        plan = orjson.loads(fh.read())
    report = check(args.bootstrap, topic_names(args.prefix), plan)
    print(report.render())
    return verdict(report, exactly_once=args.exactly_once)


def verdict(report: Report, *, exactly_once: bool) -> int:
    failed = report.lost > 0 or bool(report.unplanned)
    if exactly_once and report.pipeline_duplicates() > 0:
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
