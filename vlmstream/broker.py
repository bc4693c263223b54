"""The project's own Apache Kafka (KRaft) broker for development, tests and CI: one node by default, or a local
cluster of ``broker.nodes`` combined broker+controller nodes in one controller quorum.

Jars come from Maven Central through ``mvn`` into ``<home>/kafka-<version>-jars`` (outside git); storage is
formatted once (a cluster: every node with one cluster id, kept in ``cluster.json``); each node runs detached and is
found again through its pid file, so a second ``start`` reuses running nodes. Nothing here is used when the
configured bootstrap servers point at another cluster.

With ``broker.security = "sasl_ssl"`` (``start --secure``) ``security.py`` secures the single node or every node
of a cluster at four hooks: the written properties, the format arguments, the probes' login and, once every node
answers, the stage principals' provisioning.

Whoever stops or kills a node says why (``reason``): the reason, the asking process (pid, command line) and its
parent are written to the node's ``stops.log`` (one JSON object a line) and ``broker.log``, and logged, so that a
broker that stopped can be explained from its folder.

The cluster half is also the API of chaos runs: ``kill_node``, ``restart_node``, ``node_pids``,
``node_bootstrap``, ``active_controller``, ``partition_leaders``, ``snapshot_node_data``, ``restore_node_data``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from vlmstream import security
from vlmstream.config import BrokerSettings, Settings

log = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    """The local broker could not be provisioned, started or reached."""


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


def jar_dir(settings: BrokerSettings) -> Path:
    return Path(settings.home).expanduser() / f"kafka-{settings.kafka_version}-jars"


def provision_jars(settings: BrokerSettings) -> Path:
    """Resolve kafka_2.13 and a log4j2 SLF4J binding with Maven; idempotent."""
    target = jar_dir(settings)
    if target.exists() and any(target.glob("kafka_2.13-*.jar")):
        return target
    mvn = shutil.which("mvn")
    if not mvn:
        raise BrokerError("Maven (mvn) is needed to fetch the Kafka jars; install it or point "
                          "VLMSTREAM_BOOTSTRAP_SERVERS at an existing cluster.")
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pom = resources.files("vlmstream.kafka").joinpath("pom.xml")
    with resources.as_file(pom) as pom_path:
        cmd = [mvn, "-q", "-B", "-f", str(pom_path), "dependency:copy-dependencies",
               f"-DoutputDirectory={tmp}", "-DincludeScope=runtime",
               f"-Dkafka.version={settings.kafka_version}"]
        log.info("fetching Kafka %s jars with Maven into %s", settings.kafka_version, target)
        result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not any(tmp.glob("kafka_2.13-*.jar")):
        raise BrokerError(f"mvn failed to resolve Kafka {settings.kafka_version}:\n{result.stdout[-3000:]}"
                          f"{result.stderr[-3000:]}")
    tmp.rename(target)
    return target


def _server_properties(settings: BrokerSettings, paths: BrokerPaths, max_message_bytes: int, node: int = 1) -> str:
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


def _pid_alive(pid: int) -> bool:
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


def _read_pid(paths: BrokerPaths) -> int | None:
    try:
        pid = int(paths.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _pid_alive(pid) else None


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


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and Path(java_home, "bin", "java").exists():
        return str(Path(java_home, "bin", "java"))
    java = shutil.which("java")
    if not java:
        raise BrokerError("java (17 or newer) is needed for the local Kafka broker")
    return java


def _format(java: str, classpath: str, paths: BrokerPaths, cluster_id: str, extra_args: list[str]) -> None:
    """kafka-storage format; ``extra_args``: security.format_args (SCRAM users; secrets, so never logged)."""
    fmt = subprocess.run([java, "-cp", classpath, "kafka.tools.StorageTool", "format", "-t", cluster_id,
                          "-c", str(paths.properties), "--ignore-formatted", *extra_args],
                         capture_output=True, text=True)
    if fmt.returncode != 0:
        raise BrokerError(f"formatting KRaft storage failed:\n{fmt.stdout}\n{fmt.stderr}")


def _launch(java: str, classpath: str, paths: BrokerPaths, heap: str, jvm_options: str | None = None
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


def start(settings: Settings, nodes: int | None = None, wait_s: float = 90.0) -> str:
    """Start (or reuse) the local broker, or with ``nodes`` > 1 (default: ``broker.nodes``) a local cluster of that
    many nodes; returns the bootstrap address (every node's, comma-separated) once each node answers metadata."""
    nodes = nodes or settings.broker.nodes
    if nodes > 1:
        return _start_cluster(_with_nodes(settings, nodes), wait_s)
    b = settings.broker
    if b.nodes > 1:
        b = b.model_copy(update={"nodes": 1})
        settings = settings.model_copy(update={"broker": b})  # the security hooks find the single node's folder
    bootstrap = f"{b.host}:{b.port}"
    paths = broker_paths(b)
    login = security.probe_kwargs(settings)  # empty unless broker.security asks for SASL_SSL
    pid = _read_pid(paths)
    if pid is not None and broker_answers(bootstrap, **login):
        log.info("local Kafka already running (pid %s) on %s", pid, bootstrap)
        return bootstrap
    if pid is None and port_open(b.host, b.port):
        if broker_answers(bootstrap, **login):
            log.info("a Kafka broker already answers on %s; reusing it", bootstrap)
            return bootstrap
        raise BrokerError(f"port {b.port} is taken by something that is not a Kafka broker")
    lib = provision_jars(b)
    paths.root.mkdir(parents=True, exist_ok=True)
    properties = _server_properties(b, paths, settings.kafka.max_message_bytes)
    paths.properties.write_text(security.broker_properties(b, properties))  # unchanged unless broker.security
    classpath = f"{lib}/*"
    java = _java()
    if not (paths.data / "meta.properties").exists():
        _format(java, classpath, paths, uuid.uuid4().hex[:22], security.format_args(b))
    proc = _launch(java, classpath, paths, b.heap)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BrokerError(f"Kafka exited with {proc.returncode}; see {paths.log_file}:\n"
                              f"{paths.log_file.read_text()[-4000:]}")
        if port_open(b.host, b.port) and broker_answers(bootstrap, timeout_s=3, **login):
            log.info("local Kafka %s started (pid %s) on %s", b.kafka_version, proc.pid, bootstrap)
            if security.enabled(b):
                security.provision(settings, bootstrap)  # stage principals and their ACLs
            return bootstrap
        time.sleep(0.5)
    _stop_paths([paths], reason=f"it did not answer within {wait_s:.0f} s of its start")
    raise BrokerError(f"Kafka did not answer within {wait_s:.0f}s; see {paths.log_file}")


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _record_stop(paths: BrokerPaths, pid: int, how: str, reason: str) -> None:
    """Why node ``paths`` (its JVM ``pid``) is stopped (``how``: the signal), and who asked: this process and its
    parent. Into the node's stops.log and broker.log, and the log."""
    asker, parent = os.getpid(), os.getppid()
    record = {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "node": str(paths.root), "pid": pid, "signal": how,
              "reason": reason, "asked_by": {"pid": asker, "command": _command_line(asker)},
              "parent": {"pid": parent, "command": _command_line(parent)}}
    line = (f"vlmstream: {how} to Kafka (pid {pid}, {paths.root}): {reason}; asked by pid {asker} "
            f"({record['asked_by']['command']}), whose parent is pid {parent} ({record['parent']['command']})")
    log.warning("%s", line)
    try:
        with open(paths.root / "stops.log", "a") as out:
            out.write(json.dumps(record) + "\n")
        with open(paths.log_file, "a") as out:
            out.write(line + "\n")
    except OSError as exc:  # the folder is gone: the log line above still says it
        log.warning("could not record the stop in %s: %s", paths.root, exc)


def _stop_paths(all_paths: list[BrokerPaths], wait_s: float = 30.0, *, reason: str) -> list[BrokerPaths]:
    """SIGTERM every running node at once, SIGKILL those still up after wait_s; the ones that were running. Each
    stop is recorded with ``reason``."""
    running = [(paths, pid) for paths in all_paths if (pid := _read_pid(paths)) is not None]
    for paths, pid in running:
        _record_stop(paths, pid, "SIGTERM", reason)
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_pid_alive(pid) for _, pid in running):
        time.sleep(0.2)
    for paths, pid in running:
        if _pid_alive(pid):
            _record_stop(paths, pid, "SIGKILL", f"it did not stop within {wait_s:.0f} s of SIGTERM ({reason})")
            os.kill(pid, signal.SIGKILL)
        paths.pid_file.unlink(missing_ok=True)
    return [paths for paths, _ in running]


