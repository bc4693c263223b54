"""The same `vlmstream run` against one local broker and against a local three-node cluster, side by side.

    python benchmarks/bench_cluster.py [--images 60] [--rounds 2] [--corpus /work/shared/corpus]
                                       [--single-port 19292] [--cluster-port 19392] [--home /tmp/vlm-bench-cluster]

Both brokers are the project's own (vlmstream.broker), started here on ports and a home of their own, and both stay
up for the whole benchmark (so each arm pays the same idle cost of the other); the single node is the embedded
default's layout, the cluster three combined broker+controller nodes (512 MB heap each) whose topics `run` creates
with 3 replicas and min.insync.replicas=2, written with acks=all as always. The arms alternate (single, cluster,
single, cluster, ...); each run is `vlmstream run FOLDER --per-file` with the built-in tiny CPU model at its
default pixel budget, on topics and groups of its own (uuid names, deleted afterwards), over --images files of
the corpus (one document per file). Prints each run's images/s (the run's own summary: images described over the
run's seconds, workers' start included), its wall time, the CPU seconds the arm's broker JVMs used during it and
the machine's load average (other users' work on a shared machine moves the figures), each arm's median, and the
ratio cluster/single (target >= 0.9). Both brokers are stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vlmstream.broker import lifecycle  # noqa: E402
from vlmstream.broker.cluster import node_pids  # noqa: E402
from vlmstream.config import load_settings  # noqa: E402

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp"}
SHARED_JARS = Path.home() / ".cache" / "vlmstream" / "kafka-4.1.1-jars"


def arm_config(workdir: Path, arm: str, home: Path, port: int, nodes: int, corpus: Path) -> Path:
    """A settings file for one run: the arm's broker, topics and groups of its own."""
    tag = f"benchcluster.{arm}.{uuid.uuid4().hex[:8]}"
    data = {
        "broker": {"home": str(home), "port": port, "nodes": nodes, "node_heap": "512m"},
        "topics": {t: f"{tag}.{t}" for t in ("documents", "images", "descriptions", "embeddings", "results",
                                               "deadletter")},
        "decode": {"group_id": f"{tag}.decode", "allowed_roots": [str(corpus)]},
        "infer": {"group_id": f"{tag}.infer"},
        "producer": {"state_dir": str(workdir / f"{tag}-ledger")},
    }
    path = workdir / f"{tag}.json"
    path.write_text(json.dumps(data))
    return path


def one_run(config: Path, folder: Path, images: int) -> dict:
    env = {**os.environ, "COLUMNS": "300", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "vlmstream.cli", "--config", str(config), "run", str(folder), "--per-file",
           "--show", "0", "--timeout-s", "900"]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    out = proc.stdout + proc.stderr
    # The summary's row: documents | images | described | failed | seconds | described this run | images/s.
    row = [line for line in out.splitlines() if re.match(r"^\s*[│|]\s*\d+\s*[│|]", line)]
    cells = [c.strip() for c in re.split(r"[│|]", row[-1]) if c.strip()] if row else []
    if proc.returncode != 0 or len(cells) < 7 or int(cells[5]) != images:
        raise SystemExit(f"run failed (exit {proc.returncode}, summary {cells}):\n{out[-4000:]}")
    return {"described": int(cells[5]), "seconds": float(cells[4]), "img_s": float(cells[6]), "wall_s": wall}


