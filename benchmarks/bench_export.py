"""`vlmstream export` throughput: JSON lines against Parquet on the same topics, side by side in one run.

Publishes descriptions (tiny-model-sized text) and embeddings (float16 vectors) to fresh uuid-named topics, then
exports them once per format with its own consumer group into a folder of its own, rounds alternating, and prints
rows per second for each (rows: descriptions + embeddings, from the first record read to the files synced).

Usage: .venv/bin/python benchmarks/bench_export.py [--descriptions 20000] [--embeddings 5000] [--dim 1280]
Uses the local broker (started if needed) unless VLMSTREAM_BOOTSTRAP_SERVERS points elsewhere.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas import Description, Embedding  # noqa: E402
from vlmstream.broker.lifecycle import ensure_broker  # noqa: E402
from vlmstream.cli.export import export  # noqa: E402
from vlmstream.config import load_settings  # noqa: E402
from vlmstream.kafka.clients import make_admin, make_producer  # noqa: E402
from vlmstream.kafka.topics import TopicSpec, create_topics  # noqa: E402


def publish(settings, descriptions: int, embeddings: int, dim: int) -> None:
    producer = make_producer(settings)
    rng = np.random.default_rng(0)
    words = "a scanned page with a table of figures and a handwritten note in the margin".split()
    for i in range(descriptions):
        text = " ".join(words[(i + k) % len(words)] for k in range(60))  # ~330 characters, like a short caption
        d = Description(doc_id=f"doc-{i // 4:07d}", image_index=i % 4, image_count=4, text=text, model="bench",
                        prompt_id="p1", engine="transformers", source_uri=f"/data/scans/{i:07d}.jpg",
                        prompt_tokens=300, output_tokens=64, visual_tokens=256, created_at=time.time())
        producer.send(settings.topics.descriptions, key=d.key(), value=d.encode())
    for i in range(embeddings):
        e = Embedding.from_vector(rng.standard_normal(dim).astype(np.float16), doc_id=f"doc-{i // 4:07d}",
                                  image_index=i % 4, image_count=4, model="bench")
        producer.send(settings.topics.embeddings, key=e.key(), value=e.encode())
    producer.flush()
    producer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--descriptions", type=int, default=20_000)
    parser.add_argument("--embeddings", type=int, default=5_000)
    parser.add_argument("--dim", type=int, default=1280, help="Embedding width (Qwen2.5-VL-7B's merger: 3584).")
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    base = load_settings()
    ensure_broker(base)
    suffix = uuid.uuid4().hex[:10]
    topics = base.topics.model_copy(update={"descriptions": f"bench.{suffix}.descriptions",
                                            "embeddings": f"bench.{suffix}.embeddings"})
    settings = base.model_copy(update={"topics": topics})
    create_topics(settings, [TopicSpec(topics.descriptions, args.partitions, 1, {}),
                             TopicSpec(topics.embeddings, args.partitions, 1, {})])
    try:
        publish(settings, args.descriptions, args.embeddings, args.dim)
        rows = args.descriptions + args.embeddings
        rates: dict[str, list[float]] = {"jsonl": [], "parquet": []}
        with tempfile.TemporaryDirectory(prefix="vlmstream-bench-export-") as tmp:
            for round_ in range(args.rounds):
                for fmt in ("jsonl", "parquet") if round_ % 2 == 0 else ("parquet", "jsonl"):
                    start = time.perf_counter()
                    report = export(settings, Path(tmp) / f"{fmt}-{round_}", ("descriptions", "embeddings"),
                                    format=fmt, group_id=f"bench-export-{suffix}-{fmt}-{round_}")
                    elapsed = time.perf_counter() - start
                    assert sum(report.written.values()) == rows, report.written
                    rates[fmt].append(rows / elapsed)
                    size = sum(p.stat().st_size for p in (Path(tmp) / f"{fmt}-{round_}").iterdir())
                    print(f"round {round_} {fmt:8} {rows / elapsed:9,.0f} rows/s  {elapsed:6.2f} s  "
                          f"{size / 1e6:7.1f} MB on disk", flush=True)
        jsonl, parquet = (float(np.median(rates[f])) for f in ("jsonl", "parquet"))
        print(f"\n{args.descriptions} descriptions + {args.embeddings} embeddings (dim {args.dim}, float16), "
              f"{args.partitions} partitions, median of {args.rounds}:")
        print("| format | rows/s | vs JSON lines |\n|---|---|---|")
        print(f"| JSON lines (+ raw vector file) | {jsonl:,.0f} | 1.00 |")
        print(f"| Parquet | {parquet:,.0f} | {parquet / jsonl:.2f} |")
    finally:
        admin = make_admin(settings)
        admin.delete_topics([topics.descriptions, topics.embeddings])
        admin.close()


if __name__ == "__main__":
    main()