def stop(settings: Settings, node: int | None = None, wait_s: float = 30.0, *, reason: str) -> bool:
    """Stop the local broker cleanly (SIGTERM, then SIGKILL after wait_s): every node of a cluster, or only
    ``node``. The cluster is the configured one (``broker.nodes``) or the one last started on this port and home.
    ``reason`` says why (who asks, for what), recorded with each node's stop. True if something was running."""
    configured = settings.broker.nodes
    settings = _running_layout(settings)
    if settings.broker.nodes != configured:
        reason += (f" (configured: {configured} node(s); the {settings.broker.nodes}-node cluster last started on "
                   f"port {settings.broker.port} runs, so it is the one stopped)")
    targets = [node] if node else list(range(1, settings.broker.nodes + 1))
    return bool(_stop_paths([node_paths(settings.broker, n) for n in targets], wait_s, reason=reason))


def status(settings: Settings, node: int | None = None) -> dict[str, object]:
    """The local broker's pid, address and whether it answers; on a cluster, the same for each node (or only
    ``node``), the active controller and the cluster id."""
    settings = _running_layout(settings)
    b = settings.broker
    login = security.probe_kwargs(settings)  # empty unless the local broker is secured
    if b.nodes == 1:
        paths = broker_paths(b)
        bootstrap = f"{b.host}:{b.port}"
        return {
            "bootstrap": bootstrap,
            "pid": _read_pid(paths),
            "answers": broker_answers(bootstrap, timeout_s=3, **login) if port_open(b.host, b.port) else False,
            "kafka_version": b.kafka_version,
            "home": str(paths.root),
            "log": str(paths.log_file),
        }
    rows = []
    for n in ([node] if node else range(1, b.nodes + 1)):
        paths, address = node_paths(b, n), node_bootstrap(settings, n)
        rows.append({"node": n, "bootstrap": address, "controller_port": b.node_ports(n)[1],
                     "pid": _read_pid(paths),
                     "answers": broker_answers(address, timeout_s=3, **login) if port_open(b.host, b.node_ports(n)[0])
                     else False,
                     "data": str(paths.data), "log": str(paths.log_file)})
    try:
        controller: int | None = active_controller(settings)
    except Exception:  # noqa: BLE001 - a cluster without a quorum has none; status still answers
        controller = None
    layout = _read_layout(settings.broker) or {}
    return {"bootstrap": b.bootstrap(), "nodes": b.nodes, "cluster_id": layout.get("cluster_id"),
            "active_controller": controller, "kafka_version": b.kafka_version, "home": str(cluster_root(b)),
            "node_status": rows}


