"""The chaos harness's view of a local 3-node KRaft cluster: start, kill -9 / restart a node, who leads what.

The project's cluster API (``vlmstream.broker``: ``lifecycle.start(settings, nodes=3)``, ``faults.kill_node``,
``faults.restart_node``, ``cluster.node_pids``, ``cluster.active_controller``, ``cluster.partition_leaders``,
``faults.snapshot_node_data`` / ``restore_node_data``) is used unless ``use_project_api=False``; ``LocalCluster``
below does the same with the project's own jars: three combined broker+controller nodes (static quorum) on ports
``base``, ``base+1``, ``base+2`` (controllers ``base+50`` ...), data under ``<home>/chaos-cluster-<base>/``.

Every fault goes through ``Cluster``: the harness never needs to know which of the two is behind it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

log = logging.getLogger(__name__)


def _project_api() -> Any:
    """The project's cluster API, gathered from the modules of ``vlmstream.broker`` that hold it."""
    from vlmstream.broker import cluster, faults, lifecycle, node

    return SimpleNamespace(
        __name__="vlmstream.broker", start=lifecycle.start, stop=lifecycle.stop, cluster_root=node.cluster_root,
        node_pids=cluster.node_pids, active_controller=cluster.active_controller,
        partition_leaders=cluster.partition_leaders, kill_node=faults.kill_node, restart_node=faults.restart_node,
        snapshot_node_data=faults.snapshot_node_data, restore_node_data=faults.restore_node_data)


@dataclass
class Node:
    node_id: int
    port: int
    controller_port: int
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def pid_file(self) -> Path:
        return self.root / "pid"

    @property
    def log_file(self) -> Path:
        return self.root / "broker.log"


