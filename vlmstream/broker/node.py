"""One node of the local broker: its folder (properties, pid file, log, data), its server.properties, its storage
formatted once, and its JVM, started detached and found again through its pid file; whether it answers."""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from vlmstream.broker import BrokerError
from vlmstream.config import BrokerSettings


@dataclass(frozen=True)
class BrokerPaths:
    root: Path

    @property
    def lib(self) -> Path:
        return self.root / "lib"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def properties(self) -> Path:
        return self.root / "server.properties"

    @property
    def pid_file(self) -> Path:
        return self.root / "broker.pid"

    @property
    def log_file(self) -> Path:
        return self.root / "broker.log"


def broker_paths(settings: BrokerSettings) -> BrokerPaths:
    return BrokerPaths(Path(settings.home).expanduser() / f"kafka-{settings.kafka_version}-{settings.port}")


def cluster_root(settings: BrokerSettings) -> Path:
    """Where a cluster on this base port keeps its nodes' folders and its layout (``cluster.json``)."""
    return Path(settings.home).expanduser() / f"kafka-{settings.kafka_version}-cluster-{settings.port}"


def node_paths(settings: BrokerSettings, node: int) -> BrokerPaths:
    """One node's folder: properties, pid file, log and data (``data/``)."""
    if settings.nodes == 1:
        if node != 1:
            raise BrokerError(f"the local broker has one node; there is no node {node}")
        return broker_paths(settings)
    if not 1 <= node <= settings.nodes:
        raise BrokerError(f"the local cluster has nodes 1 to {settings.nodes}; there is no node {node}")
    return BrokerPaths(cluster_root(settings) / f"node-{node}")


def server_properties(settings: BrokerSettings, paths: BrokerPaths, max_message_bytes: int, node: int = 1) -> str:
    host = settings.host
    port, cport = settings.node_ports(node)
    voters = ",".join(f"{n}@{host}:{settings.node_ports(n)[1]}" for n in range(1, settings.nodes + 1))
    # One node: every internal topic has one replica and one in-sync replica. A cluster: three replicas (or as many
    # as there are nodes) and, from three, two in sync, so that one node can go down without a write being lost.
    replicas = min(3, settings.nodes)
    min_isr = 2 if replicas >= 3 else 1
    lines = [
        "process.roles=broker,controller",
        f"node.id={node}",
        f"controller.quorum.voters={voters}",
        f"listeners=PLAINTEXT://{host}:{port},CONTROLLER://{host}:{cport}",
        f"advertised.listeners=PLAINTEXT://{host}:{port}",
        "controller.listener.names=CONTROLLER",
        "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "inter.broker.listener.name=PLAINTEXT",
        f"log.dirs={paths.data}",
        "num.partitions=1",
        f"offsets.topic.replication.factor={replicas}",
        "offsets.topic.num.partitions=10",
        f"transaction.state.log.replication.factor={replicas}",
        f"transaction.state.log.min.isr={min_isr}",
        "transaction.state.log.num.partitions=10",
        f"share.coordinator.state.topic.replication.factor={replicas}",
        f"share.coordinator.state.topic.min.isr={min_isr}",
        f"default.replication.factor={replicas}",
        # The broker default, so also __consumer_offsets' (its commits are written with acks=all).
        f"min.insync.replicas={min_isr}",
        # Tests create and join groups constantly; no reason to wait for more members.
        "group.initial.rebalance.delay.ms=0",
        # Image payloads are large; the claim-check store takes anything above this.
        f"message.max.bytes={max_message_bytes + 1024 * 1024}",
        f"replica.fetch.max.bytes={max_message_bytes + 1024 * 1024}",
        f"socket.request.max.bytes={max(104857600, 2 * max_message_bytes)}",
        "auto.create.topics.enable=true",
        "delete.topic.enable=true",
        "log.retention.hours=168",
    ]
    if settings.nodes > 1:
        lines += [
            # A killed node is fenced (its partitions led elsewhere) after this long without a heartbeat (Kafka: 9 s).
            "broker.heartbeat.interval.ms=1000",
            "broker.session.timeout.ms=6000",
            # Never elect a replica that fell out of sync: that would lose acknowledged writes.
            "unclean.leader.election.enable=false",
        ]
    return "\n".join(lines + [""])


def pid_alive(pid: int) -> bool:
    try:
        # Reap it first if it is our child that has exited, so that a zombie does not count as alive.
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_pid(paths: BrokerPaths) -> int | None:
    try:
        pid = int(paths.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def broker_answers(bootstrap: str, timeout_s: float = 5.0, **client_kwargs) -> bool:
    """True when a metadata request succeeds (not just an open port); ``client_kwargs``: a secured broker's login."""
    from kafka import KafkaAdminClient

    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), request_timeout_ms=int(timeout_s * 1000),
                                 client_id="vlmstream-probe", **client_kwargs)
    except Exception:  # noqa: BLE001 - any failure means "not answering yet"
        return False
    try:
        admin.describe_cluster()
        return True
    except Exception:  # noqa: BLE001
        return False
    finally:
        admin.close()


def format_storage(java: str, classpath: str, paths: BrokerPaths, cluster_id: str, extra_args: list[str]) -> None:
    """kafka-storage format; ``extra_args``: security.format_args (SCRAM users; secrets, so never logged)."""
    fmt = subprocess.run([java, "-cp", classpath, "kafka.tools.StorageTool", "format", "-t", cluster_id,
                          "-c", str(paths.properties), "--ignore-formatted", *extra_args],
                         capture_output=True, text=True)
    if fmt.returncode != 0:
        raise BrokerError(f"formatting KRaft storage failed:\n{fmt.stdout}\n{fmt.stderr}")


def launch(java: str, classpath: str, paths: BrokerPaths, heap: str, jvm_options: str | None = None
            ) -> subprocess.Popen:
    log4j = resources.files("vlmstream.kafka").joinpath("log4j2.xml")
    options = jvm_options.split() if jvm_options is not None else ["-XX:+UseG1GC"]
    with resources.as_file(log4j) as log4j_path:
        cmd = [java, f"-Xmx{heap}", f"-Xms{heap}", *options, "-Djava.awt.headless=true",
               f"-Dlog4j2.configurationFile={log4j_path}", f"-Dkafka.logs.dir={paths.root}",
               "-cp", classpath, "kafka.Kafka", str(paths.properties)]
        with open(paths.log_file, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
    paths.pid_file.write_text(str(proc.pid))
    return proc
