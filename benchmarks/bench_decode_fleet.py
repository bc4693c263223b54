"""Decode fleet through the real broker versus the decode stage called in a loop, side by side.

    .venv/bin/python benchmarks/bench_decode_fleet.py [--images-dir DIR] [--images 200] [--max-pixels N]

(a) in-process: ``DecodeStage`` called in a loop on one core (this process pinned to one CPU);
(b) the fleet: ``vlmstream decode --workers N`` (supervisor + N worker processes) on fresh uuid topics; the
    clock runs from the first DocumentRef published to the last image record read back from the images
    topic (so it includes produce, fetch, the decode, the image produce and its delivery).
Printed: images/s of each, and ``fleet_rate / (in_process_rate x N)``, the share of the per-core stage rate
the fleet keeps (target >= 0.9). On a shared 2-core machine, N=2 competes with this process (publisher and
reader) and with everyone else: compare the ratios of one run, not absolute rates.

Because wall-clock rates on a loaded machine mostly measure the neighbours, the CPU seconds per image are
printed too: the stage loop's own CPU time, and the workers' (all their threads: decode, Kafka IO) from
/proc over the same window. ``cpu ratio = in-process CPU/image / fleet CPU/image`` is the fleet's overhead
on the work itself, and holds up under load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kafka import KafkaConsumer, TopicPartition  # noqa: E402

from schemas import DocumentRef  # noqa: E402
from vlmstream.broker.lifecycle import ensure_broker  # noqa: E402
from vlmstream.config import Settings, load_settings  # noqa: E402
from vlmstream.kafka.clients import make_admin, make_producer  # noqa: E402
from vlmstream.kafka.topics import TopicSpec, create_topics, pipeline_topic_specs  # noqa: E402

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def image_list(folder: Path, count: int) -> list[str]:
    files = sorted(str(p) for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise SystemExit(f"no images under {folder}")
    return [files[i % len(files)] for i in range(count)]


def in_process_rate(settings: Settings, uris: list[str], warmup: int) -> tuple[float, float, int]:
    """Images/s of the stage alone on one CPU, its CPU seconds per image, and how many failed."""
    import cv2

    from vlmstream.images.claimcheck import claim_check_url
    from consumers.decode.stage import DecodeStage

    stage = DecodeStage(settings.decode, claim_check_url(settings))
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(affinity)})
    threads = cv2.getNumThreads()
    cv2.setNumThreads(1)  # one core means one core, not OpenCV's pool
    try:
        for uri in uris[:warmup]:
            stage(uri)
        failed = 0
        started, cpu_started = time.perf_counter(), time.process_time()
        for uri in uris:
            failed += not hasattr(stage(uri), "data")
        cpu = time.process_time() - cpu_started
        return len(uris) / (time.perf_counter() - started), cpu / len(uris), failed
    finally:
        os.sched_setaffinity(0, affinity)
        cv2.setNumThreads(threads)


def scoped_settings(base: Settings, partitions: int) -> Settings:
    suffix = uuid.uuid4().hex[:10]
    names = {n: f"bench.{suffix}.{n}" for n in
             ("documents", "images", "descriptions", "embeddings", "results", "deadletter")}
    scoped = base.model_copy(update={"topics": base.topics.model_copy(update={**names, "partitions": partitions})})
    create_topics(scoped, [TopicSpec(s.name, partitions, 1, s.configs) for s in pipeline_topic_specs(scoped)])
    return scoped


def delete_topics(settings: Settings) -> None:
    admin = make_admin(settings)
    try:
        t = settings.topics
        admin.delete_topics([t.documents, t.images, t.descriptions, t.embeddings, t.results, t.deadletter])
    except Exception:  # noqa: BLE001 - best effort cleanup of uuid-named topics
        pass
    finally:
        admin.close()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes, every thread included."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks


def fleet_rate(base: Settings, uris: list[str], per_doc: int, workers: int, roots: list[str],
               partitions: int, timeout_s: float) -> tuple[float, float, int]:
    """Images/s through the broker with ``workers`` processes, the workers' CPU seconds per image, and the
    number of dead letters."""
    settings = scoped_settings(base, partitions)
    workdir = Path(tempfile.mkdtemp(prefix="bench-decode-fleet-"))
    config = workdir / "settings.json"
    config.write_text(json.dumps({
        "kafka": {"bootstrap_servers": settings.kafka.bootstrap_servers},
        "topics": settings.topics.model_dump(mode="json"),
        "decode": {**settings.decode.model_dump(mode="json"), "group_id": f"bench-{settings.topics.documents}",
                   "allowed_roots": roots},
    }))
    log_path = workdir / "fleet.log"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    with open(log_path, "wb") as log:
        fleet = subprocess.Popen([sys.executable, "-m", "vlmstream.cli", "--config", str(config), "decode",
                                  "--workers", str(workers)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
    reader = None
    try:
        deadline = time.monotonic() + 120
        while len(set(re.findall(r"decode worker (\d+): assigned", log_path.read_text()))) < workers:
            if fleet.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the fleet did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        time.sleep(1.0)  # let the cooperative rebalance settle before the clock starts
        pids = [int(p) for p in re.findall(r"worker \d+ started \(pid (\d+)\)", log_path.read_text())]
        reader = KafkaConsumer(**settings.kafka.client_kwargs(), group_id=None, auto_offset_reset="earliest",
                               enable_auto_commit=False,
                               max_partition_fetch_bytes=settings.kafka.max_message_bytes + 1024 * 1024,
                               fetch_max_bytes=max(52428800, 2 * settings.kafka.max_message_bytes))
        reader.assign([TopicPartition(settings.topics.images, p) for p in range(partitions)])
        reader.seek_to_beginning()
        reader.poll(timeout_ms=100)
        docs = [DocumentRef(doc_id=f"bench-{i}", image_uris=tuple(uris[i * per_doc:(i + 1) * per_doc]))
                for i in range(len(uris) // per_doc)]
        expected = sum(len(d.image_uris) for d in docs)
        producer = make_producer(settings)
        cpu_started = cpu_seconds(pids)
        started = time.perf_counter()
        for doc in docs:
            producer.send(settings.topics.documents, key=doc.key(), value=doc.encode(), headers=doc.headers())
        producer.flush()
        producer.close()
        seen = 0
        last = started
        end = time.monotonic() + timeout_s
        while seen < expected and time.monotonic() < end:
            for records in reader.poll(timeout_ms=200).values():
                seen += len(records)
                last = time.perf_counter()
        cpu = cpu_seconds(pids) - cpu_started
        if seen < expected:
            raise SystemExit(f"only {seen}/{expected} images arrived in {timeout_s}s:\n{log_path.read_text()[-3000:]}")
        dead = sum(reader.end_offsets([TopicPartition(settings.topics.deadletter, 0)]).values())
        return expected / (last - started), cpu / expected, dead
    finally:
        if reader is not None:
            reader.close()
        if fleet.poll() is None:
            fleet.send_signal(signal.SIGTERM)
            try:
                fleet.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(fleet.pid, signal.SIGKILL)  # its own session: the supervisor and its workers
        delete_topics(settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_dir = os.environ.get("VLMSTREAM_TEST_IMAGES") or str(REPO.parent / "shared" / "corpus")
    parser.add_argument("--images-dir", default=default_dir)
    parser.add_argument("--images", type=int, default=200, help="Images per measurement (the folder is reused).")
    parser.add_argument("--per-doc", type=int, default=4, help="Images per DocumentRef.")
    parser.add_argument("--max-pixels", type=int, default=1280 * 28 * 28)
    parser.add_argument("--codec", default="jpeg")
    parser.add_argument("--workers", default="1,2", help="Fleet sizes to measure, comma-separated.")
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args()

    folder = Path(args.images_dir).resolve()
    base = load_settings(None, {"decode": {"max_pixels": args.max_pixels, "codec": args.codec,
                                           "allowed_roots": [str(folder)]}})
    ensure_broker(base)
    uris = image_list(folder, args.images)
    print(f"folder {folder}: {len(set(uris))} files, {len(uris)} images, {args.per_doc} per document, "
          f"max_pixels {args.max_pixels}, codec {args.codec}, cpus {os.cpu_count()}, "
          f"load {os.getloadavg()[0]:.1f}")

    rate_1core, cpu_1core, failed = in_process_rate(base, uris, warmup=min(10, len(uris)))
    print(f"(a) in-process stage, 1 core: {rate_1core:7.1f} images/s  {cpu_1core * 1000:6.1f} CPU ms/image  "
          f"({failed} failed)")
    for workers in (int(w) for w in args.workers.split(",")):
        rate, cpu, dead = fleet_rate(base, uris, args.per_doc, workers, [str(folder)], args.partitions,
                                     args.timeout_s)
        print(f"(b) fleet, {workers} worker(s):       {rate:7.1f} images/s  {cpu * 1000:6.1f} CPU ms/image  "
              f"({dead} dead letters)  fleet / (in-process x {workers}) = {rate / (rate_1core * workers):.2f}  "
              f"cpu ratio = {cpu_1core / cpu:.2f}")
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
