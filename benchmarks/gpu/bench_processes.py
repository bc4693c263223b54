"""gpu_bench's shared parts: constants, logging, child processes (spawn, kill a tree, CPU of a tree) and the
GPU/CPU samplers."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))  # the repository's packages (consumers, vlmstream) for every part of gpu_bench

from vlmstream.profiling import child_pids as descendants  # noqa: E402 - after the path insert
from vlmstream.profiling import process_cpu_seconds  # noqa: E402

BUDGETS = {"256": 256 * 28 * 28, "1280": 1280 * 28 * 28, "default": 28 * 28 * 16384}
MIN_PIXELS = 56 * 56
PROMPT_TEXT = "Describe this image in detail."
CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
               "<|vision_start|><|image_pad|><|vision_end|>" + PROMPT_TEXT + "<|im_end|>\n<|im_start|>assistant\n")
OFFLINE_ARMS = ("naive", "ceiling-preresized", "ceiling-embeds")
ALL_ARMS = OFFLINE_ARMS + ("pipeline-embeds", "pipeline-embeds-public", "pipeline-pixels", "serve")
# Used only to size a pipeline phase's documents (count = rate x --seconds); a wrong guess changes how long the
# phase runs, not what it measures (it stops at --stop-after x --seconds and reports what it had).
EXPECTED_RATE = {"256": 100.0, "1280": 35.0, "default": 6.0}
# Warm-up documents per GPU of a pipeline phase. The first phase's also carry the freshly started engines' first
# requests (graph capture, compilation), later ones only need the new decode fleet in its group and the new shapes.
FIRST_WARM_DOCS_PER_GPU = 16
LATER_WARM_DOCS_PER_GPU = 8
# A pipeline phase's time beyond its measurement: stopping one decode fleet (SIGTERM drain), starting the next,
# publishing and waiting for the warm-up set.
PHASE_OVERHEAD_S = 90.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- processes ----------------------------------------------------------------------------------------------------


def vlmstream_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "vlmstream.cli", *args]


def gpu_env(env: dict[str, str], gpu: int) -> dict[str, str]:
    """env for a process on physical GPU `gpu`. Each GPU gets its own vLLM cache: two engines starting at once on
    one host (two GPUs, or two benchmarks side by side) would otherwise compile into the same folder."""
    return dict(env, CUDA_VISIBLE_DEVICES=str(gpu),
                VLLM_CACHE_ROOT=env.get("VLLM_CACHE_ROOT") or os.path.expanduser(f"~/.cache/vllm-gpu{gpu}"))


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None, tag: str = "") -> subprocess.Popen:
    """Start cmd in a new OS session (setsid: its own process group) with stdout+stderr appended to log_path."""
    with open(log_path, "ab") as f:
        f.write(f"\n===== {tag} {time.strftime('%H:%M:%S')} $ {' '.join(cmd)}\n".encode())
    out = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            cwd=str(REPO), start_new_session=True)
    out.close()
    return proc


def tree_cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of pid and its live descendants (from /proc; no psutil needed)."""
    return sum(process_cpu_seconds(p) for p in [pid, *descendants(pid)])


def stop_drained(proc: subprocess.Popen | None, grace_s: float = 20.0) -> None:
    """SIGTERM to proc alone, grace_s for it to drain and stop its own children, then ``kill_tree`` on what is left.
    A vLLM consumer signalled with its whole group loses its engine process to the same signal (it aborts its
    requests at once), and with it what the consumer reads from the engine at close: the tower's clock."""
    if proc is None:
        return
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except OSError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    kill_tree(proc, grace_s=2)


def kill_tree(proc: subprocess.Popen | None, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Signal the process group (and any descendant that left it), wait grace_s, then SIGKILL whatever is left."""
    if proc is None:
        return
    pids = [proc.pid, *descendants(proc.pid)]
    # spawn() made proc the leader of its own group: its pgid is its pid even after it exited, and children it left
    # behind (a vLLM EngineCore, API servers) are still in that group though no longer its descendants.
    groups = {proc.pid}
    for p in pids:
        try:
            groups.add(os.getpgid(p))
        except OSError:
            pass
    for g in groups:
        try:
            os.killpg(g, sig)
        except OSError:
            pass
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:
            pass
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def log_tail(path: Path, n: int = 2500) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


# --- samplers -----------------------------------------------------------------------------------------------------


class GpuSampler:
    """nvidia-smi utilization.gpu once a second in the background: (time, gpu index, percent busy)."""

    def __init__(self, gpu_ids: list[int] | None = None) -> None:
        self.gpu_ids = set(gpu_ids) if gpu_ids is not None else None  # None: every GPU that reports
        self.samples: list[tuple[float, int, float]] = []
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "GpuSampler":
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-l", "1"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        except OSError:
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                idx, util = (x.strip() for x in line.split(","))
                self.samples.append((time.time(), int(idx), float(util)))
            except ValueError:
                continue

    def busy(self, t0: float, t1: float) -> float | None:
        """Mean busy fraction over [t0, t1] of this run's GPUs (another run may use the host's other GPUs)."""
        vals = [u for t, i, u in self.samples if t0 <= t <= t1 and (self.gpu_ids is None or i in self.gpu_ids)]
        return round(sum(vals) / len(vals) / 100.0, 3) if vals else None

    def stop(self) -> None:
        kill_tree(self._proc, grace_s=1)


class CpuSampler:
    """CPU seconds of a process tree, once a second: cores used over any interval."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.samples = pids, []
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), sum(tree_cpu_seconds(p) for p in self.pids)))
            self._stop.wait(1.0)

    def cores(self, t0: float, t1: float) -> float | None:
        inside = [(t, c) for t, c in self.samples if t0 - 1 <= t <= t1 + 1]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return round((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]), 2)

    def stop(self) -> None:
        self._stop.set()


def gpu_mem() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        return repr(exc)


def image_files(folder: str) -> list[str]:
    files = sorted(f for f in glob.glob(os.path.join(folder, "*")) if f.lower().endswith((".jpg", ".jpeg")))
    if not files:
        raise SystemExit(f"no JPEGs in {folder}")
    return files
