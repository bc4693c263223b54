"""The worker processes `vlmstream run` and `vlmstream estimate` start on this machine (decode, inference, condense):
each stage's settings, starting them, and stopping them with the run's stop policy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from vlmstream.config import is_settings_variable
from vlmstream.stopping import Stop, child_environment

console = Console(stderr=True)

# `run` and `estimate` start decode beside the inference consumer on one machine's cores: decode yields them (it
# only needs to stay ahead of inference, while inference's CPU work is what keeps the model busy), and an engine on
# the CPU runs one torch thread (its threads wait for each other at every operation, and lose whenever decode takes
# one's core).
LOCAL_DECODE_NICENESS = 10
LOCAL_INFER_CPU_THREADS = 1

# With metrics_port set, each worker process of a run serves its own endpoint: decode on the port, inference on the
# next one, condense on the one after (all on one machine, so one port each).
METRICS_PORT_OFFSET = {"decode": 0, "infer": 1, "condense": 2}

# How long `vlmstream run` waits for its workers to drain once stopped, whether or not the cluster answers: the
# decode fleet's drain_timeout_s (120 s, its workers' flush/commit/close each bounded by kafka.request_timeout_ms)
# and the inference process's (the engine finishes what it holds, then flush, commit and closes, each bounded the
# same way) fit in it with the defaults. What outlives it is killed: nothing it had not flushed was committed.
STOP_GRACE_S = 180.0


def as_stage(settings: Any, stage: str) -> Any:
    """The settings a stage gets when `run` (or `estimate`) starts it on this machine: its own login, and the
    defaults for stages that share the machine's cores."""
    return sharing_cores(settings.model_copy(update={"kafka": settings.kafka.as_principal(stage)}), stage)


def sharing_cores(settings: Any, stage: str) -> Any:
    """Decode started beside inference runs at LOCAL_DECODE_NICENESS unless decode.niceness was set, and an
    inference engine on the CPU with LOCAL_INFER_CPU_THREADS unless infer.cpu_threads or OMP_NUM_THREADS says
    otherwise."""
    if stage == "decode" and "niceness" not in settings.decode.model_fields_set:
        return settings.model_copy(update={"decode": settings.decode.model_copy(
            update={"niceness": LOCAL_DECODE_NICENESS})})
    if (stage == "infer" and "cpu_threads" not in settings.infer.model_fields_set
            and not os.environ.get("OMP_NUM_THREADS")):
        return settings.model_copy(update={"infer": settings.infer.model_copy(
            update={"cpu_threads": LOCAL_INFER_CPU_THREADS})})
    return settings


def settings_file(settings: Any) -> Path:
    """The effective settings for a child process, secrets included, readable by this user only."""
    data = settings.model_dump(mode="python")

    def reveal(node: Any) -> Any:
        if hasattr(node, "get_secret_value"):
            return node.get_secret_value()
        if isinstance(node, dict):
            return {k: reveal(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [reveal(v) for v in node]
        if isinstance(node, Path):
            return str(node)
        return node

    fd, name = tempfile.mkstemp(prefix="vlmstream-run-", suffix=".json")
    with os.fdopen(fd, "w") as handle:
        json.dump(reveal(data), handle)
    os.chmod(name, 0o600)
    return Path(name)


def start_worker(args: list[str], config: Path, log_path: Path, metrics_port: int = 0) -> subprocess.Popen:
    """`vlmstream --config CONFIG ARGS` in a session of its own (its decode workers or engine process with it), its
    output into ``log_path``; it stops when this process is gone, however it went (``vlmstream.stopping``)."""
    cmd = [sys.executable, "-m", "vlmstream.cli", "--config", str(config), *args]
    # The settings file holds the run's effective settings (the environment's included); an exported settings
    # variable would outrank it in the child and send it elsewhere (--fresh's own topics and groups to the shared
    # ones), so the child gets none of them.
    env = child_environment({key: value for key, value in os.environ.items() if not is_settings_variable(key)})
    if metrics_port > 0:
        env["VLMSTREAM_METRICS_PORT"] = str(metrics_port + METRICS_PORT_OFFSET[args[0]])
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)


class Workers:
    """The stages' worker processes of one run, each with its settings file, and how they stop."""

    def __init__(self, settings: Any, stages: tuple[str, ...], log_dir: Path, log_name: str = "{stage}.log"):
        self.stages = stages
        self.log_dir = log_dir
        self.log_name = log_name
        # Each stage's process gets a settings file with its own login only (kafka.principals; none: run's own).
        self.config_files = {stage: settings_file(as_stage(settings, stage)) for stage in stages}
        self.procs: dict[str, subprocess.Popen] = {}

    def log_path(self, stage: str) -> Path:
        return self.log_dir / self.log_name.format(stage=stage)

    def start(self, metrics_port: int = 0) -> None:
        for stage in self.stages:
            self.procs[stage] = start_worker([stage], self.config_files[stage], self.log_path(stage), metrics_port)

    def exited(self) -> tuple[str, int] | None:
        """The first worker that exited (stage, exit code), if one did."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def stop(self, stop: Stop, grace_s: float = STOP_GRACE_S) -> dict[str, int | None]:
        """SIGTERM to each worker (drain, commit, leave the group), then SIGKILL whatever outlives ``grace_s``, or
        everything at once on a second SIGTERM/Ctrl-C (``stop.at_once``; the stop policy's ``now`` is
        ``kill``). A first signal that arrives meanwhile (a finished run stopping its workers) lets them drain.
        Returns the workers' exit codes; the settings files are removed."""
        try:
            # Only the worker's main process: it drains and stops its own children (a vLLM EngineCore signalled
            # directly would abort the requests in flight instead of finishing them).
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            if any(proc.poll() is None for proc in self.procs.values()):
                console.print(f"stopping: the workers flush and commit (up to {grace_s:.0f} s, also when the cluster "
                              "does not answer); Ctrl-C again to stop them at once")
            deadline = time.monotonic() + grace_s
            while any(proc.poll() is None for proc in self.procs.values()):
                if stop.at_once or time.monotonic() >= deadline:
                    self.kill()
                    break
                time.sleep(0.1)
            for proc in self.procs.values():
                proc.wait()
        except BaseException:  # any error while waiting: the workers must not outlive the command
            self.kill()
            raise
        finally:
            self.remove_settings_files()
        return {name: proc.returncode for name, proc in self.procs.items()}

    def kill(self, _signum: int | None = None) -> None:
        """SIGKILL every worker's session (its decode workers and any engine process too): their partitions' next
        owners redo what they had not committed."""
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def remove_settings_files(self) -> None:
        for config_file in self.config_files.values():
            config_file.unlink(missing_ok=True)
