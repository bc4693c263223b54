"""Producer throughput through the real broker: a 100,000-line JSONL manifest published to fresh
uuid-named topics, measured side by side in one run:

  (a 5,000-document warm-up pass goes first, unmeasured)
  no ledger   publish without the ledger (the cost of parsing, validating and sending)
  ledger      publish with the ledger (lookup before, batched write after each acknowledgement)
  re-run      the same manifest again: every document is skipped by the ledger
  force       the same manifest with --force: ledger lookups skipped, every document sent again

Usage: .venv/bin/python benchmarks/bench_producer.py [--docs 100000] [--images-per-doc 3] [--linger-ms 50]
Uses the local broker (started if needed) unless VLMSTREAM_BOOTSTRAP_SERVERS points elsewhere.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from producers.ledger import Ledger, bootstrap_scope, ledger_path  # noqa: E402
from producers.publisher import publish_documents  # noqa: E402
from producers.manifest import read_manifest  # noqa: E402
from vlmstream.broker.lifecycle import ensure_broker  # noqa: E402
from vlmstream.config import load_settings  # noqa: E402
from vlmstream.kafka.clients import make_admin  # noqa: E402
from vlmstream.kafka.topics import TopicSpec, create_topics  # noqa: E402


def write_manifest(path: Path, docs: int, images_per_doc: int) -> None:
    with open(path, "wb") as fh:
        for i in range(docs):
            fh.write(orjson.dumps({"doc_id": f"bench-{i:07d}",
                                   "image_uris": [f"scans/{i:07d}/page-{p}.jpg" for p in range(images_per_doc)],
                                   "metadata": {"batch": i // 1000, "title": f"Document {i}"}}) + b"\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--images-per-doc", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--linger-ms", type=int, default=None,
                        help="Override producer.linger_ms (longer lingering: bigger batches, fewer wake-ups).")
    args = parser.parse_args()

    base = load_settings()
    ensure_broker(base)
    suffix = uuid.uuid4().hex[:10]
    with tempfile.TemporaryDirectory(prefix="vlmstream-bench-producer-") as tmp:
        tmp_path = Path(tmp)
        topics = base.topics.model_copy(update={"documents": f"bench.{suffix}.documents",
                                                "deadletter": f"bench.{suffix}.deadletter"})
        producer = base.producer.model_copy(update={"state_dir": tmp_path / "state"} | (
            {"linger_ms": args.linger_ms} if args.linger_ms is not None else {}))
        settings = base.model_copy(update={"topics": topics, "producer": producer})
        create_topics(settings, [TopicSpec(topics.documents, args.partitions, 1, {}),
                                 TopicSpec(topics.deadletter, 1, 1, {})])
        manifest = tmp_path / "manifest.jsonl"
        started = time.perf_counter()
        write_manifest(manifest, args.docs, args.images_per_doc)
        print(f"manifest: {args.docs:,} lines, {manifest.stat().st_size / 1e6:.1f} MB, "
              f"written in {time.perf_counter() - started:.1f}s")
        try:
            parse_started = time.perf_counter()
            parsed = sum(1 for _ in read_manifest(manifest))
            parse_s = time.perf_counter() - parse_started

            # Warm-up, not measured: the first records on fresh partitions pay for their log segments,
            # and the first pass would otherwise look slower for reasons unrelated to what it does.
            warmup = tmp_path / "warmup.jsonl"
            write_manifest(warmup, min(5_000, args.docs), args.images_per_doc)
            publish_documents(settings, read_manifest(warmup), use_ledger=False)

            rows = []
            for name, kwargs in (("no ledger", {"use_ledger": False}), ("ledger", {}),
                                 ("re-run", {}), ("force", {"force": True})):
                summary = publish_documents(settings, read_manifest(manifest), **kwargs)
                assert not summary.failed and not summary.rejected, summary.render()
                rows.append((name, summary))
            with Ledger(ledger_path(settings)) as ledger:
                recorded = ledger.count(topics.documents, bootstrap_scope(settings))
        finally:
            admin = make_admin(settings)
            try:
                admin.delete_topics([topics.documents, topics.deadletter])
            finally:
                admin.close()

    print(f"parse + validate only: {parsed / parse_s:,.0f} docs/s ({parse_s:.1f}s)")
    print(f"{'pass':<10} {'sent':>8} {'skipped':>8} {'seconds':>8} {'docs/s':>10} {'vs no ledger':>13}")
    reference = rows[0][1].docs_per_s()
    for name, summary in rows:
        print(f"{name:<10} {summary.sent:>8,} {summary.skipped:>8,} {summary.elapsed_s:>8.1f} "
              f"{summary.docs_per_s():>10,.0f} {summary.docs_per_s() / reference:>12.2f}x")
    print(f"ledger rows for the topic: {recorded:,} (expected {args.docs:,})")
    assert rows[1][1].sent == args.docs and rows[2][1].skipped == args.docs and recorded == args.docs


if __name__ == "__main__":
    main()