class LocalCluster:
    """Three KRaft nodes of the project's Kafka jars (``vlmstream.broker.provision_jars``), each both broker and
    controller. ``heap`` is per node."""

    def __init__(self, home: Path, *, base_port: int = 29092, nodes: int = 3, heap: str = "384m",
                 max_message_bytes: int = 16 * 1024 * 1024):
        self.home = Path(home)
        self.root = self.home / f"chaos-cluster-{base_port}"
        self.nodes = {i: Node(i, base_port + i - 1, base_port + 50 + i - 1, self.root / f"node-{i}")
                      for i in range(1, nodes + 1)}
        self.heap = heap
        self.max_message_bytes = max_message_bytes
        self._procs: dict[int, subprocess.Popen] = {}

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes.values())

    def _properties(self, node: Node) -> str:
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes.values())
        big = self.max_message_bytes + 1024 * 1024
        return "\n".join([
            "process.roles=broker,controller", f"node.id={node.node_id}", f"controller.quorum.voters={voters}",
            f"listeners=PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{node.port}", "controller.listener.names=CONTROLLER",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "inter.broker.listener.name=PLAINTEXT", f"log.dirs={node.data}",
            "offsets.topic.replication.factor=3", "offsets.topic.num.partitions=6",
            "transaction.state.log.replication.factor=3", "transaction.state.log.min.isr=2",
            "transaction.state.log.num.partitions=6",
            "share.coordinator.state.topic.replication.factor=3", "share.coordinator.state.topic.min.isr=2",
            "default.replication.factor=3", "min.insync.replicas=2", "unclean.leader.election.enable=false",
            "group.initial.rebalance.delay.ms=0", f"message.max.bytes={big}", f"replica.fetch.max.bytes={big}",
            "socket.request.max.bytes=104857600", "auto.create.topics.enable=false",
            # A killed node is noticed within seconds, and leadership goes back to the preferred replica.
            "broker.session.timeout.ms=6000", "broker.heartbeat.interval.ms=1000",
            "replica.lag.time.max.ms=10000", "leader.imbalance.check.interval.seconds=15",
            "num.network.threads=2", "num.io.threads=2", "background.threads=2", "num.replica.fetchers=1",
            "",
        ])

    def start(self, wait_s: float = 120.0, fresh: bool = True) -> str:
        from vlmstream.broker.jars import find_java, provision_jars
        from vlmstream.config import BrokerSettings

        for node in self.nodes.values():  # a node left running by an earlier run of ours (its pid file)
            try:
                pid = int(node.pid_file.read_text())
                if str(node.root).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():  # ours, not a reused pid
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass
        if fresh:
            shutil.rmtree(self.root, ignore_errors=True)

        self.lib = provision_jars(BrokerSettings(home=self.home))
        self.java = find_java()
        cluster_id = uuid.uuid4().hex[:22]
        for node in self.nodes.values():
            node.root.mkdir(parents=True, exist_ok=True)
            (node.root / "server.properties").write_text(self._properties(node))
            if not (node.data / "meta.properties").exists():
                out = subprocess.run([self.java, "-cp", f"{self.lib}/*", "kafka.tools.StorageTool", "format", "-t",
                                      cluster_id, "-c", str(node.root / "server.properties"), "--ignore-formatted"],
                                     capture_output=True, text=True)
                if out.returncode != 0:
                    raise RuntimeError(f"formatting node {node.node_id} failed: {out.stdout}{out.stderr}")
        for node_id in self.nodes:
            self._launch(node_id)
        self.wait_all_up(wait_s)
        return self.bootstrap

    def _launch(self, node_id: int) -> int:
        node = self.nodes[node_id]
        log4j = resources.files("vlmstream.kafka").joinpath("log4j2.xml")
        with resources.as_file(log4j) as log4j_path, open(node.log_file, "ab") as out:
            proc = subprocess.Popen(
                [self.java, f"-Xmx{self.heap}", f"-Xms{self.heap}", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                 "-XX:CICompilerCount=2", "-Djava.awt.headless=true", f"-Dlog4j2.configurationFile={log4j_path}",
                 f"-Dkafka.logs.dir={node.root}", "-cp", f"{self.lib}/*", "kafka.Kafka",
                 str(node.root / "server.properties")],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self._procs[node_id] = proc
        node.pid_file.write_text(str(proc.pid))
        return proc.pid

    def node_pids(self) -> dict[int, int | None]:
        out: dict[int, int | None] = {}
        for node_id in self.nodes:
            proc = self._procs.get(node_id)
            out[node_id] = proc.pid if proc is not None and proc.poll() is None else None
        return out

    def node_answers(self, node_id: int, timeout_s: float = 5.0) -> bool:
        from vlmstream.broker.node import broker_answers

        return broker_answers(f"127.0.0.1:{self.nodes[node_id].port}", timeout_s=timeout_s)

    def wait_all_up(self, wait_s: float = 120.0) -> None:
        deadline = time.monotonic() + wait_s
        for node_id in self.nodes:
            while not self.node_answers(node_id, 3):
                proc = self._procs.get(node_id)
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"node {node_id} exited {proc.returncode}; see {self.nodes[node_id].log_file}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node {node_id} did not answer in {wait_s:.0f} s")
                time.sleep(0.5)

    def kill_node(self, node_id: int, sig: int = signal.SIGKILL) -> None:
        proc = self._procs.get(node_id)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=60 if sig != signal.SIGKILL else 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop_node(self, node_id: int) -> None:
        """Graceful: SIGTERM, the node hands its leaderships over (controlled shutdown) first."""
        self.kill_node(node_id, signal.SIGTERM)

    def restart_node(self, node_id: int, wait_s: float = 120.0) -> None:
        if self.node_pids().get(node_id):
            self.kill_node(node_id)
        self._launch(node_id)
        deadline = time.monotonic() + wait_s
        while not self.node_answers(node_id, 3):
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {node_id} did not come back in {wait_s:.0f} s")
            time.sleep(0.5)

    def active_controller(self) -> int | None:
        """The quorum leader, as the quorum-state files of the live nodes say (the highest epoch wins)."""
        best: tuple[int, int] | None = None
        alive = {n for n, pid in self.node_pids().items() if pid}
        for node in self.nodes.values():
            if node.node_id not in alive:
                continue
            try:
                state = json.loads((node.data / "__cluster_metadata-0" / "quorum-state").read_text())
            except (OSError, ValueError):
                continue
            leader, epoch = state.get("leaderId", -1), state.get("leaderEpoch", -1)
            if leader is not None and leader >= 0 and leader in alive and (best is None or epoch > best[1]):
                best = (leader, epoch)
        return best[0] if best else None

    def snapshot_node_data(self, node_id: int, dest: Path) -> Path:
        """Copy a node's data folder; the node must be down (a consistent copy)."""
        dest = Path(dest)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(self.nodes[node_id].data, dest, symlinks=True)
        return dest

    def restore_node_data(self, node_id: int, src: Path) -> None:
        data = self.nodes[node_id].data
        shutil.rmtree(data, ignore_errors=True)
        shutil.copytree(src, data, symlinks=True)

    def stop(self) -> None:
        for node_id in self.nodes:
            self.kill_node(node_id, signal.SIGTERM)


