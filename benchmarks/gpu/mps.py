"""CUDA MPS for the pipeline arms: the inference consumer's vision tower and vLLM's EngineCore are two processes,
so without MPS their kernels time-slice on the GPU; under one MPS server they can run at the same time.

The daemon gets its own pipe and log folders and only processes started with this module's environment connect
to it, so the offline and serve arms of the same benchmark are not affected. The GPU's compute mode is never
changed (the device's rules): MPS runs in the default mode."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from vlmstream.vllm_process import child_environment

CONTROL = "nvidia-cuda-mps-control"


def mps_env(folder: Path) -> dict[str, str]:
    return {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}


@contextmanager
def mps_daemon(folder: str | Path = "/tmp/vlmstream-mps"):
    """Starts an MPS control daemon, puts its folders into os.environ (so children connect), and quits it at
    exit; yields the environment entries. Raises if the control binary is missing or the daemon does not start."""
    if shutil.which(CONTROL) is None:
        raise RuntimeError(f"{CONTROL} not found: install the CUDA MPS binaries or run without --mps")
    folder = Path(folder)
    env = mps_env(folder)
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    full = dict(os.environ, **env)
    subprocess.run([CONTROL, "-d"], env=full, check=True, timeout=30)
    deadline = time.monotonic() + 10
    while not (folder / "pipe" / "control").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"MPS control daemon did not open {folder / 'pipe' / 'control'}; see {folder / 'log'}")
        time.sleep(0.1)
    try:
        with child_environment(env):
            yield env
    finally:
        # quit waits for its clients to detach; every engine of the arm has been stopped by now.
        subprocess.run([CONTROL], input="quit\n", text=True, env=full, timeout=60, check=False)
