"""Stopping when the cluster is gone: a stage started against a broker of this test's own (other ports, its own
home), the broker killed, then SIGTERM. The stage must exit within its stated bound, with a non-zero status when it
could not flush, and must have committed nothing past what reached the broker (checked once the broker is back)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kafka import KafkaProducer

from schemas import DocumentRef, now
from tests.helpers import REPO, Fleet, subprocess_env, tiny_model_dir, wait_for
from tests.kafka_helpers import committed_offsets, end_offsets, read_topic
from vlmstream.broker import BrokerError, lifecycle
from vlmstream.broker.jars import jar_dir
from vlmstream.broker.node import broker_answers, broker_paths
from vlmstream.config import Settings

REQUEST_TIMEOUT_MS = 8_000  # the bound of every wait on the cluster, short for the test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnBroker:
    """A single-node broker on free ports under ``home`` (the shared jars linked in), killable at will."""

    def __init__(self, home: Path, base: Settings):
        jars = jar_dir(base.broker)
        home.mkdir(parents=True, exist_ok=True)
        if jars.is_dir():
            (home / jars.name).symlink_to(jars)
        port, controller = _free_port(), _free_port()
        self.settings = base.model_copy(update={
            "broker": base.broker.model_copy(update={"home": home, "port": port, "controller_port": controller}),
            "kafka": base.kafka.model_copy(update={"bootstrap_servers": f"127.0.0.1:{port}",
                                                   "request_timeout_ms": REQUEST_TIMEOUT_MS}),
        })

    def start(self) -> None:
        try:
            lifecycle.start(self.settings)
        except BrokerError:  # a slow start can be reported early; it counts once it answers
            wait_for(lambda: broker_answers(self.settings.kafka.bootstrap_servers), 60, "own broker")

    def kill(self) -> None:
        pid = int(broker_paths(self.settings.broker).pid_file.read_text().strip())
        os.kill(pid, signal.SIGKILL)

        def gone() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return Path(f"/proc/{pid}/status").read_text().find("zombie") >= 0

        wait_for(gone, 30, "the broker gone", interval_s=0.05)

    def stop(self) -> None:
        try:
            lifecycle.stop(self.settings, reason="test_stopping: the test's own broker, at its end")
        except Exception:  # noqa: BLE001 - already killed
            pass


@pytest.fixture
def own_broker(tmp_path_factory, kafka_settings):
    from vlmstream.kafka.topics import create_topics

    own = OwnBroker(tmp_path_factory.mktemp("broker-home"), kafka_settings)
    own.start()
    try:
        create_topics(own.settings)
        yield own
    finally:
        own.stop()


def _uris(corpus_dir: Path, count: int) -> list[str]:
    files = sorted(p for p in corpus_dir.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp"))
    return [str(files[i % len(files)]) for i in range(count)]


def _publish_documents(settings: Settings, docs: list[DocumentRef]) -> None:
    producer = KafkaProducer(**settings.kafka.client_kwargs())
    try:
        for doc in docs:
            producer.send(settings.topics.documents, key=doc.key(), value=doc.encode(), headers=doc.headers())
        producer.flush()
    finally:
        producer.close()


def _committed(settings: Settings, group_id: str, topic: str) -> dict[int, int]:
    """The group's committed offsets once the restarted broker's coordinator answers (it loads the offsets first)."""
    return wait_for(lambda: [committed_offsets(settings, group_id, topic)], 60, "the group coordinator")[0]


def _assert_committed_only_what_was_flushed(settings: Settings, group_id: str, docs: list[DocumentRef]) -> int:
    """Every document below a committed offset has all its images (or dead letters) on the broker. Returns how
    many documents were committed."""
    by_id = {d.doc_id: d for d in docs}
    records = read_topic(settings, settings.topics.documents, timeout_s=20, idle_s=1.0)
    committed = _committed(settings, group_id, settings.topics.documents)
    images = {r.key.decode() for r in read_topic(settings, settings.topics.images, timeout_s=30, idle_s=2.0)}
    letters = read_topic(settings, settings.topics.deadletter, timeout_s=10, idle_s=1.0)
    lettered = {r.key.decode() for r in letters if r.key}
    done = 0
    for record in records:
        if record.offset >= committed.get(record.partition, 0):
            continue
        doc = by_id[record.key.decode()]
        missing = [i for i in range(len(doc.image_uris))
                   if f"{doc.doc_id}/{i}" not in images and doc.doc_id not in lettered]
        assert not missing, f"{doc.doc_id} committed at offset {record.offset} without images {missing}"
        done += 1
    return done


@pytest.mark.kafka
def test_the_decode_fleet_stops_within_its_bound_when_the_cluster_is_gone(own_broker, tmp_path, corpus_dir, unique):
    from consumers.decode.runner import worker_drain_bound_s

    settings = own_broker.settings
    docs = [DocumentRef(doc_id=f"stop-{unique}-{d}", image_uris=tuple(_uris(corpus_dir, 6)), published_at=now())
            for d in range(16)]
    _publish_documents(settings, docs)
    with Fleet(settings, tmp_path, "--workers", "2", "--allowed-root", str(corpus_dir),
               kafka={"request_timeout_ms": REQUEST_TIMEOUT_MS}) as fleet:
        # Large images: the workers are in the middle of documents, with outputs sent and not all flushed.
        wait_for(lambda: sum(end_offsets(settings, settings.topics.images).values()) >= 10, 180,
                 "the first images", fleet=fleet)
        own_broker.kill()
        stopped_at = time.monotonic()
        fleet.process.send_signal(signal.SIGTERM)
        bound = worker_drain_bound_s(settings) + 30  # + the document in hand (6 large images, 2 cores shared)
        code = fleet.wait(timeout_s=bound + 30)
        took = time.monotonic() - stopped_at
        log = fleet.log()
    print(f"decode fleet: exit {code} {took:.1f} s after SIGTERM with the broker gone (bound {bound:.0f} s)")
    assert took <= bound, f"stopped after {took:.0f} s, bound {bound:.0f} s\n{log[-6000:]}"
    assert code != 0, log[-6000:]  # it could not flush (or commit): never a clean exit
    assert "not committing" in log or "without commit" in log, log[-6000:]
    own_broker.start()
    _assert_committed_only_what_was_flushed(settings, fleet.group_id, docs)


@pytest.mark.kafka
@pytest.mark.model
def test_the_inference_process_stops_within_its_bound_and_exits_cleanly_when_the_cluster_is_gone(
        own_broker, tmp_path, corpus_dir, unique):
    """`vlmstream infer` (runner, tiny transformers engine, results aggregator) loses the cluster with images in
    hand: it must stop within its bound, say it did not commit, and exit with a status of its own, not SIGABRT
    ("terminate called without an active exception": a torch thread still running at interpreter teardown)."""
    from tests.helpers import documents, produce_images, infer_settings

    settings = infer_settings(own_broker.settings, unique, max_new_tokens=48)
    produce_images(settings, documents(corpus_dir, f"stop-{unique}", [4] * 8))
    env = subprocess_env(settings)
    env = {k: v for k, v in env.items() if not k.startswith("VLMSTREAM_KAFKA") and not k.startswith("VLMSTREAM_BROKER")}
    env.update({"VLMSTREAM_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
                "VLMSTREAM_KAFKA__REQUEST_TIMEOUT_MS": str(REQUEST_TIMEOUT_MS),
                "VLMSTREAM_INFER__MODEL": tiny_model_dir()})
    log_file = tmp_path / "infer.log"
    with open(log_file, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vlmstream.cli", "infer"], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: sum(end_offsets(settings, settings.topics.descriptions).values()) >= 2 or proc.poll(),
                 240, "the first descriptions")
        assert proc.poll() is None, log_file.read_text()[-6000:]
        own_broker.kill()
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # The engine's drain (tiny model: seconds) + runner flush/commit/close + aggregator, each wait bounded by
        # kafka.request_timeout_ms: 3 for the runner, 3 for the aggregator.
        bound = 6 * REQUEST_TIMEOUT_MS / 1000 + 60
        try:
            code = proc.wait(timeout=bound + 60)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - stopped_at
        print(f"inference process: exit {code} {took:.1f} s after SIGTERM with the broker gone (bound {bound:.0f} s)")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = log_file.read_text(errors="replace")
    assert code is not None and took <= bound, f"stopped after {took:.0f} s (bound {bound:.0f} s)\n{log[-6000:]}"
    assert "terminate called" not in log and code > 0, f"exit {code}\n{log[-6000:]}"
    assert "kafka.request_timeout_ms" in log and settings.kafka.bootstrap_servers in log, log[-6000:]
    own_broker.start()
    committed = _committed(settings, settings.infer.group_id, settings.topics.images)
    described = {(r.key, r.offset) for r in read_topic(settings, settings.topics.descriptions, timeout_s=20,
                                                        idle_s=1.0)}
    # Whatever was committed was described first (the descriptions reached the broker before the commit).
    assert sum(committed.values()) <= len(described), (committed, len(described))


def _children_of(pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


@pytest.mark.kafka
@pytest.mark.model
def test_vlmstream_run_stops_its_workers_on_sigterm_when_the_cluster_is_gone(own_broker, tmp_path, corpus_dir):
    """`vlmstream run` used to die at SIGTERM at once (no handler) and leave its decode and inference workers
    running in their own sessions, the decode workers crash-looping against the gone cluster."""
    from vlmstream.cli.run_workers import STOP_GRACE_S

    settings = own_broker.settings
    folder = tmp_path / "docs"
    folder.mkdir()
    # Enough documents that the run is still at work when the broker goes: the tiny model describes a few images
    # within the 5 s below, and a run that finished first would be stopping already when SIGTERM comes.
    for i, path in enumerate(_uris(corpus_dir, 48)):
        (folder / f"{i:02d}-{Path(path).name}").write_bytes(Path(path).read_bytes())
    b = settings.broker
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLMSTREAM_")}
    env.update({"VLMSTREAM_HOME": str(b.home), "VLMSTREAM_BROKER__PORT": str(b.port),
                "VLMSTREAM_BROKER__CONTROLLER_PORT": str(b.controller_port),
                "VLMSTREAM_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
                "VLMSTREAM_KAFKA__REQUEST_TIMEOUT_MS": str(REQUEST_TIMEOUT_MS),
                "VLMSTREAM_INFER__MODEL": tiny_model_dir(), "VLMSTREAM_PRODUCER__STATE_DIR": str(tmp_path / "ledger"),
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    log_file = tmp_path / "run.log"
    with open(log_file, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vlmstream.cli", "run", str(folder), "--per-file", "--fresh",
                                 "--decode-workers", "1", "--max-pixels", str(128 * 28 * 28)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    workers: set[int] = set()
    try:
        wait_for(lambda: "workers started" in log_file.read_text(errors="replace") or proc.poll() is not None, 180,
                 "the workers started")
        assert proc.poll() is None, log_file.read_text()[-4000:]
        workers = _children_of(proc.pid)
        assert len(workers) == 2, workers
        time.sleep(5)  # the workers are connecting and loading
        own_broker.kill()
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=STOP_GRACE_S + 60)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - stopped_at
        print(f"vlmstream run: exit {code} {took:.1f} s after SIGTERM with the broker gone")
        left = {pid for pid in workers if Path(f"/proc/{pid}").exists()
                and "zombie" not in Path(f"/proc/{pid}/status").read_text()}
    finally:
        for pid in [proc.pid, *workers]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    log = log_file.read_text(errors="replace")
    assert code is not None and took <= STOP_GRACE_S + 10, f"{took:.0f} s\n{log[-4000:]}"
    assert not left, f"workers {left} outlived `vlmstream run`\n{log[-4000:]}"
    assert "stopped by SIGTERM" in log and code == 143, log[-4000:]
    worker_logs = "".join(p.read_text(errors="replace") for p in (Path(b.home) / "logs").glob("*.log"))
    assert "terminate called" not in worker_logs


_DRAINS_IN_2_S = ("import signal, sys, time\n"
                  "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2), sys.exit(0)))\n"
                  "print('ready', flush=True)\n"
                  "time.sleep(60)\n")


def _stop_a_draining_worker_while_signalled(log_dir: Path, earlier: int | None) -> tuple[dict, list[int]]:
    """`vlmstream run` stopping a worker that takes 2 s to drain (its stop policy installed, ``earlier`` a signal it
    had before), a SIGTERM reaching `vlmstream run` 0.5 s in. Returns the exit codes and the run's signals."""
    from vlmstream.cli.run_workers import Workers
    from vlmstream.stopping import Stop

    worker = subprocess.Popen([sys.executable, "-c", _DRAINS_IN_2_S], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert worker.stdout.readline().strip() == "ready"
    workers = Workers(Settings(), (), log_dir)
    workers.procs["worker"] = worker
    stop = Stop("vlmstream run", now=workers.kill).install()
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        if earlier is not None:
            os.kill(os.getpid(), earlier)
            wait_for(lambda: stop.signals, 5, "the earlier signal handled", interval_s=0.01)
        timer.start()
        return workers.stop(stop, grace_s=30), list(stop.signals)
    finally:
        timer.join()
        stop.restore()
        if worker.poll() is None:
            worker.kill()
        worker.wait()
        worker.stdout.close()


def test_a_first_sigterm_while_a_finished_run_stops_its_workers_lets_them_drain(tmp_path):
    """A run whose documents were all described stops its workers; a SIGTERM then is the run's first signal: the
    workers drain (exit 0) and the run reports the signal, instead of killing them as a second signal does."""
    codes, signals = _stop_a_draining_worker_while_signalled(tmp_path, None)
    assert codes == {"worker": 0} and signals == [signal.SIGTERM]


def test_a_second_signal_while_the_workers_drain_stops_them_at_once(tmp_path):
    codes, signals = _stop_a_draining_worker_while_signalled(tmp_path, signal.SIGINT)
    assert codes == {"worker": -signal.SIGKILL} and signals == [signal.SIGINT, signal.SIGTERM]


def _descendants(root: int) -> dict[int, str]:
    """{pid: command line} of every process below ``root`` (children, their children, ...), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {}, {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in found}
        for pid in frontier:
            try:
                found[pid] = (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return found


def _still_running(processes: dict[int, str]) -> dict[int, str]:
    """Those of ``processes`` still running (not gone, not a zombie, not another process under a reused pid)."""
    left = {}
    for pid, cmdline in processes.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            now_cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "zombie" not in status and now_cmdline == cmdline:
            left[pid] = cmdline
    return left


@pytest.mark.kafka
@pytest.mark.model
def test_the_workers_of_a_sigkilled_run_stop_with_it(kafka_settings, corpus_dir, tmp_path):
    """`kill -9` of `vlmstream run` mid-run: its decode and inference workers, and the decode fleet's worker
    processes, see their parent gone (the kernel's PR_SET_PDEATHSIG, or their watchdog), drain (bounded) and exit;
    none is left running."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, path in enumerate(_uris(corpus_dir, 200)):  # enough that the run is still at work when it is killed
        (folder / f"{i:03d}-{Path(path).name}").write_bytes(Path(path).read_bytes())
    env = dict(os.environ, VLMSTREAM_PRODUCER__STATE_DIR=str(tmp_path / "ledger"),
               VLMSTREAM_INFER__MODEL=tiny_model_dir(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log_file = tmp_path / "run.log"
    with open(log_file, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vlmstream.cli", "run", str(folder), "--per-file", "--fresh",
                                 "--decode-workers", "1", "--max-pixels", str(128 * 28 * 28), "--show", "0"],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    workers: dict[int, str] = {}
    try:
        # Running: the inference process has loaded its model and joined its group, decode is at work.
        wait_for(lambda: re.search(r"inference: \d+ images waiting", log_file.read_text(errors="replace"))
                 or proc.poll() is not None, 300, "inference at work")
        assert proc.poll() is None, log_file.read_text()[-4000:]
        workers = _descendants(proc.pid)
        # the decode fleet, its worker process, and the inference process at least
        assert len(workers) >= 3 and any(" infer" in c for c in workers.values()), workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed_at = time.monotonic()
        bound = 120  # the inference process drains what it holds (tiny model), the aggregator at most 30 s
        try:
            wait_for(lambda: not _still_running(workers), bound, "the workers gone", interval_s=0.5)
        except AssertionError:
            pass
        left = _still_running(workers)
        print(f"workers of a SIGKILLed run: {len(workers)}, still running {time.monotonic() - killed_at:.0f} s "
              f"later: {len(left)}")
    finally:
        for pid in [proc.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    assert not left, f"workers {left} outlived `vlmstream run`\n{log_file.read_text()[-3000:]}"