def broker_cpu_s(settings) -> float:
    """CPU seconds (user + system) the arm's broker JVMs have used so far, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in node_pids(settings).values():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError, TypeError):
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def cleanup(config: Path) -> None:
    from vlmstream.kafka.clients import make_admin

    settings = load_settings(config)
    t = settings.topics
    admin = make_admin(settings)
    try:
        admin.delete_topics([t.documents, t.images, t.descriptions, t.embeddings, t.results, t.deadletter])
        admin.delete_groups([settings.decode.group_id, settings.infer.group_id, f"{settings.infer.group_id}-results"])
    except Exception as exc:  # noqa: BLE001 - uuid names never collide; say so and go on
        print(f"  cleanup: {type(exc).__name__}: {exc}")
    finally:
        admin.close()


def warm_up(settings) -> None:
    """Have the broker create __consumer_offsets (10 partitions; 3 replicas each on the cluster) before any run is
    timed: the first group of a fresh broker pays for it, once."""
    from kafka import TopicPartition
    from kafka.structs import OffsetAndMetadata

    from vlmstream.kafka.clients import make_admin, make_consumer
    from vlmstream.kafka.topics import TopicSpec, create_topics

    topic = f"benchcluster.warmup.{uuid.uuid4().hex[:8]}"
    create_topics(settings, [TopicSpec(topic, 1, settings.broker.nodes, {})])
    consumer = make_consumer(settings, f"{topic}.group")
    try:
        consumer.commit({TopicPartition(topic, 0): OffsetAndMetadata(0, "", -1)})
    finally:
        consumer.close()
    admin = make_admin(settings)
    try:
        admin.delete_topics([topic])
    finally:
        admin.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2, help="Runs per arm, alternating.")
    parser.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "corpus")
    parser.add_argument("--single-port", type=int, default=19292)
    parser.add_argument("--cluster-port", type=int, default=19392)
    parser.add_argument("--home", type=Path, default=Path(tempfile.gettempdir()) / "vlm-bench-cluster")
    args = parser.parse_args()
    if not args.corpus.is_dir():
        args.corpus = Path("/work/shared/corpus")
    files = sorted(p for p in args.corpus.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if len(files) < args.images:
        raise SystemExit(f"{args.corpus} has {len(files)} images; --images {args.images} asked")
    workdir = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    folder = workdir / "images"
    folder.mkdir()
    for i, path in enumerate(files[:args.images]):  # links: decode reads the corpus (allowed_roots)
        (folder / f"{i:03d}-{path.name}").symlink_to(path)
    arms = {"single": (args.home / "single", args.single_port, 1), "cluster": (args.home / "cluster",
                                                                                 args.cluster_port, 3)}
    settings = {}
    for arm, (home, port, nodes) in arms.items():
        home.mkdir(parents=True, exist_ok=True)
        jars = home / "kafka-4.1.1-jars"
        if SHARED_JARS.is_dir() and not jars.exists():
            jars.symlink_to(SHARED_JARS, target_is_directory=True)
        settings[arm] = load_settings(arm_config(workdir, arm, home, port, nodes, args.corpus))
    results: dict[str, list[dict]] = {"single": [], "cluster": []}
    try:
        for arm, s in settings.items():
            t0 = time.monotonic()
            print(f"{arm}: {lifecycle.start(s)} ({time.monotonic() - t0:.0f} s to answer)", flush=True)
            warm_up(s)
        print(f"{args.images} images of {args.corpus}, one document each; vlmstream run --per-file, tiny CPU "
              f"model, default budget; {os.cpu_count()} cores; {args.rounds} rounds, arms alternating", flush=True)
        for round_ in range(1, args.rounds + 1):
            for arm, (home, port, nodes) in arms.items():
                config = arm_config(workdir, arm, home, port, nodes, args.corpus)
                cpu_before, load_before = broker_cpu_s(settings[arm]), os.getloadavg()[0]
                try:
                    r = one_run(config, folder, args.images)
                finally:
                    cleanup(config)
                r["broker_cpu_s"] = broker_cpu_s(settings[arm]) - cpu_before
                results[arm].append(r)
                print(f"round {round_} {arm:7s}: {r['described']} images in {r['seconds']:.1f} s -> "
                      f"{r['img_s']:.2f} images/s (wall {r['wall_s']:.1f} s); broker JVMs used "
                      f"{r['broker_cpu_s']:.1f} CPU s; machine load {load_before:.1f} -> {os.getloadavg()[0]:.1f} "
                      f"(1-min average, every process on it)", flush=True)
    finally:
        for arm, s in settings.items():
            lifecycle.stop(s, reason=f"bench_cluster: arm {arm} done")
        shutil.rmtree(workdir, ignore_errors=True)
    single = statistics.median(r["img_s"] for r in results["single"])
    cluster = statistics.median(r["img_s"] for r in results["cluster"])
    cpu = {arm: statistics.median(r["broker_cpu_s"] for r in rs) for arm, rs in results.items()}
    print(f"median images/s: single node {single:.2f}, 3-node cluster (RF 3, min ISR 2, acks=all) {cluster:.2f}; "
          f"ratio cluster/single {cluster / single:.2f} (target >= 0.9)")
    print(f"median broker CPU per run: single node {cpu['single']:.1f} s, 3-node cluster {cpu['cluster']:.1f} s "
          f"(all three JVMs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
