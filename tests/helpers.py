"""Helpers that several test modules use: polling for a condition, the decode fleet as a subprocess, and real
images prepared for the inference runner on the tiny model. Broker reads are in kafka_helpers.py, the shared
fixtures in conftest.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from functools import lru_cache
from pathlib import Path

from kafka import KafkaProducer
from kafka.errors import KafkaError

from schemas import Description, ImagePayload
from tests.kafka_helpers import read_topic
from vlmstream.config import Settings

REPO = Path(__file__).resolve().parents[1]
# A few hundred visual tokens at most: quick to decode on this shared machine and quick on the CPU tiny model;
# the sizes still come from smart_resize.
SMALL = 256 * 28 * 28


def lively(tower):
    """The tower's weights redrawn at unit scale, biases and norm weights around 0.5: the tiny checkpoints'
    initializer (std 0.02, biases 0) leaves every activation's input near 0, where GELU, its tanh form and QuickGELU
    agree, and every bias 0, where a bias added twice or not at all goes unseen; these make either show."""
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in tower.parameters():
            if parameter.dim() > 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter[0].numel() ** 0.5)
            else:
                parameter.copy_(0.5 + 0.5 * torch.randn(parameter.shape, generator=generator))
    return tower


def counting(kernel, calls: list):
    """``kernel`` that appends to ``calls`` each time it runs (how tests see which kernel a tower went through)."""
    return lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs)


def wait_for(predicate, timeout_s: float, what: str, fleet: Fleet | None = None, interval_s: float = 0.3):
    """``predicate()``'s first true value, asked every ``interval_s``; an AssertionError naming ``what`` at the
    timeout, or at once when ``fleet`` (a decode fleet) has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except KafkaError:  # a loaded shared broker sometimes drops a metadata request: ask again
            value = None
        if value:
            return value
        if fleet is not None and fleet.process.poll() is not None:
            raise AssertionError(f"fleet exited ({fleet.process.returncode}) while waiting for {what}\n{fleet.log()}")
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{fleet.log() if fleet else ''}")


# --- the decode fleet ------------------------------------------------------------------------


def corpus_images(corpus_dir: Path, count: int, suffixes=(".jpg", ".jpeg", ".png", ".webp")) -> list[Path]:
    """``count`` real images, mixing formats where the folder has several (JPEG only decodes fastest: the
    machine is shared and slow, and the runner tests are about delivery, not codecs)."""
    by_format: dict[str, list[Path]] = {}
    for path in sorted(corpus_dir.rglob("*")):
        if path.suffix.lower() in suffixes:
            by_format.setdefault(path.suffix.lower().replace(".jpeg", ".jpg"), []).append(path)
    mixed: list[Path] = []
    while len(mixed) < count and any(by_format.values()):
        for paths in by_format.values():
            if paths and len(mixed) < count:
                mixed.append(paths.pop(0))
    while len(mixed) < count:  # a small folder: reuse its images
        mixed.append(mixed[len(mixed) % max(1, len(mixed))])
    return mixed


