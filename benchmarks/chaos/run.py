"""Chaos run: the whole pipeline on a local 3-node cluster under a seeded schedule of faults, then the independent
checker (``benchmarks/chaos/checker.py``).

    python -m benchmarks.chaos.run --docs 500 --faults 30 --mode exactly-once
    python -m benchmarks.chaos.run --docs 500 --faults 30 --mode at-least-once

Each stage runs as processes started here (``python -m vlmstream.cli produce --watch / decode / infer`` with a
settings file naming the cluster, uuid-named topics and groups); a supervisor loop restarts whatever exits, as a
process manager would. The producer follows a JSON-lines manifest that a feeder thread appends to over the fault
window, so every fault lands under load. Faults, seeded: SIGKILL of any worker of any stage (producer, decode
supervisor, decode worker, inference consumer with its results aggregator); SIGSTOP of a decode worker or an
inference consumer past its session timeout, then SIGCONT (a zombie waking after its partitions moved); kill -9 of
the broker leading the most partitions, and of the active controller; a broker restarted on a data folder that fell
behind (a copy taken earlier); a rolling restart of all three brokers. Broker faults wait until every partition is
fully replicated again, so at most one node is ever down.

At the end: the checker's table, and for at-least-once the bound on duplicates computed from the settings and the
faults that happened (printed next to what the checker counted). Exit 1 when the checker fails or duplicates pass
the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.chaos import checker  # noqa: E402
from benchmarks.chaos.cluster import Cluster, fully_replicated, most_leading_node, pid_alive  # noqa: E402
from benchmarks.chaos.corpus import make_plan, save_plan  # noqa: E402

PYTHON = sys.executable
WORKER_KILLS = ("kill_producer", "kill_decode_worker", "kill_decode_fleet", "kill_infer")
ZOMBIES = ("zombie_decode", "zombie_infer")
BROKER_FAULTS = ("kill_leader_broker", "kill_controller", "stale_restart", "rolling_restart")
KINDS = WORKER_KILLS + ZOMBIES + BROKER_FAULTS


@dataclass
class Knobs:
    """The settings the duplicate bound is computed from (written into the settings file)."""

    partitions: int = 6
    decode_workers: int = 2
    infer_consumers: int = 2
    max_poll_records: int = 4
    decode_commit_interval_s: float = 0.0  # at-least-once: flush + commit after every polled batch
    session_timeout_ms: int = 6000
    max_images_in_flight: int = 8
    infer_batch_size: int = 4
    max_new_tokens: int = 4
    max_pixels: int = 64 * 28 * 28


def settings_toml(knobs: Knobs, *, bootstrap: str, prefix: str, exactly_once: bool, home: Path, work: Path,
                  model: Path, corpus: Path | None) -> str:
    roots = [str(work)] + ([str(corpus)] if corpus else [])
    topics = "\n".join(f'{role} = "{prefix}.{role}"' for role in checker.ROLES)
    return f"""