def ensure_broker(settings: Settings) -> str:
    """The bootstrap servers to use: the configured cluster, or the local broker (or local cluster) started on
    demand."""
    if not settings.uses_local_broker:
        return settings.kafka.bootstrap_servers
    return start(settings)


# ---- A local cluster: several combined broker+controller nodes from the same jars -------------------------------


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


def _with_nodes(settings: Settings, nodes: int) -> Settings:
    """The settings of a cluster of ``nodes`` on the same base port; the bootstrap follows unless it was given."""
    broker = settings.broker.model_copy(update={"nodes": nodes})
    kafka = settings.kafka
    if "bootstrap_servers" not in kafka.model_fields_set:
        kafka = kafka.model_copy(update={"bootstrap_servers": broker.bootstrap()})
    return settings.model_copy(update={"broker": broker, "kafka": kafka})


def _read_layout(settings: BrokerSettings) -> dict | None:
    try:
        return json.loads((cluster_root(settings) / "cluster.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def running_layout(settings: Settings) -> Settings:
    """The settings of the local broker as it runs: the configured node count, or the cluster last started on this
    base port and home while one of its nodes runs (for tools that reach it without --nodes, e.g. `security`)."""
    return _running_layout(settings)


def _running_layout(settings: Settings) -> Settings:
    """The configured node count, or with one configured, the cluster last started on this base port and home
    when one of its nodes still runs (so `broker stop` after `broker start --nodes 3` stops all three)."""
    if settings.broker.nodes > 1:
        return settings
    layout = _read_layout(settings.broker)
    if layout and layout.get("nodes", 1) > 1:
        clustered = settings.broker.model_copy(update={"nodes": layout["nodes"]})
        if any(_read_pid(node_paths(clustered, n)) for n in range(1, clustered.nodes + 1)):
            return _with_nodes(settings, layout["nodes"])
    return settings


def node_bootstrap(settings: Settings, node: int) -> str:
    """One node's client address, host:port."""
    b = _running_layout(settings).broker
    return f"{b.host}:{b.node_ports(node)[0]}"


def node_pids(settings: Settings) -> dict[int, int | None]:
    """{node: pid of its JVM, or None when it does not run}."""
    b = _running_layout(settings).broker
    return {n: _read_pid(node_paths(b, n)) for n in range(1, b.nodes + 1)}


def _cluster_id(settings: BrokerSettings) -> str:
    """The cluster id every node is formatted with: written once into cluster.json with the node count."""
    root = cluster_root(settings)
    layout = _read_layout(settings)
    if layout is not None:
        if layout.get("nodes") != settings.nodes:
            raise BrokerError(f"{root} holds a cluster of {layout.get('nodes')} nodes; start it with "
                              f"--nodes {layout.get('nodes')}, or stop it and remove {root} for a new one")
        return layout["cluster_id"]
    root.mkdir(parents=True, exist_ok=True)
    cluster_id = uuid.uuid4().hex[:22]
    (root / "cluster.json").write_text(json.dumps({"cluster_id": cluster_id, "nodes": settings.nodes,
                                                   "host": settings.host, "base_port": settings.port}))
    return cluster_id


def _start_nodes(settings: Settings, nodes: list[int]) -> dict[int, subprocess.Popen]:
    """Write each node's properties, format its storage the first time, and launch the ones not running."""
    b = settings.broker
    cluster_id = _cluster_id(b)
    classpath = f"{provision_jars(b)}/*"
    java = _java()
    down = [n for n in nodes if _read_pid(node_paths(b, n)) is None]
    for n in down:
        for port in b.node_ports(n):
            if port_open(b.host, port):
                raise BrokerError(f"port {port} of node {n} is taken by another process")
        paths = node_paths(b, n)
        paths.root.mkdir(parents=True, exist_ok=True)
        properties = _server_properties(b, paths, settings.kafka.max_message_bytes, node=n)
        # Unchanged unless broker.security: then every node alike (one certificate serves them all, one host).
        paths.properties.write_text(security.broker_properties(b, properties))
    unformatted = [node_paths(b, n) for n in down if not (node_paths(b, n).data / "meta.properties").exists()]
    if unformatted:  # one JVM each, side by side
        # Every node with the super users' SCRAM credentials: whichever controller first leads writes them.
        scram = security.format_args(b)
        with ThreadPoolExecutor(len(unformatted)) as pool:
            list(pool.map(lambda paths: _format(java, classpath, paths, cluster_id, scram), unformatted))
    return {n: _launch(java, classpath, node_paths(b, n), b.node_heap, b.node_jvm_options) for n in down}


def _wait_answering(settings: Settings, procs: dict[int, subprocess.Popen], nodes: list[int], wait_s: float) -> None:
    """Until each node answers a metadata request on its own port and the cluster lists it as a broker."""
    b = settings.broker
    deadline = time.monotonic() + wait_s
    waiting = list(nodes)
    while waiting and time.monotonic() < deadline:
        for n, proc in procs.items():
            if proc.poll() is not None:
                log_file = node_paths(b, n).log_file
                raise BrokerError(f"Kafka node {n} exited with {proc.returncode}; see {log_file}:\n"
                                  f"{log_file.read_text()[-4000:]}")
        listed = _registered_brokers(settings, waiting[0]) if waiting else set()
        waiting = [n for n in waiting if n not in listed]
        if waiting:
            time.sleep(0.5)
    if waiting:
        raise BrokerError(f"Kafka node(s) {waiting} did not answer within {wait_s:.0f}s; see their logs under "
                          f"{cluster_root(b)}")


def _registered_brokers(settings: Settings, node: int) -> set[int]:
    """The brokers the cluster lists unfenced, as seen from ``node``; empty when it does not answer."""
    address = node_bootstrap(settings, node)
    if not port_open(settings.broker.host, settings.broker.node_ports(node)[0]):
        return set()
    admin = _admin(settings, address, timeout_s=3)
    if admin is None:
        return set()
    try:
        # A restarted node is listed fenced until it has caught up with the metadata log and the controller lets
        # it lead and follow partitions again: only then is it back.
        return {int(broker["broker_id"]) for broker in admin.describe_cluster()["brokers"]
                if not broker.get("is_fenced")}
    except Exception:  # noqa: BLE001 - not answering yet
        return set()
    finally:
        admin.close()


def _start_cluster(settings: Settings, wait_s: float) -> str:
    b = settings.broker
    nodes = list(range(1, b.nodes + 1))
    procs = _start_nodes(settings, nodes)
    try:
        _wait_answering(settings, procs, nodes, wait_s)
    except BrokerError as exc:
        _stop_paths([node_paths(b, n) for n in procs], reason=f"the cluster did not come up: {str(exc)[:300]}")
        raise
    log.info("local Kafka %s cluster of %d nodes (%s) answering on %s", b.kafka_version, b.nodes,
             "started" if procs else "already running", b.bootstrap())
    if procs and security.enabled(b):
        security.provision(settings, b.bootstrap())  # once every node answers: stage principals and their ACLs
    return b.bootstrap()


def kill_node(settings: Settings, node: int, *, reason: str) -> int | None:
    """SIGKILL one node (no controlled shutdown: a crash), recorded with ``reason``; returns the pid it had, None if
    it was not running."""
    paths = node_paths(_running_layout(settings).broker, node)
    pid = _read_pid(paths)
    if pid is None:
        return None
    _record_stop(paths, pid, "SIGKILL", reason)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    paths.pid_file.unlink(missing_ok=True)
    return pid


def restart_node(settings: Settings, node: int, wait_s: float = 90.0) -> str:
    """Start one node of the cluster again (a no-op when it runs) and wait until it answers and the cluster
    lists it as a broker again; returns its address. Its replicas then catch up from the leaders."""
    settings = _running_layout(settings)
    if settings.broker.nodes == 1:
        return start(settings, wait_s=wait_s)
    procs = _start_nodes(settings, [node])
    _wait_answering(settings, procs, [node], wait_s)
    return node_bootstrap(settings, node)


def snapshot_node_data(settings: Settings, node: int, dest: str | Path | None = None) -> Path:
    """Copy a stopped node's data folder (its partitions and its copy of the metadata log) to ``dest`` (default:
    ``<cluster>/snapshots/node-N-<time>``); returns it. Stop or kill the node first: a running node's files change
    under the copy."""
    paths = node_paths(_running_layout(settings).broker, node)
    if _read_pid(paths) is not None:
        raise BrokerError(f"node {node} is running; stop or kill it before taking a snapshot of its data")
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    target = Path(dest) if dest else paths.root.parent / "snapshots" / f"node-{node}-{stamp}"
    if target.exists():
        raise BrokerError(f"{target} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(paths.data, target, symlinks=True)
    return target


def restore_node_data(settings: Settings, node: int, snapshot: str | Path) -> None:
    """Replace a stopped node's data folder by a snapshot of it, so that it restarts behind the others (the same
    node and cluster id, older partitions and metadata); ``restart_node`` then lets it catch up."""
    paths = node_paths(_running_layout(settings).broker, node)
    if _read_pid(paths) is not None:
        raise BrokerError(f"node {node} is running; stop or kill it before restoring its data")
    snapshot = Path(snapshot)
    if not (snapshot / "meta.properties").exists():
        raise BrokerError(f"{snapshot} is not a node's data folder (no meta.properties)")
    shutil.rmtree(paths.data, ignore_errors=True)
    shutil.copytree(snapshot, paths.data, symlinks=True)


def _admin(settings: Settings, bootstrap: str | None = None, timeout_s: float = 10.0):
    """An admin client on the local cluster (every node in its bootstrap), or None when none answers."""
    from kafka import KafkaAdminClient

    settings = _running_layout(settings)
    address = bootstrap or settings.broker.bootstrap()
    try:
        return KafkaAdminClient(bootstrap_servers=address.split(","), request_timeout_ms=int(timeout_s * 1000),
                                client_id="vlmstream-cluster-admin", **security.probe_kwargs(settings))
    except Exception:  # noqa: BLE001 - no node answers
        return None


def active_controller(settings: Settings) -> int:
    """The node that leads the KRaft controller quorum now (DescribeQuorum on the metadata log)."""
    admin = _admin(settings)
    if admin is None:
        raise BrokerError("no node of the local cluster answers")
    try:
        quorum = admin.describe_metadata_quorum()
    finally:
        admin.close()
    partition = quorum["topics"][0]["partitions"][0]
    leader = int(partition["leader_id"])
    if leader < 0:
        raise BrokerError("the controller quorum has no leader now")
    return leader


def partition_leaders(settings: Settings, topics: list[str] | None = None) -> dict[int, int]:
    """{node: partitions it leads} over ``topics`` (default: every topic but the internal ones); every node
    appears, with 0 when it leads none; -1 counts the partitions without a leader."""
    admin = _admin(settings)
    if admin is None:
        raise BrokerError("no node of the local cluster answers")
    try:
        described = admin.describe_topics(topics)
    finally:
        admin.close()
    nodes = _running_layout(settings).broker.nodes
    counts = {n: 0 for n in range(1, nodes + 1)}
    for topic in described:
        if topics is None and (topic.get("is_internal") or str(topic.get("name", "")).startswith("__")):
            continue
        for partition in topic.get("partitions", []):
            leader = int(partition.get("leader_id", -1))
            counts[leader] = counts.get(leader, 0) + 1
    return counts
