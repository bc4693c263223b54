"""Stopping nodes, each stop with its reason: the reason, the asking process (pid, command line) and its parent are
written to the node's ``stops.log`` (one JSON object a line) and ``broker.log``, and logged, so that a broker that
stopped can be explained from its folder."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

from vlmstream.broker.node import BrokerPaths, pid_alive, read_pid

log = logging.getLogger(__name__)


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def record_stop(paths: BrokerPaths, pid: int, how: str, reason: str) -> None:
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


def stop_nodes(all_paths: list[BrokerPaths], wait_s: float = 30.0, *, reason: str) -> list[BrokerPaths]:
    """SIGTERM every running node at once, SIGKILL those still up after wait_s; the ones that were running. Each
    stop is recorded with ``reason``."""
    running = [(paths, pid) for paths in all_paths if (pid := read_pid(paths)) is not None]
    for paths, pid in running:
        record_stop(paths, pid, "SIGTERM", reason)
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(pid_alive(pid) for _, pid in running):
        time.sleep(0.2)
    for paths, pid in running:
        if pid_alive(pid):
            record_stop(paths, pid, "SIGKILL", f"it did not stop within {wait_s:.0f} s of SIGTERM ({reason})")
            os.kill(pid, signal.SIGKILL)
        paths.pid_file.unlink(missing_ok=True)
    return [paths for paths, _ in running]
