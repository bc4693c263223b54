"""A local cluster: several combined broker+controller nodes from the same jars in one controller quorum, every
node formatted with one cluster id (kept with the node count in ``cluster.json``); which cluster runs on a base port,
starting its nodes and waiting until the cluster lists each, and asking it who leads the quorum and the partitions."""

from __future__ import annotations

import json
import logging
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from vlmstream import security
from vlmstream.broker import BrokerError
from vlmstream.broker.jars import find_java, provision_jars
from vlmstream.broker.node import (cluster_root, format_storage, launch, node_paths, port_open, read_pid,
                                   server_properties)
from vlmstream.broker.stops import stop_nodes
from vlmstream.config import BrokerSettings, Settings

log = logging.getLogger(__name__)


def with_nodes(settings: Settings, nodes: int) -> Settings:
    """The settings of a cluster of ``nodes`` on the same base port; the bootstrap follows unless it was given."""
    broker = settings.broker.model_copy(update={"nodes": nodes})
    kafka = settings.kafka
    if "bootstrap_servers" not in kafka.model_fields_set:
        kafka = kafka.model_copy(update={"bootstrap_servers": broker.bootstrap()})
    return settings.model_copy(update={"broker": broker, "kafka": kafka})


def read_layout(settings: BrokerSettings) -> dict | None:
    try:
        return json.loads((cluster_root(settings) / "cluster.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def running_layout(settings: Settings) -> Settings:
    """The settings of the local broker as it runs: the configured node count, or with one configured, the cluster
    last started on this base port and home when one of its nodes still runs (so `broker stop` after `broker start
    --nodes 3` stops all three, and tools that reach it without --nodes, e.g. `security`, find every node)."""
    if settings.broker.nodes > 1:
        return settings
    layout = read_layout(settings.broker)
    if layout and layout.get("nodes", 1) > 1:
        clustered = settings.broker.model_copy(update={"nodes": layout["nodes"]})
        if any(read_pid(node_paths(clustered, n)) for n in range(1, clustered.nodes + 1)):
            return with_nodes(settings, layout["nodes"])
    return settings


def node_bootstrap(settings: Settings, node: int) -> str:
    """One node's client address, host:port."""
    b = running_layout(settings).broker
    return f"{b.host}:{b.node_ports(node)[0]}"


def node_pids(settings: Settings) -> dict[int, int | None]:
    """{node: pid of its JVM, or None when it does not run}."""
    b = running_layout(settings).broker
    return {n: read_pid(node_paths(b, n)) for n in range(1, b.nodes + 1)}


def _cluster_id(settings: BrokerSettings) -> str:
    """The cluster id every node is formatted with: written once into cluster.json with the node count."""
    root = cluster_root(settings)
    layout = read_layout(settings)
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


def start_nodes(settings: Settings, nodes: list[int]) -> dict[int, subprocess.Popen]:
    """Write each node's properties, format its storage the first time, and launch the ones not running."""
    b = settings.broker
    cluster_id = _cluster_id(b)
    classpath = f"{provision_jars(b)}/*"
    java = find_java()
    down = [n for n in nodes if read_pid(node_paths(b, n)) is None]
    for n in down:
        for port in b.node_ports(n):
            if port_open(b.host, port):
                raise BrokerError(f"port {port} of node {n} is taken by another process")
        paths = node_paths(b, n)
        paths.root.mkdir(parents=True, exist_ok=True)
        properties = server_properties(b, paths, settings.kafka.max_message_bytes, node=n)
        # Unchanged unless broker.security: then every node alike (one certificate serves them all, one host).
        paths.properties.write_text(security.broker_properties(b, properties))
    unformatted = [node_paths(b, n) for n in down if not (node_paths(b, n).data / "meta.properties").exists()]
    if unformatted:  # one JVM each, side by side
        # Every node with the super users' SCRAM credentials: whichever controller first leads writes them.
        scram = security.format_args(b)
        with ThreadPoolExecutor(len(unformatted)) as pool:
            list(pool.map(lambda paths: format_storage(java, classpath, paths, cluster_id, scram), unformatted))
    return {n: launch(java, classpath, node_paths(b, n), b.node_heap, b.node_jvm_options) for n in down}


def wait_answering(settings: Settings, procs: dict[int, subprocess.Popen], nodes: list[int], wait_s: float) -> None:
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


def start_cluster(settings: Settings, wait_s: float) -> str:
    b = settings.broker
    nodes = list(range(1, b.nodes + 1))
    procs = start_nodes(settings, nodes)
    try:
        wait_answering(settings, procs, nodes, wait_s)
    except BrokerError as exc:
        stop_nodes([node_paths(b, n) for n in procs], reason=f"the cluster did not come up: {str(exc)[:300]}")
        raise
    log.info("local Kafka %s cluster of %d nodes (%s) answering on %s", b.kafka_version, b.nodes,
             "started" if procs else "already running", b.bootstrap())
    if procs and security.enabled(b):
        security.provision(settings, b.bootstrap())  # once every node answers: stage principals and their ACLs
    return b.bootstrap()


def _admin(settings: Settings, bootstrap: str | None = None, timeout_s: float = 10.0):
    """An admin client on the local cluster (every node in its bootstrap), or None when none answers."""
    from kafka import KafkaAdminClient

    settings = running_layout(settings)
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
    nodes = running_layout(settings).broker.nodes
    counts = {n: 0 for n in range(1, nodes + 1)}
    for topic in described:
        if topics is None and (topic.get("is_internal") or str(topic.get("name", "")).startswith("__")):
            continue
        for partition in topic.get("partitions", []):
            leader = int(partition.get("leader_id", -1))
            counts[leader] = counts.get(leader, 0) + 1
    return counts