log_level = "INFO"
[kafka]
bootstrap_servers = "{bootstrap}"
request_timeout_ms = 15000
[topics]
{topics}
partitions = {knobs.partitions}
replication_factor = 3
[broker]
home = "{home}"
[producer]
state_dir = "{work / 'producer-state'}"
linger_ms = 5
[decode]
group_id = "{prefix}-decode"
workers = {knobs.decode_workers}
max_pixels = {knobs.max_pixels}
min_pixels = {28 * 28 * 4}
allowed_roots = {json.dumps(roots)}
exactly_once = {str(exactly_once).lower()}
max_poll_records = {knobs.max_poll_records}
commit_interval_s = {knobs.decode_commit_interval_s}
session_timeout_ms = {knobs.session_timeout_ms}
claim_check_url = "{work / 'claim-check'}"
[infer]
group_id = "{prefix}-infer"
engine = "transformers"
model = "{model}"
max_new_tokens = {knobs.max_new_tokens}
max_images_in_flight = {knobs.max_images_in_flight}
batch_size = {knobs.infer_batch_size}
session_timeout_ms = {knobs.session_timeout_ms}
exactly_once = {str(exactly_once).lower()}
"""


@dataclass
class Proc:
    role: str
    slot: int
    argv: list[str]
    popen: subprocess.Popen | None = None
    incarnation: int = 0
    exits: list[int] = field(default_factory=list)
    stopped: bool = False  # SIGSTOPped by a zombie fault: not a crash


class Supervisor:
    """Starts every stage's processes and restarts any that exits, like a process manager would."""

    def __init__(self, env: dict[str, str], logs: Path, log_event):
        self.env, self.logs, self.log_event = env, logs, log_event
        self.procs: list[Proc] = []
        # Every process group ever started (one per incarnation): a killed decode supervisor's workers keep its
        # group, and any that outlive it must not outlive the run.
        self.groups: list[tuple[str, int]] = []
        self.running = True
        self._lock = threading.Lock()

    def add(self, role: str, slot: int, argv: list[str]) -> Proc:
        proc = Proc(role, slot, argv)
        self.procs.append(proc)
        self._start(proc)
        return proc

    def _start(self, proc: Proc) -> None:
        proc.incarnation += 1
        out = open(self.logs / f"{proc.role}-{proc.slot}.log", "ab")
        out.write(f"\n===== incarnation {proc.incarnation} at {time.strftime('%H:%M:%S')} =====\n".encode())
        out.flush()
        proc.popen = subprocess.Popen([PYTHON, "-m", "vlmstream.cli", *proc.argv], env=self.env, cwd=REPO,
                                      stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        self.groups.append((f"{proc.role}-{proc.slot}#{proc.incarnation}", proc.popen.pid))
        out.close()

    def loop_once(self) -> None:
        with self._lock:
            for proc in self.procs:
                if not self.running or proc.popen is None or proc.popen.poll() is None:
                    continue
                code = proc.popen.returncode
                proc.exits.append(code)
                self.log_event("restart", f"{proc.role}-{proc.slot} exited {code}; restarting")
                time.sleep(0.5)
                self._start(proc)

    def pick(self, role: str, rng: random.Random) -> Proc | None:
        live = [p for p in self.procs if p.role == role and p.popen is not None and p.popen.poll() is None]
        return rng.choice(live) if live else None

    def leftovers(self) -> dict[str, list[int]]:
        """Processes still alive in the groups of earlier incarnations (orphans of a killed supervisor)."""
        current = {p.popen.pid for p in self.procs if p.popen is not None}
        out: dict[str, list[int]] = {}
        for name, pgid in self.groups:
            if pgid in current:
                continue
            alive = [pid for pid in _group_members(pgid)]
            if alive:
                out[name] = alive
        return out

    def stop_all(self, timeout_s: float = 60.0) -> None:
        with self._lock:
            self.running = False
        for proc in self.procs:
            if proc.popen is not None and proc.popen.poll() is None:
                try:
                    os.kill(proc.popen.pid, signal.SIGCONT)
                    proc.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            if proc.popen is None:
                continue
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
        # The decode fleet's workers are in its group: none may outlive the run, of any incarnation.
        for _name, pgid in self.groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def decode_worker_pids(fleet_pid: int) -> list[int]:
    """The fleet's worker processes (multiprocessing spawn also starts a resource tracker: skip it)."""
    out = []
    for pid in children(fleet_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
            out.append(pid)
    return out


def schedule(rng: random.Random, total: int, allowed: list[str], *, in_order: bool = False) -> list[str]:
    """At least one of every allowed kind, at least 5 broker faults when total >= 30, the rest drawn at random
    (worker faults twice as likely as a broker kill). ``in_order``: the allowed kinds first, in the order given,
    then the drawn ones shuffled."""
    unknown = set(allowed) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    kinds = list(allowed)
    quick_broker = [k for k in ("kill_leader_broker", "kill_controller") if k in allowed]
    if total >= 30:
        kinds += quick_broker
    draw = [k for k in WORKER_KILLS + ZOMBIES if k in allowed] * 2 + quick_broker
    extra = []
    while len(kinds) + len(extra) < total:
        extra.append(rng.choice(draw))
    if in_order:
        rng.shuffle(extra)
        return kinds + extra
    kinds += extra
    rng.shuffle(kinds)
    return kinds


class ChaosRun:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.exactly_once = args.mode == "exactly-once"
        self.rng = random.Random(args.seed)
        self.run_id = f"chaos-{uuid.uuid4().hex[:8]}"
        self.home = Path(args.home)
        self.work = self.home / self.run_id
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.events: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.knobs = Knobs(max_poll_records=args.max_poll_records)
        self.cluster = Cluster(self.home, base_port=args.base_port, heap=args.heap)
        self.corpus = Path(args.corpus) if args.corpus and Path(args.corpus).is_dir() else None

    def event(self, kind: str, detail: str) -> None:
        t = time.monotonic() - self.started
        self.events.append({"t": round(t, 1), "kind": kind, "detail": detail})
        line = f"[{t:7.1f}s] {kind:<20} {detail}"
        print(line, flush=True)
        with open(self.work / "events.log", "a") as fh:
            fh.write(line + "\n")

    # --- setup -----------------------------------------------------------------------------------

    def setup(self) -> None:
        args = self.args
        self.plan = make_plan(self.work, args.docs, seed=args.seed, run_id=self.run_id, corpus=self.corpus)
        save_plan(self.plan, self.work / "plan.json")
        self.event("plan", f"{args.docs} documents, {self.plan['images']} images (1-{self.plan['max_images_per_doc']}"
                   f" per document), {self.plan['planted_images']} planted bad images, "
                   f"{self.plan['bad_manifest_lines']} bad manifest lines")
        model = self.home / "tiny-model"
        if not (model / "config.json").exists():
            subprocess.run([PYTHON, "-m", "vlmstream.cli", "tiny-model", str(model)], cwd=REPO, check=True,
                           env=self.base_env(), stdout=subprocess.DEVNULL)
        t = time.monotonic()
        self.bootstrap = self.cluster.start()
        self.event("cluster", f"3 nodes up in {time.monotonic() - t:.0f} s via {self.cluster.backend}: {self.bootstrap}")
        self.settings_file = self.work / "settings.toml"
        self.settings_file.write_text(settings_toml(
            self.knobs, bootstrap=self.bootstrap, prefix=self.run_id, exactly_once=self.exactly_once, home=self.home,
            work=self.work, model=model, corpus=self.corpus))
        self.topics = checker.topic_names(self.run_id)
        self._create_topics()

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLMSTREAM_")}
        env.update({"VLMSTREAM_HOME": str(self.home), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        return env

    def _create_topics(self) -> None:
        from vlmstream.config import load_settings
        from vlmstream.kafka.topics import TopicSpec, create_topics, pipeline_topic_specs

        settings = load_settings(self.settings_file)
        # min.insync.replicas=2 on every topic: an acknowledged record is on two nodes, so one node's kill -9 (or
        # a restart on stale data) cannot take it away.
        specs = [TopicSpec(s.name, s.partitions, s.replication_factor, {**s.configs, "min.insync.replicas": "2"})
                 for s in pipeline_topic_specs(settings)]
        create_topics(settings, specs)

    # --- the run ---------------------------------------------------------------------------------

    def start_pipeline(self) -> None:
        env = {**self.base_env(), "VLMSTREAM_CONFIG": str(self.settings_file)}
        self.supervisor = Supervisor(env, self.logs, self.event)
        self.manifest = self.work / "manifest.jsonl"
        self.manifest.write_text("")
        sup = self.supervisor
        sup.add("producer", 0, ["produce", "--manifest", str(self.manifest), "--watch", "--quiet", "--settle-s", "0.5"])
        sup.add("decode", 0, ["decode", "--workers", str(self.knobs.decode_workers)])
        for i in range(self.knobs.infer_consumers):
            sup.add("infer", i, ["infer"])

    def feeder(self, stop: threading.Event, total_faults: int) -> None:
        """Appends manifest lines all through the fault schedule: by fault i, about 1.5 (i + 1) / total of them (a backlog in the first two thirds), a few
        each second, so every fault meets documents on their way."""
        lines = self.plan["lines"]
        self.feed_chunk = per_tick = len(lines) if self.args.feed_all else max(2, len(lines) // 60)
        fed = 0
        with open(self.manifest, "a") as fh:
            while fed < len(lines) and not stop.is_set():
                target = (len(lines) if self.args.feed_all else
                          int(len(lines) * min(1.0, 1.5 * (len(self.faults) + 1) / max(1, total_faults))))
                if target > fed:
                    for line in lines[fed:min(target, fed + per_tick)]:
                        fh.write(line + "\n")
                    fh.flush()
                    fed = min(target, fed + per_tick)
                stop.wait(1.0)
        self.event("feeder", f"{fed} of {len(lines)} manifest lines written")

    def results_done(self) -> int:
        """Documents with any result so far (cheap progress probe, the checker decides at the end)."""
        records, _ = checker.read_topic(self.bootstrap, self.topics["results"], idle_s=2.0, limit_s=30)
        from schemas import DocumentResult

        ids = set()
        for r in records:
            try:
                ids.add(DocumentResult.decode(r.value).doc_id)
            except Exception:  # noqa: BLE001
                pass
        return len(ids & {d["doc_id"] for d in self.plan["documents"]})

    def supervise_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.supervisor.loop_once()
            time.sleep(0.3)

    def wait_replicated(self, limit_s: float = 120.0) -> bool:
        deadline = time.monotonic() + limit_s
        topics = list(self.topics.values())
        while time.monotonic() < deadline:
            if all(self.cluster.node_pids().values()) and fully_replicated(self.bootstrap, topics):
                return True
            self.supervise_for(2.0)
        self.event("warning", f"partitions not fully replicated after {limit_s:.0f} s")
        return False

    def lag(self, group: str, topic: str) -> int | None:
        """Records on ``topic`` past ``group``'s committed offsets (transaction markers count as one each)."""
        from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

        try:
            admin = KafkaAdminClient(bootstrap_servers=self.bootstrap.split(","), client_id="chaos-lag",
                                     request_timeout_ms=5000)
            consumer = KafkaConsumer(bootstrap_servers=self.bootstrap.split(","), client_id="chaos-lag",
                                     request_timeout_ms=5000)
        except Exception:  # noqa: BLE001 - a node restarting: unknown
            return None
        try:
            # kafka-python 3.0: {group: {TopicPartition: OffsetAndMetadata}}
            offsets = admin.list_group_offsets(group).get(group, {})
            committed = {tp: om.offset for tp, om in offsets.items() if tp.topic == topic}
            tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            ends = consumer.end_offsets(tps)
            return sum(max(0, end - max(0, committed.get(tp, 0))) for tp, end in ends.items())
        except Exception:  # noqa: BLE001
            return None
        finally:
            admin.close()
            consumer.close()

    def wait_for_work(self, stage: str, limit_s: float = 30.0) -> int | None:
        """A worker fault should hit a worker with work in hand: wait (up to ``limit_s``) until the stage's group
        lags behind its input topic."""
        group, topic, least = ((f"{self.run_id}-decode", self.topics["documents"], 2) if stage == "decode" else
                               (f"{self.run_id}-infer", self.topics["images"], self.knobs.partitions + 4))
        deadline = time.monotonic() + limit_s
        lag = None
        while time.monotonic() < deadline:
            lag = self.lag(group, topic)
            if lag is not None and lag >= least:
                return lag
            self.supervise_for(1.0)
        return lag

    def inject(self, kind: str) -> None:
        sup, rng = self.supervisor, self.rng
        stage = {"kill_decode_worker": "decode", "kill_decode_fleet": "decode", "zombie_decode": "decode",
                 "kill_infer": "infer", "zombie_infer": "infer"}.get(kind)
        if stage is not None and self.args.under_load:
            lag = self.wait_for_work(stage)
            self.event("load", f"{stage} group lag {lag} before {kind}")
        if kind == "kill_producer":
            proc = sup.pick("producer", rng)
            if proc:
                os.kill(proc.popen.pid, signal.SIGKILL)
                self.event(kind, f"SIGKILL producer pid {proc.popen.pid}")
        elif kind == "kill_decode_fleet":
            proc = sup.pick("decode", rng)
            if proc:
                os.kill(proc.popen.pid, signal.SIGKILL)
                self.event(kind, f"SIGKILL decode supervisor pid {proc.popen.pid} (its workers should notice and "
                           f"drain); workers of killed supervisors still alive: {self.supervisor.leftovers() or 0}")
        elif kind == "kill_decode_worker":
            proc = sup.pick("decode", rng)
            pids = decode_worker_pids(proc.popen.pid) if proc else []
            if pids:
                pid = rng.choice(pids)
                os.kill(pid, signal.SIGKILL)
                self.event(kind, f"SIGKILL decode worker pid {pid}")
        elif kind == "kill_infer":
            proc = sup.pick("infer", rng)
            if proc:
                os.kill(proc.popen.pid, signal.SIGKILL)
                self.event(kind, f"SIGKILL inference consumer infer-{proc.slot} pid {proc.popen.pid}")
        elif kind in ZOMBIES:
            if kind == "zombie_decode":
                proc = sup.pick("decode", rng)
                pids = decode_worker_pids(proc.popen.pid) if proc else []
                pid = rng.choice(pids) if pids else None
            else:
                proc = sup.pick("infer", rng)
                pid = proc.popen.pid if proc else None
            if pid:
                pause = self.knobs.session_timeout_ms / 1000 + 6
                os.kill(pid, signal.SIGSTOP)
                self.event(kind, f"SIGSTOP pid {pid} for {pause:.0f} s (session timeout "
                           f"{self.knobs.session_timeout_ms / 1000:.0f} s)")
                self.supervise_for(pause)
                if pid_alive(pid):
                    os.kill(pid, signal.SIGCONT)
                self.event(kind, f"SIGCONT pid {pid}")
        elif kind in BROKER_FAULTS:
            self.wait_replicated()
            topics = list(self.topics.values())
            if kind == "kill_leader_broker":
                node, counts = most_leading_node(self.bootstrap, topics)
                self.cluster.kill_node(node)
                self.event(kind, f"kill -9 node {node} (leads {counts.get(node)} partitions; leaders {counts})")
                self.supervise_for(self.rng.uniform(5, 15))
                self.cluster.restart_node(node)
                self.event(kind, f"node {node} restarted")
            elif kind == "kill_controller":
                node = self.cluster.active_controller()
                self.cluster.kill_node(node)
                self.event(kind, f"kill -9 node {node} (active controller)")
                self.supervise_for(self.rng.uniform(5, 15))
                self.cluster.restart_node(node)
                self.event(kind, f"node {node} restarted; controller now {self.cluster.active_controller()}")
            elif kind == "stale_restart":
                node = self.rng.choice(self.cluster.node_ids())
                self.cluster.stop_node(node)
                snapshot = self.cluster.snapshot_node_data(node, self.work / f"stale-node-{node}-{len(self.faults)}")
                self.cluster.restart_node(node)
                self.event(kind, f"node {node}: data copied, restarted; running on under load")
                self.wait_replicated()
                self.supervise_for(self.rng.uniform(10, 20))
                self.cluster.kill_node(node)
                self.cluster.restore_node_data(node, snapshot)
                self.cluster.restart_node(node)
                self.event(kind, f"kill -9 node {node}, data folder put back to the older copy, restarted behind")
            elif kind == "rolling_restart":
                for node in self.cluster.node_ids():
                    self.wait_replicated()
                    self.cluster.stop_node(node)
                    self.event(kind, f"node {node} stopped (SIGTERM)")
                    self.cluster.restart_node(node)
                    self.event(kind, f"node {node} back")
        self.supervisor.loop_once()

    def run(self) -> int:
        args = self.args
        self.setup()
        self.start_pipeline()
        kinds = schedule(self.rng, args.faults, args.kinds.split(",") if args.kinds else list(KINDS),
                         in_order=args.in_order)
        stop_feeder = threading.Event()
        self.faults: list[dict[str, Any]] = []
        feeder = threading.Thread(target=self.feeder, args=(stop_feeder, len(kinds)), daemon=True)
        self.supervise_for(args.warmup_s)
        feeder.start()
        try:
            for i, kind in enumerate(kinds, 1):
                self.supervise_for(self.rng.uniform(0.5, 1.5) * args.fault_interval_s)
                self.faults.append({"kind": kind, "t": round(time.monotonic() - self.started, 1)})
                self.event("fault", f"#{i}/{len(kinds)} {kind}")
                self.inject(kind)
            feeder.join()
            self.wait_replicated()
            deadline = time.monotonic() + args.drain_timeout_s
            done, moved_at = -1, time.monotonic()
            while time.monotonic() < deadline:
                self.supervise_for(10)
                now_done = self.results_done()
                self.event("progress", f"{now_done}/{args.docs} documents have a result")
                if now_done >= args.docs:
                    break
                if now_done != done:
                    done, moved_at = now_done, time.monotonic()
                elif time.monotonic() - moved_at > args.stall_s:
                    self.event("stalled", f"no new result for {args.stall_s:.0f} s: stopping, the checker says what "
                               "is missing")
                    break
            # Let the last transactions and commits settle before stopping.
            self.supervise_for(5)
        finally:
            stop_feeder.set()
            self.orphans = self.supervisor.leftovers()
            if self.orphans:
                self.event("orphans", f"still alive from earlier incarnations at the end: {self.orphans}")
            self.supervisor.stop_all()
            self.event("pipeline", "stopped")
        code = self.report()
        if not args.keep_cluster:
            self.cluster.stop()
            self.event("cluster", "stopped")
        return code

    # --- the verdict -----------------------------------------------------------------------------

    def bounds(self, report: checker.Report) -> dict[str, Any]:
        """At-least-once: how many duplicates the faults may cause, from the settings.

        decode: a worker redoes at most the documents polled since its last commit; with commit_interval_s = 0 it
        commits after every batch, so at most ``max_poll_records`` documents (each at most the plan's largest image
        count) per decode disruption: a decode worker killed or stopped past its session timeout, and every decode
        worker at each broker fault (a send to a dead leader may time out: the worker stops without committing).
        A killed decode supervisor's workers drain and commit (counted anyway).
        inference: per disruption (a consumer killed or stopped, each consumer at each broker fault), its in-flight
        window + the done records not yet committed (at most commit_every = max_images_in_flight) + one engine
        batch finishing at once; and every duplicate image record is described again.
        """
        k, counts = self.knobs, {kind: 0 for kind in KINDS}
        for f in self.faults:
            counts[f["kind"]] += 1
        broker = sum(counts[kind] for kind in BROKER_FAULTS) + 2 * counts["rolling_restart"]  # 3 nodes each
        decode_disruptions = (counts["kill_decode_worker"] + counts["zombie_decode"] + counts["kill_decode_fleet"]
                              * k.decode_workers + broker * k.decode_workers)
        infer_disruptions = counts["kill_infer"] + counts["zombie_infer"] + broker * k.infer_consumers
        per_decode_docs = k.max_poll_records
        per_decode_images = per_decode_docs * self.plan["max_images_per_doc"]
        per_infer = k.max_images_in_flight + k.max_images_in_flight + k.infer_batch_size
        images_bound = decode_disruptions * per_decode_images
        describe_bound = images_bound + infer_disruptions * per_infer
        return {"decode_disruptions": decode_disruptions, "infer_disruptions": infer_disruptions,
                "per_decode_disruption_documents": per_decode_docs,
                "per_decode_disruption_images": per_decode_images, "per_infer_disruption_images": per_infer,
                "images": images_bound, "deadletter": decode_disruptions * per_decode_images,
                "descriptions": describe_bound, "embeddings": describe_bound}

    def report(self) -> int:
        report = checker.check(self.bootstrap, self.topics, self.plan)
        counts: dict[str, int] = {}
        for f in self.faults:
            counts[f["kind"]] = counts.get(f["kind"], 0) + 1
        restarts = {f"{p.role}-{p.slot}": len(p.exits) for p in self.supervisor.procs}
        print()
        print(f"===== chaos run {self.run_id}: {self.args.mode}, {self.args.docs} documents, "
              f"{len(self.faults)} faults, {time.monotonic() - self.started:.0f} s =====")
        print("faults: " + ", ".join(f"{kind} {counts.get(kind, 0)}" for kind in KINDS))
        print(f"broker faults: {sum(counts.get(kind, 0) for kind in BROKER_FAULTS)}; process restarts by the "
              f"supervisor: {restarts}")
        if getattr(self, "orphans", None):
            print(f"workers of killed supervisors still alive at the end (killed now): {self.orphans}")
        print(report.render())
        code = checker.verdict(report, exactly_once=self.exactly_once)
        summary: dict[str, Any] = {"run_id": self.run_id, "mode": self.args.mode, "faults": counts,
                                   "restarts": restarts, "lost": report.lost, "unplanned": len(report.unplanned),
                                   "topics": {n: vars(t) for n, t in report.topics.items()}}
        if self.exactly_once:
            print(f"exactly-once: duplicates made by the pipeline (reprocessed) {report.pipeline_duplicates()}; "
                  f"inherited from the producer's duplicate documents "
                  f"{sum(t.inherited for t in report.topics.values())}")
        else:
            bound = self.bounds(report)
            summary["bound"] = bound
            print(f"at-least-once bound: {bound['decode_disruptions']} decode disruptions x "
                  f"{bound['per_decode_disruption_documents']} documents (max_poll_records; commit after every "
                  f"batch) x {self.plan['max_images_per_doc']} images; {bound['infer_disruptions']} inference "
                  f"disruptions x {bound['per_infer_disruption_images']} (in-flight window "
                  f"{self.knobs.max_images_in_flight} + commit_every {self.knobs.max_images_in_flight} + batch "
                  f"{self.knobs.infer_batch_size})")
            print(f"{'topic':<14}{'reprocessed':>12}{'bound':>8}")
            for role in ("images", "descriptions", "embeddings", "deadletter"):
                got = report.topics[role].reprocessed
                over = got > bound[role]
                print(f"{role:<14}{got:>12}{bound[role]:>8}{'  OVER THE BOUND' if over else ''}")
                if over:
                    code = 1
            print(f"results: {report.topics['results'].reprocessed} extra copies (the aggregator re-emits a "
                  f"document whose records lie above its commit point; compacted by doc_id, the copies agree)")
            print(f"documents: {report.topics['documents'].inherited} duplicate records from producer kills "
                  f"(bound: one feeder chunk, {getattr(self, 'feed_chunk', 0)} lines, per producer kill: "
                  f"{counts.get('kill_producer', 0) * getattr(self, 'feed_chunk', 0)})")
        print(f"verdict: {'PASS' if code == 0 else 'FAIL'}  (events: {self.work / 'events.log'}, logs: {self.logs})")
        summary["verdict"] = "pass" if code == 0 else "fail"
        (self.work / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        self.report_obj = report
        return code


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=500)
    ap.add_argument("--faults", type=int, default=30)
    ap.add_argument("--mode", choices=("exactly-once", "at-least-once"), default="at-least-once")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fault-interval-s", type=float, default=12.0, help="Mean time between two faults.")
    ap.add_argument("--warmup-s", type=float, default=20.0, help="Before the first document: workers start.")
    ap.add_argument("--drain-timeout-s", type=float, default=900.0)
    ap.add_argument("--feed-all", action="store_true", help="Write the whole manifest at once (a backlog from the "
                    "start: short runs, where a trickle would leave the workers idle between faults).")
    ap.add_argument("--stall-s", type=float, default=180.0, help="After the schedule: stop waiting when no document "
                    "got its result for this long.")
    ap.add_argument("--max-poll-records", type=int, default=4)
    ap.add_argument("--home", default=os.environ.get("VLMSTREAM_CHAOS_HOME", "/tmp/vlm-chaos"))
    ap.add_argument("--base-port", type=int, default=29092)
    ap.add_argument("--heap", default="384m", help="JVM heap per broker node.")
    ap.add_argument("--corpus", default=str(REPO.parent / "shared" / "corpus"))
    ap.add_argument("--keep-cluster", action="store_true")
    ap.add_argument("--no-under-load", dest="under_load", action="store_false",
                    help="Do not wait for a stage's lag before killing or stopping its worker.")
    ap.add_argument("--kinds", default="", help="Comma-separated fault kinds to draw from (default: all): "
                    + ", ".join(KINDS))
    ap.add_argument("--in-order", action="store_true", help="Inject the --kinds in the order given first (a short "
                    "run's backlog drains early: the faults that need a busy stage go first), then the drawn ones.")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return ChaosRun(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