class Cluster:
    """What the harness asks of a cluster, over the project's API when there is one, else ``LocalCluster``."""

    def __init__(self, home: Path, *, base_port: int = 29092, heap: str = "384m", settings: Any = None,
                 use_project_api: bool = True):
        self.api = _project_api() if use_project_api else None
        if self.api is not None and settings is None:
            from vlmstream.config import BrokerSettings, KafkaSettings, Settings

            broker = BrokerSettings(home=Path(home), port=base_port, nodes=3, node_heap=heap)
            settings = Settings(broker=broker, kafka=KafkaSettings(bootstrap_servers=broker.bootstrap()))
        self.settings = settings
        self.local = None if self.api else LocalCluster(home, base_port=base_port, heap=heap)
        self.backend = f"project API ({self.api.__name__})" if self.api else "benchmarks.chaos.cluster.LocalCluster"

    def start(self) -> str:
        if self.api:
            # A fresh cluster: a running one of ours is stopped and its folder removed (topics of earlier runs).
            self.api.stop(self.settings, reason="chaos run: a fresh cluster (a running one of its own removed)")
            shutil.rmtree(self.api.cluster_root(self.settings.broker), ignore_errors=True)
            out = self.api.start(self.settings, nodes=3)
            return out if isinstance(out, str) else self.settings.kafka.bootstrap_servers
        return self.local.start()

    def node_ids(self) -> list[int]:
        return sorted(self.node_pids())

    def node_pids(self) -> dict[int, int | None]:
        return dict(self.api.node_pids(self.settings) if self.api else self.local.node_pids())

    def kill_node(self, node_id: int) -> None:
        if self.api:
            self.api.kill_node(self.settings, node_id, reason="chaos run: a node crash of its fault schedule")
        else:
            self.local.kill_node(node_id)

    def stop_node(self, node_id: int) -> None:
        if self.api:
            self.api.stop(self.settings, node=node_id, reason="chaos run: a node stop of its fault schedule")
        else:
            self.local.stop_node(node_id)

    def restart_node(self, node_id: int) -> None:
        self.api.restart_node(self.settings, node_id) if self.api else self.local.restart_node(node_id)

    def active_controller(self) -> int | None:
        return self.api.active_controller(self.settings) if self.api else self.local.active_controller()

    def snapshot_node_data(self, node_id: int, dest: Path) -> Path:
        if self.api:
            return self.api.snapshot_node_data(self.settings, node_id, dest)
        return self.local.snapshot_node_data(node_id, dest)

    def restore_node_data(self, node_id: int, src: Path) -> None:
        self.api.restore_node_data(self.settings, node_id, src) if self.api else self.local.restore_node_data(
            node_id, src)

    def stop(self) -> None:
        self.api.stop(self.settings, reason="chaos run: its end") if self.api else self.local.stop()


def partition_leaders(bootstrap: str, topics: list[str]) -> dict[tuple[str, int], dict[str, Any]]:
    """(topic, partition) -> {"leader": id, "isr": [ids], "replicas": [ids]} from a metadata request."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), request_timeout_ms=5000,
                             client_id="chaos-probe")
    try:
        out = {}
        for topic in admin.describe_topics(topics):
            name = topic.get("topic") or topic.get("name")
            for p in topic.get("partitions", []):
                # kafka-python 3.0 names them as the protocol does (partition_index, leader_id, ...).
                index = p.get("partition_index", p.get("partition"))
                out[(name, index)] = {"leader": p.get("leader_id", p.get("leader")),
                                      "isr": list(p.get("isr_nodes", p.get("isr", []))),
                                      "replicas": list(p.get("replica_nodes", p.get("replicas", [])))}
        return out
    finally:
        admin.close()


def most_leading_node(bootstrap: str, topics: list[str]) -> tuple[int | None, dict[int, int]]:
    counts: dict[int, int] = {}
    for info in partition_leaders(bootstrap, topics).values():
        if info["leader"] is not None and info["leader"] >= 0:
            counts[info["leader"]] = counts.get(info["leader"], 0) + 1
    return (max(counts, key=counts.get) if counts else None), counts


def fully_replicated(bootstrap: str, topics: list[str]) -> bool:
    try:
        leaders = partition_leaders(bootstrap, topics)
    except Exception:  # noqa: BLE001 - a node restarting: not yet
        return False
    return bool(leaders) and all(info["leader"] is not None and info["leader"] >= 0
                                 and len(info["isr"]) == len(info["replicas"]) for info in leaders.values())


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
