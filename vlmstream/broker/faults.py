"""Faults for chaos runs and fault tests: kill one node (a crash), start it again, and take or restore a stopped
node's data so that it restarts behind the others."""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from pathlib import Path

from vlmstream.broker import BrokerError
from vlmstream.broker.cluster import node_bootstrap, running_layout, start_nodes, wait_answering
from vlmstream.broker.lifecycle import start
from vlmstream.broker.node import node_paths, pid_alive, read_pid
from vlmstream.broker.stops import record_stop
from vlmstream.config import Settings


def kill_node(settings: Settings, node: int, *, reason: str) -> int | None:
    """SIGKILL one node (no controlled shutdown: a crash), recorded with ``reason``; returns the pid it had, None if
    it was not running."""
    paths = node_paths(running_layout(settings).broker, node)
    pid = read_pid(paths)
    if pid is None:
        return None
    record_stop(paths, pid, "SIGKILL", reason)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    paths.pid_file.unlink(missing_ok=True)
    return pid


def restart_node(settings: Settings, node: int, wait_s: float = 90.0) -> str:
    """Start one node of the cluster again (a no-op when it runs) and wait until it answers and the cluster
    lists it as a broker again; returns its address. Its replicas then catch up from the leaders."""
    settings = running_layout(settings)
    if settings.broker.nodes == 1:
        return start(settings, wait_s=wait_s)
    procs = start_nodes(settings, [node])
    wait_answering(settings, procs, [node], wait_s)
    return node_bootstrap(settings, node)


def snapshot_node_data(settings: Settings, node: int, dest: str | Path | None = None) -> Path:
    """Copy a stopped node's data folder (its partitions and its copy of the metadata log) to ``dest`` (default:
    ``<cluster>/snapshots/node-N-<time>``); returns it. Stop or kill the node first: a running node's files change
    under the copy."""
    paths = node_paths(running_layout(settings).broker, node)
    if read_pid(paths) is not None:
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
    paths = node_paths(running_layout(settings).broker, node)
    if read_pid(paths) is not None:
        raise BrokerError(f"node {node} is running; stop or kill it before restoring its data")
    snapshot = Path(snapshot)
    if not (snapshot / "meta.properties").exists():
        raise BrokerError(f"{snapshot} is not a node's data folder (no meta.properties)")
    shutil.rmtree(paths.data, ignore_errors=True)
    shutil.copytree(snapshot, paths.data, symlinks=True)
