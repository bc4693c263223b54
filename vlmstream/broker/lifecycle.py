"""Start, stop and status of the local broker, one node or a cluster, and the bootstrap servers a command uses."""

from __future__ import annotations

import logging
import time
import uuid

from vlmstream import security
from vlmstream.broker import BrokerError
from vlmstream.broker.cluster import (active_controller, node_bootstrap, read_layout, running_layout, start_cluster,
                                      with_nodes)
from vlmstream.broker.jars import find_java, provision_jars
from vlmstream.broker.node import (broker_answers, broker_paths, cluster_root, format_storage, launch, node_paths,
                                   port_open, read_pid, server_properties)
from vlmstream.broker.stops import stop_nodes
from vlmstream.config import Settings

log = logging.getLogger(__name__)


def start(settings: Settings, nodes: int | None = None, wait_s: float = 90.0) -> str:
    """Start (or reuse) the local broker, or with ``nodes`` > 1 (default: ``broker.nodes``) a local cluster of that
    many nodes; returns the bootstrap address (every node's, comma-separated) once each node answers metadata."""
    nodes = nodes or settings.broker.nodes
    if nodes > 1:
        return start_cluster(with_nodes(settings, nodes), wait_s)
    b = settings.broker
    if b.nodes > 1:
        b = b.model_copy(update={"nodes": 1})
        settings = settings.model_copy(update={"broker": b})  # the security hooks find the single node's folder
    bootstrap = f"{b.host}:{b.port}"
    paths = broker_paths(b)
    login = security.probe_kwargs(settings)  # empty unless broker.security asks for SASL_SSL
    pid = read_pid(paths)
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
    properties = server_properties(b, paths, settings.kafka.max_message_bytes)
    paths.properties.write_text(security.broker_properties(b, properties))  # unchanged unless broker.security
    classpath = f"{lib}/*"
    java = find_java()
    if not (paths.data / "meta.properties").exists():
        format_storage(java, classpath, paths, uuid.uuid4().hex[:22], security.format_args(b))
    proc = launch(java, classpath, paths, b.heap)
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
    stop_nodes([paths], reason=f"it did not answer within {wait_s:.0f} s of its start")
    raise BrokerError(f"Kafka did not answer within {wait_s:.0f}s; see {paths.log_file}")


def stop(settings: Settings, node: int | None = None, wait_s: float = 30.0, *, reason: str) -> bool:
    """Stop the local broker cleanly (SIGTERM, then SIGKILL after wait_s): every node of a cluster, or only
    ``node``. The cluster is the configured one (``broker.nodes``) or the one last started on this port and home.
    ``reason`` says why (who asks, for what), recorded with each node's stop. True if something was running."""
    configured = settings.broker.nodes
    settings = running_layout(settings)
    if settings.broker.nodes != configured:
        reason += (f" (configured: {configured} node(s); the {settings.broker.nodes}-node cluster last started on "
                   f"port {settings.broker.port} runs, so it is the one stopped)")
    targets = [node] if node else list(range(1, settings.broker.nodes + 1))
    return bool(stop_nodes([node_paths(settings.broker, n) for n in targets], wait_s, reason=reason))


def status(settings: Settings, node: int | None = None) -> dict[str, object]:
    """The local broker's pid, address and whether it answers; on a cluster, the same for each node (or only
    ``node``), the active controller and the cluster id."""
    settings = running_layout(settings)
    b = settings.broker
    login = security.probe_kwargs(settings)  # empty unless the local broker is secured
    if b.nodes == 1:
        paths = broker_paths(b)
        bootstrap = f"{b.host}:{b.port}"
        return {
            "bootstrap": bootstrap,
            "pid": read_pid(paths),
            "answers": broker_answers(bootstrap, timeout_s=3, **login) if port_open(b.host, b.port) else False,
            "kafka_version": b.kafka_version,
            "home": str(paths.root),
            "log": str(paths.log_file),
        }
    rows = []
    for n in ([node] if node else range(1, b.nodes + 1)):
        paths, address = node_paths(b, n), node_bootstrap(settings, n)
        rows.append({"node": n, "bootstrap": address, "controller_port": b.node_ports(n)[1],
                     "pid": read_pid(paths),
                     "answers": broker_answers(address, timeout_s=3, **login) if port_open(b.host, b.node_ports(n)[0])
                     else False,
                     "data": str(paths.data), "log": str(paths.log_file)})
    try:
        controller: int | None = active_controller(settings)
    except Exception:  # noqa: BLE001 - a cluster without a quorum has none; status still answers
        controller = None
    layout = read_layout(settings.broker) or {}
    return {"bootstrap": b.bootstrap(), "nodes": b.nodes, "cluster_id": layout.get("cluster_id"),
            "active_controller": controller, "kafka_version": b.kafka_version, "home": str(cluster_root(b)),
            "node_status": rows}


def ensure_broker(settings: Settings) -> str:
    """The bootstrap servers to use: the configured cluster, or the local broker (or local cluster) started on
    demand."""
    if not settings.uses_local_broker:
        return settings.kafka.bootstrap_servers
    return start(settings)