class Fleet:
    """`vlmstream decode` in a subprocess, its log in a file (the supervisor logs each worker's pid)."""

    def __init__(self, settings: Settings, tmp_path: Path, *args: str, decode: dict | None = None,
                 kafka: dict | None = None, producer: dict | None = None, metrics_port: int = 0):
        self.settings = settings
        self.group_id = f"decode-test-{settings.topics.documents}"
        config = {
            "kafka": {"bootstrap_servers": settings.kafka.bootstrap_servers, **(kafka or {})},
            "topics": settings.topics.model_dump(mode="json"),
            "decode": {"group_id": self.group_id, "session_timeout_ms": 6000, **(decode or {})},
            "producer": producer or {},
            "metrics_port": metrics_port,
        }
        config_file = tmp_path / f"decode-{len(list(tmp_path.glob('decode-*.json')))}.json"
        config_file.write_text(json.dumps(config))
        self.log_file = config_file.with_suffix(".log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLMSTREAM_") or k == "VLMSTREAM_HOME"}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        with open(self.log_file, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "vlmstream.cli", "--config", str(config_file), "decode", *args],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def worker_pids(self, index: int) -> list[int]:
        return [int(p) for i, p in re.findall(r"worker (\d+) started \(pid (\d+)\)", self.log()) if int(i) == index]

    def assigned_workers(self) -> set[int]:
        return {int(i) for i in re.findall(r"decode worker (\d+): assigned", self.log())}

    def documents_per_worker(self) -> dict[int, int]:
        counts: dict[int, int] = Counter()
        for index, docs in re.findall(r"decode worker (\d+) stopped: (\d+) documents", self.log()):
            counts[int(index)] += int(docs)
        return counts

    def wait(self, timeout_s: float = 60) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"fleet did not exit within {timeout_s}s\n{self.log()}") from None

    def kill(self) -> None:
        """The supervisor and its workers (their own session, so nothing else is touched)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def stop(self, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait(timeout_s)

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()  # also any worker left behind by a failed test


# --- inference on the tiny model -----------------------------------------------------------------


@lru_cache(maxsize=1)
def smallest_exact_size_images(corpus_dir: Path, count: int, max_pixels: int) -> list:
    """The ``count`` smallest corpus images (JPEG, PNG, WebP) at their exact smart_resize size under ``max_pixels``,
    as the decode stage hands them to an engine."""
    import numpy as np
    from PIL import Image

    from consumers.decode.resize import resize_exact
    from vlmstream.models.qwen2_vl import smart_resize

    files = sorted((p for p in Path(corpus_dir).rglob("*") if p.suffix.lower() in (".jpg", ".png", ".webp")),
                   key=lambda p: p.stat().st_size)[:count]
    out = []
    for path in files:
        rgb = np.asarray(Image.open(path).convert("RGB"))
        height, width = smart_resize(rgb.shape[0], rgb.shape[1], max_pixels=max_pixels)
        out.append(np.ascontiguousarray(resize_exact(rgb, height, width)))
    return out


def prepared_corpus(corpus_dir: str, count: int = 8) -> tuple:
    """Real corpus images through the real decode stage at a small pixel budget."""
    from consumers.decode.stage import DecodeStage
    from vlmstream.config import DecodeSettings

    files = sorted(p for p in Path(corpus_dir).rglob("*") if p.suffix.lower() in (".jpg", ".png", ".webp"))
    # The smallest files decode fastest on this 2-core machine; the set still mixes formats.
    files = sorted(files, key=lambda p: p.stat().st_size)[:count]
    stage = DecodeStage(DecodeSettings(max_pixels=SMALL, allowed_roots=[corpus_dir], codec="jpeg"))
    out = []
    try:
        for path in files:
            prepared = stage(str(path))
            assert not hasattr(prepared, "error_kind"), prepared
            out.append((str(path), prepared))
    finally:
        stage.close()
    return tuple(out)


def payload_record(doc_id: str, index: int, count: int, uri: str, prepared, **meta_changes):
    meta = ImagePayload(doc_id=doc_id, image_index=index, image_count=count, source_uri=uri, codec=prepared.codec,
                        width=prepared.width, height=prepared.height, grid_thw=tuple(prepared.grid_thw),
                        orig_width=prepared.orig_width, orig_height=prepared.orig_height,
                        payload_bytes=len(prepared.data), decode_ms=prepared.decode_ms,
                        metadata={"case": doc_id})
    meta = dataclasses.replace(meta, **meta_changes)
    return meta, prepared.data


def produce_images(settings: Settings, records, partition: int | None = None) -> None:
    producer = KafkaProducer(**settings.kafka.client_kwargs(), max_request_size=settings.kafka.max_message_bytes)
    try:
        for meta, value in records:
            producer.send(settings.topics.images, key=meta.key(), value=value, headers=meta.headers(),
                          partition=partition)
        producer.flush()
    finally:
        producer.close()


def documents(corpus_dir, prefix: str, sizes: list[int]):
    """Documents of ``sizes`` images each, cycling through the prepared corpus."""
    corpus = prepared_corpus(str(corpus_dir))
    records, k = [], 0
    for d, size in enumerate(sizes):
        for i in range(size):
            uri, prepared = corpus[k % len(corpus)]
            k += 1
            records.append(payload_record(f"{prefix}-{d}", i, size, uri, prepared))
    return records


def infer_settings(settings: Settings, unique: str, **changes) -> Settings:
    infer = settings.infer.model_copy(update={"group_id": f"test-infer-{unique}", "max_new_tokens": 8,
                                              "batch_size": 4, "max_images_in_flight": 8, **changes})
    return settings.model_copy(update={"infer": infer})


@lru_cache(maxsize=1)
def tiny_model_dir() -> str:
    from consumers.infer.tiny_model import default_tiny_model_dir

    return str(default_tiny_model_dir())


def real_engine(settings: Settings):
    from consumers.infer.factory import make_engine

    return make_engine(settings.infer.model_copy(update={"engine": "transformers"}), tiny_model_dir())


def run_until_idle(settings: Settings, engine, **kwargs):
    from consumers.infer.runner import InferenceRunner

    runner = InferenceRunner(settings, engine, **kwargs)
    assert runner.run(threading.Event(), max_seconds=150, until_idle_s=2.5) == 0
    return runner


def run_env(settings: Settings, tmp_path: Path, group_prefix: str, partitions: int, **extra: str) -> dict[str, str]:
    """The environment of a `vlmstream run` subprocess on one test's uuid topics: its own consumer groups
    (``group_prefix``-decode/-infer), its own producer ledger under ``tmp_path``, small batches on one OpenMP thread;
    ``extra`` adds settings."""
    t = settings.topics
    return dict(os.environ,
                VLMSTREAM_TOPICS__DOCUMENTS=t.documents, VLMSTREAM_TOPICS__IMAGES=t.images,
                VLMSTREAM_TOPICS__DESCRIPTIONS=t.descriptions, VLMSTREAM_TOPICS__EMBEDDINGS=t.embeddings,
                VLMSTREAM_TOPICS__RESULTS=t.results, VLMSTREAM_TOPICS__DEADLETTER=t.deadletter,
                VLMSTREAM_TOPICS__PARTITIONS=str(partitions),
                VLMSTREAM_DECODE__GROUP_ID=f"{group_prefix}-decode", VLMSTREAM_INFER__GROUP_ID=f"{group_prefix}-infer",
                VLMSTREAM_PRODUCER__STATE_DIR=str(tmp_path / "ledger"),
                VLMSTREAM_INFER__BATCH_SIZE="4", OMP_NUM_THREADS="1", **extra)


def subprocess_env(settings: Settings) -> dict[str, str]:
    t, i = settings.topics, settings.infer
    env = dict(os.environ)
    env.update({f"VLMSTREAM_TOPICS__{k.upper()}": getattr(t, k) for k in
                ("documents", "images", "descriptions", "embeddings", "results", "deadletter")})
    env.update({"VLMSTREAM_INFER__GROUP_ID": i.group_id, "VLMSTREAM_INFER__MAX_NEW_TOKENS": str(i.max_new_tokens),
                "VLMSTREAM_INFER__BATCH_SIZE": str(i.batch_size), "VLMSTREAM_INFER__ENGINE": "transformers",
                "VLMSTREAM_INFER__MODEL": tiny_model_dir(), "PYTHONUNBUFFERED": "1"})
    if i.max_images_in_flight is not None:  # unset: the engine's own window (InferSettings.images_in_flight)
        env["VLMSTREAM_INFER__MAX_IMAGES_IN_FLIGHT"] = str(i.max_images_in_flight)
    return env


def description_counts(settings: Settings, expected: int | None = None, timeout_s: float = 30.0,
                       read_committed: bool = False) -> Counter:
    records = read_topic(settings, settings.topics.descriptions, expected=expected, timeout_s=timeout_s,
                         idle_s=1.0, read_committed=read_committed)
    return Counter((d.doc_id, d.image_index) for d in (Description.decode(r.value) for r in records))
